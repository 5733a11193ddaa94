"""``vLLMSampler(...)``: the core's ``Sampler`` around :class:`~twinkle_vllm.engine.vLLMEngine`.

The engine lives in :mod:`twinkle_vllm.engine` and imports only the engine
contract. This class adds nothing to the sampler but a constructor with the
engine's arguments and the engine's own methods (``restart``, ``sleep``,
``last_sync_stats``...), so existing code that builds ``vLLMSampler(...)``
keeps working. ``Sampler(vLLMEngine, ...)`` and ``create_sampler("vllm", ...)``
build the same sampler.
"""

from __future__ import annotations

from twinkle_core.factory import NamedSampler
from twinkle_vllm.engine import vLLMEngine

__all__ = ["vLLMEngine", "vLLMSampler"]


class vLLMSampler(NamedSampler):
    """``Sampler(vLLMEngine, ...)``, named: the arguments are :class:`~twinkle_vllm.engine.vLLMEngine`'s."""

    engine_class = vLLMEngine
    #: What the sampler reads (and sets) through: the engine's own accessors.
    engine_accessors = frozenset(
        {
            "model_dir",
            "model_id",
            "device_mesh",
            "last_sync_stats",
            "eos_token_ids",
            "restarts",
            "restart",
            "sleep",
            "wake_up",
        }
    )

    @property
    def engine(self) -> vLLMEngine:
        """The engine this sampler holds."""
        engine = super().engine
        assert isinstance(engine, vLLMEngine)
        return engine
