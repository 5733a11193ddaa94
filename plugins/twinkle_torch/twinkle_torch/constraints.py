"""Token constraints, bias and the completion penalties: what happens to the logits before the repetition penalty.

The order is vLLM's (and ``docs/concepts.md``'s), so both engines draw from the
same distribution:

1. masks: ``allowed_token_ids`` (every other token is ``-inf``), ``bad_words``
   (the last token of a bad word whose other tokens end the completion; a
   one-token word always), ``min_tokens`` (the end-of-sequence and stop ids
   while the completion is shorter);
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

    @classmethod
    def of(cls, params: SamplingParams, stop_ids: Sequence[int], tokenizer: Any, vocab: int) -> LogitConstraints | None:
        """The constraints of ``params``, or ``None`` when it sets none of them."""
        if not (
            params.min_tokens
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
        return bool(self.allowed is not None or self.ban_always or self.ban_after or self.min_tokens)

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

    def before_penalty(self, logits: torch.Tensor, outputs: Sequence[Sequence[int]]) -> torch.Tensor:
        """Steps 1 and 2 on ``[rows, vocab]`` float logits (a new tensor); ``outputs``: each row's completion."""
        mask, bias = self._static_parts(logits.device)
        out = logits if mask is None else logits + mask
        if bias is not None:
            out = out + bias
        rows: list[int] = []
        cols: list[int] = []
        for r, done in enumerate(outputs):
            if len(done) < self.min_tokens:
                rows.extend([r] * len(self.stop_ids))
                cols.extend(self.stop_ids)
            for prefix, last in self.ban_after:
                if len(done) >= len(prefix) and list(done[len(done) - len(prefix) :]) == prefix:
                    rows.append(r)
                    cols.append(last)
        if rows:
            if out is logits:
                out = logits.clone()
            out[torch.tensor(rows, device=out.device), torch.tensor(cols, device=out.device)] = NEG_INF
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
