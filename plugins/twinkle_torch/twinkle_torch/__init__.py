"""twinkle engine on PyTorch + transformers.

Importing this package is cheap (the ``twinkle`` entry point imports it):
``TorchSampler`` and torch load on first use of the name.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TorchSampler"]


def __getattr__(name: str) -> Any:
    if name == "TorchSampler":
        from twinkle_torch.sampler import TorchSampler

        return TorchSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
