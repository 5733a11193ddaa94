"""``TorchSampler(...)``: the core's ``Sampler`` around :class:`~twinkle_torch.engine.TorchEngine`.

The engine lives in :mod:`twinkle_torch.engine` and imports only the engine
contract. This class adds nothing to the sampler but a constructor with the
engine's arguments and the engine's own accessors (``model``,
``max_batch_tokens``...), so existing code that builds ``TorchSampler(...)``
and reads ``sampler.model`` keeps working. ``Sampler(TorchEngine, ...)`` and
``create_sampler("torch", ...)`` build the same sampler.
"""

from __future__ import annotations

from twinkle_core.factory import NamedSampler
from twinkle_torch.engine import DEFAULT_MAX_BATCH_TOKENS, TorchEngine

__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "TorchEngine", "TorchSampler"]


class TorchSampler(NamedSampler):
    """``Sampler(TorchEngine, ...)``, named: the arguments are :class:`~twinkle_torch.engine.TorchEngine`'s."""

    engine_class = TorchEngine
    #: What the sampler reads (and sets) through: the engine's own accessors.
    engine_accessors = frozenset({"model", "max_batch_tokens", "eos_token_ids", "device", "dtype", "model_path"})

    @property
    def engine(self) -> TorchEngine:
        """The engine this sampler holds."""
        engine = super().engine
        assert isinstance(engine, TorchEngine)
        return engine
