"""``EchoSampler(...)``: what users build, the core's ``Sampler`` around :class:`~twinkle_echo.engine.EchoEngine`.

The engine module imports only the engine contract; this one is the user's
shortcut, the same as ``create_sampler("echo", ...)``. Being a
``NamedSampler``, it takes the engine's arguments, and ``remote_group=`` for
Ray replicas.
"""

from __future__ import annotations

from twinkle_core import NamedSampler
from twinkle_echo.engine import EchoEngine

__all__ = ["EchoSampler"]


class EchoSampler(NamedSampler):
    """``Sampler(EchoEngine, *args, **kwargs)``: the arguments are :class:`EchoEngine`'s."""

    engine_class = EchoEngine
