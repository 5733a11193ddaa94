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
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["available", "use_onednn"]

_DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    """Whether this PyTorch build has the oneDNN linear kernel."""
    return bool(getattr(torch._C, "_has_mkldnn", False)) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias
    if (
        x.device.type != "cpu"
        or weight.device.type != "cpu"
        or x.dtype != weight.dtype
        or weight.dtype not in _DTYPES
        or (bias is not None and bias.dtype != weight.dtype)
        or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))  # the kernel has no backward
    ):
        return torch.nn.functional.linear(x, weight, bias)
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


def use_onednn(model: Any) -> int:
    """Give every plain ``nn.Linear`` of ``model`` the oneDNN forward; returns how many.

    Subclasses (quantised layers and the like) keep their own forward.
    """
    if not available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]
            count += 1
    return count
