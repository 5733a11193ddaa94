"""The ``twinkle`` entry point of this distribution.

``pyproject.toml`` points the entry point ``echo`` at this module. twinkle
loads it (and every other installed plugin module) on the first engine
lookup, so it imports nothing but ``twinkle_core.plugins`` and registers a
*string*: the engine module is imported only when someone picks ``"echo"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from twinkle_core.plugins import hookimpl

__all__ = ["register_samplers"]


@hookimpl
def register_samplers(register: Callable[[str, Any], None]) -> None:
    """Register ``echo`` -> :class:`twinkle_echo.engine.EchoEngine`."""
    register("echo", "twinkle_echo.engine:EchoEngine")
