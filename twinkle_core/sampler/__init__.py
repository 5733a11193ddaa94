"""The ``Sampler`` users hold, and the parts it is made of (one file each).

* :mod:`~twinkle_core.sampler.facade`: ``Sampler``, the public API, over the parts below.
* :mod:`~twinkle_core.sampler.policy`: what the sampler serves (adapters,
  weights version, the lock, the calls in flight) and the one path that changes it.
* :mod:`~twinkle_core.sampler.templates`: the chat template and tokenizer.
* :mod:`~twinkle_core.sampler.sequences`: builds every sequence a call returns.
* :mod:`~twinkle_core.sampler.context`: what the engine may use, made of those parts.
* :mod:`~twinkle_core.sampler.calls`: check, run, stream, abort, continue and settle a call.
* :mod:`~twinkle_core.sampler.continuation`: what continuing an aborted sequence runs, and the join.
* :mod:`~twinkle_core.sampler.adapters` and :mod:`~twinkle_core.sampler.weights`: the state changes.

``from twinkle_core.sampler import vLLMSampler, TorchSampler`` resolves the
engine classes lazily through the registry: importing one never imports the
other.
"""

from __future__ import annotations

from typing import Any

from twinkle_core.data_format.params import resolve_params
from twinkle_core.inputs import OnInvalid, SampleInputs, normalize_inputs
from twinkle_core.sampler.facade import Sampler, require_engine_class
from twinkle_core.sampler.policy import AdapterInfo, AppliedWithError

__all__ = [
    "AdapterInfo",
    "AppliedWithError",
    "OnInvalid",
    "SampleInputs",
    "Sampler",
    "normalize_inputs",
    "require_engine_class",
    "resolve_params",
]


def __getattr__(name: str) -> Any:
    # Seed compatibility: ``from twinkle_core.sampler import vLLMSampler`` finds the
    # registered engine whose class has that name, importing only that engine.
    if not name.startswith("_"):
        from twinkle_core.plugins.engines import engine_class_named

        cls = engine_class_named(name)
        if cls is not None:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
