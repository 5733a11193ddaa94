"""A vLLM logits processor for temperatures outside vLLM's own range.

vLLM's ``SamplingParams`` refuses ``temperature > 2`` and raises anything in
``(0, 0.01)`` to 0.01. twinkle accepts any temperature >= 0, so for those the
request runs at vLLM temperature 1 and this processor divides the logits by the
real temperature. It is *argmax invariant*, so vLLM applies it at exactly the
place temperature is applied: after penalties, before top-k / top-p, and the
"processed" log-probs include it. min-p depends on the temperature, so for
these requests it is applied here too, after the division (vLLM's built-in
min-p runs before custom processors and is switched off for them).

This module is imported inside vLLM's worker processes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig

__all__ = ["EXTRA_ARG", "TemperatureProcessor"]

#: Key in ``SamplingParams.extra_args``: ``(temperature, min_p)``.
EXTRA_ARG = "twinkle_temperature"


class TemperatureProcessor(LogitsProcessor):
    """Divides a request's logits by ``extra_args['twinkle_temperature'][0]``, then applies its min-p."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        # batch row -> (temperature, min_p); empty for nearly every batch, so apply() is free.
        self._rows: dict[int, tuple[float, float]] = {}

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        """Reject a malformed ``twinkle_temperature`` before it reaches the engine."""
        extra = sampling_params.extra_args or {}
        if EXTRA_ARG in extra:
            value = extra[EXTRA_ARG]
            if not (isinstance(value, (list, tuple)) and len(value) == 2 and float(value[0]) > 0):
                raise ValueError(f"extra_args[{EXTRA_ARG!r}] must be (temperature > 0, min_p), got {value!r}")

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
                rows[index] = (float(value[0]), float(value[1]))
        for a, b, direction in batch_update.moved:
            entry_a, entry_b = rows.pop(a, None), rows.pop(b, None)
            if entry_a is not None:
                rows[b] = entry_a
            if direction == MoveDirectionality.SWAP and entry_b is not None:
                rows[a] = entry_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Scale the tracked rows in place."""
        for index, (temperature, min_p) in self._rows.items():
            row = logits[index]
            row.div_(temperature)
            if min_p > 0:
                probs = torch.softmax(row, dim=-1)
                row.masked_fill_(probs < probs.max() * min_p, float("-inf"))
        return logits
