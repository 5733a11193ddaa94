"""``TorchSampler(...)``: the core's ``Sampler`` around :class:`~twinkle_torch.engine.TorchEngine`.

The engine lives in :mod:`twinkle_torch.engine` and imports only the engine
contract. This class adds nothing to the sampler but a constructor with the
engine's arguments and the engine's own accessors (``model``,
``max_batch_tokens``...), so existing code that builds ``TorchSampler(...)``
and reads ``sampler.model`` keeps working. ``Sampler(TorchEngine, ...)`` and
``create_sampler("torch", ...)`` build the same sampler.
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle_core.factory import NamedSampler
from twinkle_torch.engine import DEFAULT_MAX_BATCH_TOKENS, SUPPORTED_PARAMS, TorchEngine

__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "TorchEngine", "TorchSampler"]


class TorchSampler(NamedSampler):
    """``Sampler(TorchEngine, ...)``, named: the arguments are :class:`~twinkle_torch.engine.TorchEngine`'s."""

    # What the registry and the Ray front end read before a replica exists; the engine's info says the same.
    engine_name = "torch"
    supported_params = SUPPORTED_PARAMS
    concurrent_samples = True

    engine_class = TorchEngine

    @property
    def engine(self) -> TorchEngine:
        """The engine this sampler holds."""
        engine = super().engine
        assert isinstance(engine, TorchEngine)
        return engine

    @property
    def model(self) -> torch.nn.Module:
        """The ``transformers`` model (with any LoRA layers injected)."""
        return self.engine.model

    @property
    def max_batch_tokens(self) -> int:
        """The KV-cache budget of the running batch, in tokens (settable; applies from the next admission)."""
        return self.engine.max_batch_tokens

    @max_batch_tokens.setter
    def max_batch_tokens(self, value: int) -> None:
        self.engine.max_batch_tokens = value

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a sequence unless ``ignore_eos``: the generation config's and the tokenizer's."""
        return self.engine.eos_token_ids

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype."""
        return self.engine.dtype

    @property
    def model_path(self) -> Any:
        """The local folder the model was loaded from."""
        return self.engine.model_path
