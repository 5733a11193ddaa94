"""The asynchronous API on the vLLM engine: the shared ``AsyncContractTests``.

vLLM draws the i-th sample of a seeded request from ``seed + i`` over the
whole request: a continued sequence is a fresh request, so it is a valid
sample of the same distribution but not the uninterrupted one
(``exact_seeded_resume = False``; see docs/async.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from twinkle_core.testing.async_contract import AsyncContractTests

from .conftest import make_sampler


class TestVllmAsync(AsyncContractTests):
    exact_seeded_resume = False
    async_logprob_atol = 1e-3

    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls, tiny_model: Path) -> Iterator[Any]:
        with make_sampler(tiny_model) as s:
            yield s

    @pytest.fixture(scope="class")
    @classmethod
    def weights_a(cls, tiny_model: Path) -> dict[str, Any]:
        return load_file(str(tiny_model / "model.safetensors"))

    @pytest.fixture(scope="class")
    @classmethod
    def weights_b(cls, weights_a: dict[str, Any]) -> dict[str, Any]:
        import torch

        key = "lm_head.weight" if "lm_head.weight" in weights_a else "model.embed_tokens.weight"
        return {**weights_a, key: torch.roll(weights_a[key], 1, dims=0)}
