"""``twinkle.template``: the objects of :mod:`twinkle_core.template`, under the reference docs' name."""

from __future__ import annotations

import twinkle_core.template as _core
from twinkle._alias import forwarder
from twinkle_core.template import *  # noqa: F403

__all__: list[str] = []
__all__ += _core.__all__

__getattr__, __dir__ = forwarder(__name__, _core, __all__)
