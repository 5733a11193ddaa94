"""``EchoSampler(...)``: what users build, the core's ``Sampler`` around :class:`~twinkle_echo.engine.EchoEngine`.

The engine module imports only the engine contract; this one is the user's
shortcut, the same as ``create_sampler("echo", ...)``.
"""

from __future__ import annotations

from typing import Any

from twinkle_core import Sampler
from twinkle_echo.engine import EchoEngine

__all__ = ["EchoSampler"]


def EchoSampler(*args: Any, **kwargs: Any) -> Sampler:
    """``Sampler(EchoEngine, *args, **kwargs)``: the arguments are :class:`EchoEngine`'s (``remote_group=`` too)."""
    return Sampler(EchoEngine, *args, **kwargs)
