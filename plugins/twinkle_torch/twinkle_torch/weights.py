"""Replacing base-model weights in place, by their Hugging Face ``state_dict`` names.

Names are those of the model as loaded (``model.layers.0.self_attn.q_proj.weight``),
whatever LoRA layers were injected since: a name that now lives under a PEFT
layer's ``base_layer`` resolves there. A mixture-of-experts layer's experts,
held fused (``...mlp.experts.gate_up_proj``, ``[experts, rows, hidden]``), also
answer to a checkpoint's per-expert names (``...mlp.experts.3.gate_proj.weight``,
see :func:`twinkle_core.names.expert_parts`): those resolve to the expert's rows
of the fused tensor, so one expert can be updated alone. Every tensor is checked (name, shape,
dtype) before any is copied, so a rejected update changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from twinkle_core.engine import TensorSpec, check_update
from twinkle_core.errors import WeightUpdateError, did_you_mean
from twinkle_core.names import expert_parts, known_names

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
        self._spec_cache: dict[str, TensorSpec] | None = None
        # a checkpoint's per-expert name -> (fused name, expert, first row, end row)
        self._expert_rows: dict[str, tuple[str, int, int, int]] = {}
        self._spec()  # read now, before any adapter changes the module tree

    def _resolve(self, name: str) -> torch.Tensor:
        from peft.tuners.tuners_utils import BaseTunerLayer

        if name in self._expert_rows:  # one expert's rows of a fused expert tensor: a view, written in place
            fused, expert, start, end = self._expert_rows[name]
            return self._resolve(fused)[expert, start:end]
        path, _, attr = name.rpartition(".")
        module = self.model.get_submodule(path) if path else self.model
        if isinstance(module, BaseTunerLayer):
            module = module.get_base_layer()
        tensor = getattr(module, attr)
        if not isinstance(tensor, torch.Tensor):  # pragma: no cover - state_dict names resolve to tensors
            raise WeightUpdateError(f"Weight {name!r} does not resolve to a tensor in this model.")
        return tensor

    def read(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """Copies of the current values of ``names`` (the base values a merged adapter is merged into).

        Raises:
            AdapterError: a name that is not a weight of this model, or a weight
                shared with another name (tied embeddings: merging into one would change both).
        """
        from twinkle_core.errors import AdapterError

        spec = self._spec()
        out = {}
        for name in names:
            if name not in spec:
                raise AdapterError(
                    f"merge=True: the adapter changes {name!r}, which is not a weight of this model."
                    f"{did_you_mean(name, spec)}"
                )
            tensor = self._resolve(name)
            if name in self._shared():
                raise AdapterError(
                    f"merge=True: {name!r} is tied to another weight of this model; merging into it would change"
                    " both. Load this adapter with merge=False."
                )
            out[name] = tensor.detach().clone()
        return out

    def _shared(self) -> set[str]:
        """Names whose tensor is also another name's (tied weights)."""
        by_ptr: dict[int, list[str]] = {}
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            by_ptr.setdefault(tensor.data_ptr(), []).append(name)
        return {n for group in by_ptr.values() if len(group) > 1 for n in group}

    def check(self, named_tensors: Sequence[tuple[str, Any]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Validate an update; return ``(target, new value)`` pairs ready to copy.

        The shared checks of :func:`twinkle_core.weights.check_update`
        (floating-point values may come in another floating-point dtype: a
        trainer in bfloat16 updating a float32 sampler; they are cast). Each
        value is then staged on the model's device in its dtype, so every
        conversion that can fail has happened before the first copy.

        Raises:
            WeightUpdateError: an unknown or repeated name, a value that is not a
                tensor, a shape or dtype that does not fit, or a value that cannot
                be moved to the model's device.
        """
        checked = check_update(named_tensors, self._spec())
        pairs = []
        for name, value in checked.items():
            target = self._resolve(name)
            try:
                staged = value.detach().to(device=target.device, dtype=target.dtype)
            except (RuntimeError, TypeError) as exc:
                raise WeightUpdateError(
                    f"update_weights: {name!r} cannot be moved to {target.device} as {target.dtype}: {exc};"
                    " nothing was updated."
                ) from exc
            pairs.append((target, staged))
        return pairs

    def spelled(self, named_tensors: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """The pairs with each name as this model spells it: a checkpoint's nested names
        (``model.language_model.*``) or a trainer's (``model.*``), see :mod:`twinkle_core.names`."""
        return known_names(named_tensors, self._spec())

    def _spec(self) -> dict[str, TensorSpec]:
        if self._spec_cache is None:
            spec = {}
            for name, t in self.model.state_dict().items():
                dtype = str(t.dtype).removeprefix("torch.")
                spec[name] = TensorSpec(tuple(t.shape), dtype)
                for part, expert, start, end in expert_parts(name, tuple(t.shape)):
                    self._expert_rows[part] = (name, expert, start, end)
                    spec.setdefault(part, TensorSpec((end - start, *t.shape[2:]), dtype))
            self._spec_cache = spec
        return self._spec_cache

    @staticmethod
    def apply(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy staged values into the model (same device, dtype and shape: a copy that cannot fail halfway)."""
        with torch.no_grad():
            for target, value in pairs:
                target.copy_(value)
