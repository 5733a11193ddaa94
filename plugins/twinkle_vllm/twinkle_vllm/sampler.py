"""``vLLMSampler(...)``: the core's ``Sampler`` around :class:`~twinkle_vllm.engine.vLLMEngine`.

The engine lives in :mod:`twinkle_vllm.engine` and imports only the engine
contract. This class adds nothing to the sampler but a constructor with the
engine's arguments and the engine's own methods (``restart``, ``sleep``,
``last_sync_stats``...), so existing code that builds ``vLLMSampler(...)``
keeps working. ``Sampler(vLLMEngine, ...)`` and ``create_sampler("vllm", ...)``
build the same sampler.
"""

from __future__ import annotations

from pathlib import Path

from twinkle_core.factory import NamedSampler
from twinkle_core.mesh import DeviceMesh
from twinkle_vllm.engine import SUPPORTED_PARAMS, vLLMEngine

__all__ = ["vLLMEngine", "vLLMSampler"]


class vLLMSampler(NamedSampler):
    """``Sampler(vLLMEngine, ...)``, named: the arguments are :class:`~twinkle_vllm.engine.vLLMEngine`'s."""

    # What the registry and the Ray front end read before a replica exists; the engine's info says the same.
    engine_name = "vllm"
    supported_params = SUPPORTED_PARAMS
    concurrent_samples = True

    engine_class = vLLMEngine

    @property
    def engine(self) -> vLLMEngine:
        """The engine this sampler holds."""
        engine = super().engine
        assert isinstance(engine, vLLMEngine)
        return engine

    @property
    def model_dir(self) -> Path:
        """The local folder of the model."""
        return self.engine.model_dir

    @property
    def model_id(self) -> str:
        """The model as given."""
        return self.engine.model_id

    @property
    def device_mesh(self) -> DeviceMesh:
        """The devices of this engine (``/get_world_size`` of ``twinkle serve`` reads it)."""
        return self.engine.device_mesh

    @property
    def last_sync_stats(self) -> dict[str, float]:
        """Bytes, seconds and buckets of the last successful weight or adapter push."""
        return self.engine.last_sync_stats

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a sequence unless ``ignore_eos``: the tokenizer's and the generation config's."""
        return self.engine.eos_token_ids

    @property
    def restarts(self) -> int:
        """How many times the engine was restarted (after dying, or by :meth:`restart`)."""
        return self.engine.restarts

    def restart(self) -> None:
        """Stop the engine (dead or not), start a new one and replay the sampler's state into it.

        See :meth:`twinkle_vllm.engine.vLLMEngine.restart`.
        """
        self.engine.restart()

    def sleep(self, level: int = 1) -> None:
        """Free the engine's device memory (vLLM sleep mode; GPU only)."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what :meth:`sleep` freed."""
        self.engine.wake_up(tags)
