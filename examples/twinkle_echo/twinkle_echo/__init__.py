"""twinkle-echo: a deterministic, pure-Python toy engine for twinkle.

A worked example of an out-of-tree engine plugin. Users pick it by name::

    import twinkle_core
    sampler = twinkle_core.create_sampler("echo")

Importing this package is cheap: the names below load on first use, so
loading the entry point (``twinkle_echo.plugin``) never imports the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["EchoEngine", "EchoModel", "EchoSampler", "EchoTokenizer", "__version__"]

_LAZY = {
    "EchoEngine": "twinkle_echo.engine",
    "EchoSampler": "twinkle_echo.sampler",
    "EchoModel": "twinkle_echo.model",
    "EchoTokenizer": "twinkle_echo.tokenizer",
}

if TYPE_CHECKING:
    from twinkle_echo.engine import EchoEngine
    from twinkle_echo.model import EchoModel
    from twinkle_echo.sampler import EchoSampler
    from twinkle_echo.tokenizer import EchoTokenizer


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
