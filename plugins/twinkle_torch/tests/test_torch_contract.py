"""TorchSampler passes the engine-independent conformance suite."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from twinkle_core.testing import SamplerContractTests
from twinkle_torch.sampler import TorchSampler


class TestTorchSamplerContract(SamplerContractTests):
    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls, tiny_llama: Path) -> Iterator[TorchSampler]:
        with TorchSampler(tiny_llama, device="cpu") as s:
            yield s
