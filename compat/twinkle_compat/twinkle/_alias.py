"""How each ``twinkle`` module forwards to its ``twinkle_core`` twin.

Every module of the alias star-imports its twin (so type checkers and IDEs see
the names) and installs the module-level ``__getattr__`` built here for the
rest: names the twin resolves lazily (``twinkle_core.sampler.vLLMSampler``
goes through the engine registry and imports only that engine) and public
names outside ``__all__``. Forwarding, never copying, is what keeps
``twinkle.X is twinkle_core.X`` true for every object.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any


def forwarder(
    alias: str, target: ModuleType, exported: list[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Build the ``__getattr__`` and ``__dir__`` of the alias module ``alias``.

    Args:
        alias: the alias module's name (``"twinkle.sampler"``), for messages.
        target: the ``twinkle_core`` module it stands for.
        exported: the alias module's ``__all__``, so ``dir()`` lists its own names too.

    Returns:
        ``(__getattr__, __dir__)`` for the alias module's globals.
    """

    def __getattr__(name: str) -> Any:
        # Private names stay private: the alias promises the public API only.
        if not name.startswith("_"):
            try:
                return getattr(target, name)
            except AttributeError:
                pass
        raise AttributeError(
            f"module {alias!r} has no attribute {name!r}. This 'twinkle' is the twinkle-core alias"
            f" (twinkle-compat): it offers what {target.__name__!r} offers."
        )

    def __dir__() -> list[str]:
        return sorted({n for n in dir(target) if not n.startswith("_")} | set(exported))

    return __getattr__, __dir__
