"""Token constraints, bias and the completion penalties: what happens to the logits before the repetition penalty.

The order is vLLM's (and ``docs/concepts.md``'s), so both engines draw from the
same distribution:

1. masks: ``structured_outputs`` (what the grammar cannot take next),
   ``allowed_token_ids`` (every other token is ``-inf``), ``bad_words`` (the
   last token of a bad word whose other tokens end the completion; a one-token
   word always), ``min_tokens`` (the end-of-sequence and stop ids while the
   completion is shorter; with a grammar, not where that would leave nothing,
   as vLLM does);
2. ``logit_bias`` (added);
3. the repetition penalty (in :mod:`twinkle_torch.sampling`);
4. ``frequency_penalty`` times the token's count in the completion, and
   ``presence_penalty`` if it is there at all, subtracted.

The completion is every token generated for the sequence, those of an earlier
run it continues included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from twinkle_core.data_format import SamplingParams, bad_word_token_ids, check_constraints
from twinkle_core.data_format.structured import compile_structured

__all__ = ["LogitConstraints"]

NEG_INF = float("-inf")


class LogitConstraints:
    """The masks, bias and penalties of one ``SamplingParams`` (see the module docstring).

    Args:
        params: the request's parameters.
        stop_ids: what ``min_tokens`` holds back: the end-of-sequence ids (even
            with ``ignore_eos``, as vLLM does) and ``stop_token_ids``.
        tokenizer: for ``bad_words``.
        vocab: the vocabulary size (the logits' width).

    Raises:
        InvalidSamplingParams: bad words that cannot be tokenized (see ``bad_word_token_ids``).
    """

    def __init__(self, params: SamplingParams, stop_ids: Sequence[int], tokenizer: Any, vocab: int) -> None:
        self.min_tokens = params.min_tokens
        self.stop_ids = sorted({t for t in stop_ids if 0 <= t < vocab})
        self.frequency = params.frequency_penalty
        self.presence = params.presence_penalty
        words = bad_word_token_ids(tokenizer, params.bad_words, vocab) if params.bad_words else []
        check_constraints(params, words, self.stop_ids)
        self.ban_always = sorted({ids[0] for ids in words if len(ids) == 1})
        self.ban_after = [(ids[:-1], ids[-1]) for ids in words if len(ids) > 1]
        self.allowed = params.allowed_token_ids
        self.bias = params.logit_bias
        self._static: dict[torch.device, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self.vocab = vocab
        self.structured = params.structured_outputs
        self._grammar_stops = sorted({t for t in stop_ids if 0 <= t < vocab})
        self._tokenizer = tokenizer
        if self.structured is not None:  # a schema that does not compile fails here, before any work
            self.new_matcher()

    def new_matcher(self, done: Sequence[int] = ()) -> Any:
        """A grammar matcher for one sequence, fed its completion so far (a continued sequence's tokens)."""
        assert self.structured is not None
        matcher = compile_structured(self.structured, self._tokenizer, self.vocab, self._grammar_stops)
        for token in done:
            if not matcher.accept_token(int(token)):
                break  # an earlier run's tokens the grammar refuses: only possible if the grammar changed
        return matcher

    @classmethod
    def of(cls, params: SamplingParams, stop_ids: Sequence[int], tokenizer: Any, vocab: int) -> LogitConstraints | None:
        """The constraints of ``params``, or ``None`` when it sets none of them."""
        if not (
            params.min_tokens
            or params.structured_outputs is not None
            or params.frequency_penalty
            or params.presence_penalty
            or params.bad_words
            or params.allowed_token_ids is not None
            or params.logit_bias
        ):
            return None
        return cls(params, stop_ids, tokenizer, vocab)

    @property
    def masks(self) -> bool:
        """Whether some tokens may be removed (so the sampling mask must list the kept ones)."""
        return bool(
            self.allowed is not None
            or self.ban_always
            or self.ban_after
            or self.min_tokens
            or self.structured is not None
        )

    def _static_parts(self, device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``[vocab]`` additions that do not depend on the row: the fixed bans and the bias."""
        parts = self._static.get(device)
        if parts is None:
            mask = None
            if self.allowed is not None or self.ban_always:
                mask = torch.zeros(self.vocab, dtype=torch.float32, device=device)
                if self.allowed is not None:
                    mask.fill_(NEG_INF)
                    mask[torch.tensor(self.allowed, dtype=torch.long, device=device)] = 0.0
                if self.ban_always:
                    mask[torch.tensor(self.ban_always, dtype=torch.long, device=device)] = NEG_INF
            bias = None
            if self.bias:
                bias = torch.zeros(self.vocab, dtype=torch.float32, device=device)
                ids = torch.tensor([t for t, _ in self.bias], dtype=torch.long, device=device)
                bias[ids] = torch.tensor([b for _, b in self.bias], dtype=torch.float32, device=device)
            parts = self._static[device] = (mask, bias)
        return parts

    def before_penalty(
        self, logits: torch.Tensor, outputs: Sequence[Sequence[int]], matchers: Sequence[Any] | None = None
    ) -> torch.Tensor:
        """Steps 1 and 2 on ``[rows, vocab]`` float logits (a new tensor).

        ``outputs``: each row's completion; ``matchers``: each row's grammar
        matcher (with ``structured_outputs``), which this does not advance.
        """
        mask, bias = self._static_parts(logits.device)
        out = logits.clone()
        if matchers is not None:
            import xgrammar as xgr

            bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab)
            for r, matcher in enumerate(matchers):
                if not matcher.is_terminated():
                    matcher.fill_next_token_bitmask(bitmask, r)
            xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device), vocab_size=self.vocab)
        if mask is not None:
            out += mask
        rows: list[int] = []
        cols: list[int] = []
        held: list[int] = []
        for r, done in enumerate(outputs):
            if len(done) < self.min_tokens and self.stop_ids:
                held.append(r)
            for prefix, last in self.ban_after:
                if len(done) >= len(prefix) and list(done[len(done) - len(prefix) :]) == prefix:
                    rows.append(r)
                    cols.append(last)
        if rows:
            out[torch.tensor(rows, device=out.device), torch.tensor(cols, device=out.device)] = NEG_INF
        if held:
            idx = torch.tensor(held, device=out.device)
            stops = torch.tensor(self.stop_ids, device=out.device)
            before = out[idx][:, stops]
            out[idx.unsqueeze(1), stops.unsqueeze(0)] = NEG_INF
            if matchers is not None:  # vLLM's rule: a grammar that can only stop may stop, min_tokens or not
                empty = ~torch.isfinite(out[idx]).any(dim=-1)
                if bool(empty.any()):
                    back = idx[empty]
                    out[back.unsqueeze(1), stops.unsqueeze(0)] = before[empty]
        if bias is not None:
            out += bias
        return out

    def after_penalty(self, logits: torch.Tensor, outputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Step 4: the frequency and presence penalties over each row's completion."""
        if not (self.frequency or self.presence) or not any(outputs):
            return logits
        rows = torch.tensor([r for r, done in enumerate(outputs) for _ in done], device=logits.device)
        cols = torch.tensor([t for done in outputs for t in done], dtype=torch.long, device=logits.device)
        counts = torch.zeros_like(logits)
        counts.index_put_((rows, cols), torch.ones(len(cols), device=logits.device), accumulate=True)
        penalty = counts * self.frequency + (counts > 0).to(logits.dtype) * self.presence
        return logits - penalty
