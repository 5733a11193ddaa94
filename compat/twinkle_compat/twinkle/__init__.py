"""``twinkle``: an opt-in alias of :mod:`twinkle_core` under the reference docs' import name.

Installed by ``pip install "twinkle-core[compat]"`` (the ``twinkle-compat``
distribution), so snippets written for the reference documentation run
unchanged::

    import twinkle
    from twinkle import DeviceGroup, DeviceMesh
    from twinkle.sampler import vLLMSampler
    from twinkle.data_format import SamplingParams

    twinkle.initialize('ray', groups=[DeviceGroup(name='sampler', ranks=2, device_type='cpu')])

Every name is the core's own object (``twinkle.DeviceMesh is
twinkle_core.DeviceMesh``), engines included: ``twinkle.sampler.vLLMSampler``
is resolved through the engine registry on first use, like
``twinkle_core.sampler.vLLMSampler``. Importing ``twinkle`` is as cheap as
importing ``twinkle_core``: no torch, transformers, vllm or ray.

Another project also installs a top-level ``twinkle`` package; the two cannot
share an environment. ``twinkle.__twinkle_core__`` tells which one you have:
this alias sets it to the core's version, the other project has no such
attribute.
"""

from __future__ import annotations

import twinkle_core as _core
from twinkle import data_format, sampler, template  # noqa: F401  (so twinkle.sampler etc. resolve; not in __all__)
from twinkle._alias import forwarder
from twinkle_core import *  # noqa: F403  (the alias is the core's public API, by definition)

#: The version of ``twinkle_core`` this alias stands for. Its presence is how a
#: program tells this ``twinkle`` from another project's top-level ``twinkle``:
#: ``getattr(twinkle, "__twinkle_core__", None)``.
__twinkle_core__: str = _core.__version__

# The core's public names, plus the marker; the submodules stay out of ``__all__`` as in the core,
# so ``from twinkle import *`` binds no ``sampler`` name over a user's own variable.
__all__: list[str] = ["__twinkle_core__"]
__all__ += _core.__all__

__getattr__, __dir__ = forwarder(__name__, _core, __all__)
