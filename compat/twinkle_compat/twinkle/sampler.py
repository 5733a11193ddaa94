"""``twinkle.sampler``: the objects of :mod:`twinkle_core.sampler`, under the reference docs' name.

The engine classes (``vLLMSampler``, ``TorchSampler``, any plugin's) are
not listed in ``__all__``: they resolve on first use through the engine
registry, exactly like ``from twinkle_core.sampler import vLLMSampler``, so
importing one never imports the others.
"""

from __future__ import annotations

import twinkle_core.sampler as _core
from twinkle._alias import forwarder
from twinkle_core.sampler import *  # noqa: F403

__all__: list[str] = []
__all__ += _core.__all__

__getattr__, __dir__ = forwarder(__name__, _core, __all__)
