"""twinkle's vLLM logits processors: temperatures outside vLLM's own range, and continued constraints.

(:class:`GrammarProcessor`, at the end, carries a ``structured_outputs``
constraint over from a sequence's earlier tokens; the rest is about temperature.)

vLLM's ``SamplingParams`` refuses ``temperature > 2`` and raises anything in
``(0, 0.01)`` to 0.01. twinkle accepts any temperature >= 0, so for those the
request runs at vLLM temperature 1 and this processor divides the logits by the
real temperature. It is *argmax invariant*, so vLLM applies it at exactly the
place temperature is applied: after penalties, before top-k / top-p, and the
"processed" log-probs include it. min-p depends on the temperature, so for
these requests it is applied here too, after the division (vLLM's built-in
min-p runs before custom processors and is switched off for them).

The order of min-p. twinkle applies min-p *after* top-k and top-p (as Hugging
Face does); vLLM applies it before them, and top-p then measures its nucleus
in the min-p survivors' renormalised mass, so it keeps fewer tokens. A request
with both min-p and top-p therefore runs with vLLM's top-k, top-p and min-p
off, and this processor applies all three, in twinkle's order, after the
temperature (whatever the temperature).

This module is imported inside vLLM's worker processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

__all__ = ["EXTRA_ARG", "GRAMMAR_ARG", "GrammarProcessor", "TemperatureProcessor"]

#: Key in ``SamplingParams.extra_args``: ``(temperature, min_p)``, or
#: ``(temperature, min_p, top_k, top_p)`` to truncate here too (``top_k`` 0: off).
EXTRA_ARG = "twinkle_temperature"


class TemperatureProcessor(LogitsProcessor):
    """Divides a request's logits by ``extra_args['twinkle_temperature'][0]``, then truncates them.

    Truncation: its top-k and top-p when given, then its min-p.
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (temperature, min_p, top_k, top_p); empty for nearly every batch, so apply() is free.
        self._rows: dict[int, tuple[float, float, int, float]] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Reject a malformed ``twinkle_temperature`` before it reaches the engine."""
        extra = sampling_params.extra_args or {}
        if EXTRA_ARG in extra:
            value = extra[EXTRA_ARG]
            if not (isinstance(value, (list, tuple)) and len(value) in (2, 4) and float(value[0]) > 0):
                raise ValueError(
                    f"extra_args[{EXTRA_ARG!r}] must be (temperature > 0, min_p[, top_k, top_p]), got {value!r}"
                )

    def is_argmax_invariant(self) -> bool:
        """Dividing by a positive number never changes the argmax."""
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Track which batch rows carry a twinkle temperature."""
        if batch_update is None:
            return
        rows = self._rows
        for index in batch_update.removed:
            rows.pop(index, None)
        for index, params, _, _ in batch_update.added:
            value = (params.extra_args or {}).get(EXTRA_ARG)
            if value is None:
                rows.pop(index, None)
            else:
                top_k, top_p = (int(value[2]), float(value[3])) if len(value) == 4 else (0, 1.0)
                rows[index] = (float(value[0]), float(value[1]), top_k, top_p)
        for a, b, direction in batch_update.moved:
            entry_a, entry_b = rows.pop(a, None), rows.pop(b, None)
            if entry_a is not None:
                rows[b] = entry_a
            if direction == MoveDirectionality.SWAP and entry_b is not None:
                rows[a] = entry_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Scale the tracked rows in place."""
        for index, (temperature, min_p, top_k, top_p) in self._rows.items():
            row = logits[index]
            row.div_(temperature)
            if top_k > 0 or top_p < 1.0:
                _top_k_top_p(row, top_k, top_p)
            if min_p > 0:
                probs = torch.softmax(row, dim=-1)
                row.masked_fill_(probs < probs.max() * min_p, float("-inf"))
        return logits


def _top_k_top_p(row: torch.Tensor, top_k: int, top_p: float) -> None:
    """Mask ``row`` in place to its top-k, then to the top-p nucleus of what is left (renormalised)."""
    values, ids = row.sort(descending=True)
    drop = torch.zeros_like(values, dtype=torch.bool)
    if 0 < top_k < values.numel():
        drop[top_k:] = True
        values = values.masked_fill(drop, float("-inf"))
    if top_p < 1.0:
        probs = torch.softmax(values, dim=-1)
        drop |= (probs.cumsum(dim=-1) - probs) >= top_p  # the mass ranked above it reached top_p
    row[ids[drop]] = float("-inf")


#: Key in ``SamplingParams.extra_args``: ``{"spec": {kind: spec}, "done": [tokens], "stops": [ids], "vocab": n}``.
GRAMMAR_ARG = "twinkle_grammar"


class GrammarProcessor(LogitsProcessor):
    """A ``structured_outputs`` constraint that goes on from tokens generated before (a continuation).

    vLLM starts a request's grammar at its first generated token; a sequence
    continued after an abort or a weight change is a new request whose prompt
    ends with its earlier tokens, so vLLM's grammar would start over. Such a
    request runs without vLLM's constraint, and this processor masks its logits
    with a matcher that has taken those earlier tokens first: the same mask,
    at the same place (before temperature), as the uninterrupted run.
    """

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._config = vllm_config
        self._tokenizer: Any = None
        # batch row -> (matcher, the request's growing output token list, how many of them the matcher took)
        self._rows: dict[int, list[Any]] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Reject a malformed ``twinkle_grammar`` before it reaches the engine."""
        value = (sampling_params.extra_args or {}).get(GRAMMAR_ARG)
        if value is not None and not (isinstance(value, dict) and {"spec", "done", "stops", "vocab"} <= set(value)):
            raise ValueError(f"extra_args[{GRAMMAR_ARG!r}] must hold spec, done, stops and vocab, got {value!r}")

    def is_argmax_invariant(self) -> bool:
        """A mask changes the argmax."""
        return False

    def _matcher(self, value: dict[str, Any]) -> Any:
        from twinkle_core.data_format.structured import StructuredOutputs, compile_structured

        if self._tokenizer is None:
            from transformers import AutoTokenizer

            model = self._config.model_config
            self._tokenizer = AutoTokenizer.from_pretrained(model.tokenizer, trust_remote_code=model.trust_remote_code)
        structured = StructuredOutputs.from_dict(value["spec"])
        matcher = compile_structured(structured, self._tokenizer, int(value["vocab"]), value["stops"])
        for token in value["done"]:
            if not matcher.accept_token(int(token)):
                break  # the engine checked these against the same grammar: not reached
        return matcher

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Track the rows that continue a constraint, with their matchers."""
        if batch_update is None:
            return
        rows = self._rows
        for index in batch_update.removed:
            rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            value = (params.extra_args or {}).get(GRAMMAR_ARG)
            if value is None:
                rows.pop(index, None)
            else:
                rows[index] = [self._matcher(value), output_ids, 0]
        for a, b, direction in batch_update.moved:
            entry_a, entry_b = rows.pop(a, None), rows.pop(b, None)
            if entry_a is not None:
                rows[b] = entry_a
            if direction == MoveDirectionality.SWAP and entry_b is not None:
                rows[a] = entry_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Feed each tracked row's new tokens to its matcher, then mask the row to what it allows."""
        if not self._rows:
            return logits
        import xgrammar as xgr

        for index, entry in self._rows.items():
            matcher, output_ids, taken = entry
            for token in output_ids[taken:]:
                matcher.accept_token(int(token))
            entry[2] = len(output_ids)
            if matcher.is_terminated():
                continue
            bitmask = xgr.allocate_token_bitmask(1, logits.shape[-1])
            matcher.fill_next_token_bitmask(bitmask, 0)
            row = logits[index : index + 1]
            xgr.apply_token_bitmask_inplace(row, bitmask.to(row.device), vocab_size=logits.shape[-1])
        return logits
