"""Replacing base-model weights in place, by their Hugging Face ``state_dict`` names.

Names are those of the model as loaded (``model.layers.0.self_attn.q_proj.weight``),
whatever LoRA layers were injected since: a name that now lives under a PEFT
layer's ``base_layer`` resolves there. Every tensor is checked (name, shape,
dtype) before any is copied, so a rejected update changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from twinkle_core.errors import did_you_mean
from twinkle_core.errors import WeightUpdateError

__all__ = ["WeightTable"]


class WeightTable:
    """The updatable tensors of a model, by ``state_dict`` name.

    Args:
        model: the ``transformers`` model; its ``state_dict`` names are read now,
            before any adapter changes its module tree.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.names = list(model.state_dict().keys())
        self._known = set(self.names)

    def _resolve(self, name: str) -> torch.Tensor:
        from peft.tuners.tuners_utils import BaseTunerLayer

        path, _, attr = name.rpartition(".")
        module = self.model.get_submodule(path) if path else self.model
        if isinstance(module, BaseTunerLayer):
            module = module.get_base_layer()
        tensor = getattr(module, attr)
        if not isinstance(tensor, torch.Tensor):  # pragma: no cover - state_dict names resolve to tensors
            raise WeightUpdateError(f"Weight {name!r} does not resolve to a tensor in this model.")
        return tensor

    def check(self, named_tensors: Sequence[tuple[str, Any]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Validate an update; return ``(target, new value)`` pairs ready to copy.

        Floating-point values may come in another floating-point dtype (a
        trainer in bfloat16 updating a float32 sampler): they are cast on copy.
        Other dtypes must match exactly.

        Raises:
            WeightUpdateError: an unknown or repeated name, a value that is not a
                tensor, a shape or dtype that does not fit.
        """
        seen: set[str] = set()
        pairs = []
        for name, value in named_tensors:
            if name not in self._known:
                raise WeightUpdateError(
                    f"Unknown weight name {name!r}.{did_you_mean(name, self.names)} Names are the model's Hugging"
                    f" Face state_dict keys, e.g. {self.names[0]!r}; nothing was updated."
                )
            if name in seen:
                raise WeightUpdateError(f"Weight {name!r} is given twice in one update; nothing was updated.")
            seen.add(name)
            if not isinstance(value, torch.Tensor):
                raise WeightUpdateError(
                    f"Weight {name!r} is a {type(value).__name__}, expected a torch.Tensor; nothing was updated."
                )
            target = self._resolve(name)
            if tuple(value.shape) != tuple(target.shape):
                raise WeightUpdateError(
                    f"Weight {name!r} has shape {tuple(value.shape)}, expected {tuple(target.shape)};"
                    " nothing was updated."
                )
            same_kind = value.dtype.is_floating_point and target.dtype.is_floating_point
            if value.dtype != target.dtype and not same_kind:
                raise WeightUpdateError(
                    f"Weight {name!r} has dtype {value.dtype}, expected {target.dtype}"
                    f"{' (or another floating-point dtype)' if target.dtype.is_floating_point else ''};"
                    " nothing was updated."
                )
            pairs.append((target, value))
        return pairs

    @staticmethod
    def apply(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy checked values into the model (casting dtype and device)."""
        with torch.no_grad():
            for target, value in pairs:
                target.copy_(value)
