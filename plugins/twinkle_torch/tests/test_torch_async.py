"""The asynchronous API on the torch engine: the shared ``AsyncContractTests``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from twinkle_core.testing.async_contract import AsyncContractTests
from twinkle_torch import TorchSampler


class TestTorchAsync(AsyncContractTests):
    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls, tiny_llama: Path) -> Iterator[TorchSampler]:
        with TorchSampler(tiny_llama, device="cpu") as s:
            yield s

    @pytest.fixture(scope="class")
    @classmethod
    def weights_a(cls, tiny_llama: Path) -> dict[str, Any]:
        return load_file(str(tiny_llama / "model.safetensors"))

    @pytest.fixture(scope="class")
    @classmethod
    def weights_b(cls, weights_a: dict[str, Any]) -> dict[str, Any]:
        key = "lm_head.weight" if "lm_head.weight" in weights_a else "model.embed_tokens.weight"
        return {**weights_a, key: torch.roll(weights_a[key], 1, dims=0)}
