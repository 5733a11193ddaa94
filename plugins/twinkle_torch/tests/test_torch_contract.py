"""TorchSampler passes the engine-independent conformance suites: sampling, and the policy it serves.

Each suite builds its engine from ``tiny_llama``, which ``test_torch_perturbed.py``
overrides to run the sampling suite on other models.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from twinkle_core.testing import SamplerContractTests
from twinkle_core.testing.policy import PolicyContractTests, checkpoint_weights
from twinkle_torch.sampler import TorchSampler


class TestTorchSamplerContract(SamplerContractTests):
    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls, tiny_llama: Path) -> Iterator[TorchSampler]:
        with TorchSampler(tiny_llama, device="cpu") as s:
            yield s


class TestTorchSamplerPolicy(PolicyContractTests):
    adapter_options = ({"merge": True},)

    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls, tiny_llama: Path) -> Iterator[TorchSampler]:
        with TorchSampler(tiny_llama, device="cpu") as s:
            yield s

    @pytest.fixture(scope="class")
    @classmethod
    def base_weights(cls, tiny_llama: Path) -> Mapping[str, Any]:
        return checkpoint_weights(tiny_llama)
