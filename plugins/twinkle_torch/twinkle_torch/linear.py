"""The model's linear layers through oneDNN on CPU.

On CPU, ``torch.nn.functional.linear`` goes to a BLAS ``sgemm`` that is
slow on the shapes of a decode step: few rows (the batch) against a whole
weight matrix. The oneDNN matmul PyTorch ships (``mkldnn::_linear_pointwise``,
the kernel ``torch.compile`` uses for CPU linears) runs the same products
faster on the same dense weights: for SmolLM2-135M's 211 linear layers in
float32 on 2 cores, 1.58x at 1 row, 1.48x at 16, 1.3x at 64 and 1.14x at 256
(``bench/profile_torch_step.py`` measures both in the same run). It reads
the module's own ``weight`` at every call, so weight updates, merged
adapters and PEFT's LoRA layers (which call their base layer) need nothing
more; results differ from ``F.linear``'s by the order of the additions
(about 1e-6 relative in float32).

:func:`use_onednn` gives each plain ``nn.Linear`` of a model this forward;
the engine does so for CPU models unless ``linear_kernel="torch"``. It falls
back to ``F.linear`` wherever the kernel does not apply: autograd, another
device or dtype, mixed dtypes.

``use_onednn(model, packed=True)`` (the engine's ``linear_kernel="onednn-packed"``)
runs the same kernel on a copy of each weight reordered into oneDNN's
blocked layout, the fastest matmul this PyTorch has for these shapes, at
the price of that copy: the model's linear weights are held twice. The copy
is made at a layer's first call and made again at the first call after its
weight changed, which a layer tells by the weight's identity, its storage
address and its version counter: every in-place write through the tensor
(``copy_``, ``mul_``... as the engine's weight updates and adapter merges
do) bumps that counter, and a new tensor or ``.data =`` changes the other
two. A write through ``weight.data`` (``layer.weight.data += d``) bumps no
counter and is not seen: call :func:`drop_packed` after one. A weight made
under ``torch.inference_mode`` has no counter: its layer runs on the dense
weight.
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["available", "drop_packed", "use_onednn"]

_DTYPES = (torch.float32, torch.bfloat16)

#: The attribute of a layer that holds its packed weight and what it was packed from.
_PACKED = "_twinkle_packed"


def available(packed: bool = False) -> bool:
    """Whether this PyTorch build has the oneDNN linear kernel (and, with ``packed``, its weight reorder)."""
    if not (bool(getattr(torch._C, "_has_mkldnn", False)) and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    return not packed or hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _applies(layer: torch.nn.Linear, x: torch.Tensor) -> bool:
    weight, bias = layer.weight, layer.bias
    return not (
        x.device.type != "cpu"
        or weight.device.type != "cpu"
        or x.dtype != weight.dtype
        or weight.dtype not in _DTYPES
        or (bias is not None and bias.dtype != weight.dtype)
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))  # the kernel has no backward
    )


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's matmul of ``x`` by ``weight`` (dense, or packed by ``_reorder_linear_weight``)."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not _applies(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)
    return _onednn(x, self.weight, self.bias)


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if not _applies(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)
    weight = self.weight
    if weight.is_inference():  # made under inference_mode: no version counter tells its changes, so no copy
        self.__dict__.pop(_PACKED, None)  # nor a copy of the weight it replaced
        return _onednn(x, weight, self.bias)
    held = self.__dict__.get(_PACKED)
    if held is None or held[0] is not weight or held[1] != weight.data_ptr() or held[2] != weight._version:
        self.__dict__.pop(_PACKED, None)  # the stale copy goes before the new one is made
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        held = self.__dict__[_PACKED] = (weight, weight.data_ptr(), weight._version, packed)
    return _onednn(x, held[3], self.bias)


def use_onednn(model: Any, packed: bool = False) -> int:
    """Give every plain ``nn.Linear`` of ``model`` the oneDNN forward; returns how many.

    ``packed``: run it on packed copies of the weights (see the module's
    docstring). Subclasses (quantised layers and the like) keep their own forward.
    """
    if not available(packed):
        return 0
    forward = _packed_forward if packed else _forward
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
            count += 1
    return count


def drop_packed(model: Any) -> int:
    """Free the packed weight copies of ``model``'s layers (remade at each layer's next call); returns how many."""
    count = 0
    for module in model.modules():
        if module.__dict__.pop(_PACKED, None) is not None:
            count += 1
    return count
