"""twinkle's conformance suite, run against the echo engine found by name.

``create_sampler("echo")`` goes through the installed entry point when the
distribution is installed (then passing here also proves it is discovered);
otherwise ``conftest.py`` registers the engine in process from the sources.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from twinkle_core import Sampler, create_sampler
from twinkle_core.testing import SamplerContractTests
from twinkle_core.testing.policy import PolicyContractTests


class TestEchoContract(SamplerContractTests):
    """The default echo model."""

    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls) -> Iterator[Sampler]:
        with create_sampler("echo") as s:
            yield s


class TestEchoContractFromConfig(SamplerContractTests):
    """Another "model" (seed, model id, vocabulary), built from a config mapping."""

    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls) -> Iterator[Sampler]:
        config = {"sampler": "echo", "model_id": "echo-b", "seed": 7, "vocab_size": 512}
        with create_sampler(config) as s:
            yield s


class TestEchoPolicy(PolicyContractTests):
    """The echo engine has no weights and no adapters: every such change is refused and changes nothing."""

    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls) -> Iterator[Sampler]:
        with create_sampler("echo") as s:
            yield s

    @pytest.fixture(scope="class")
    @classmethod
    def base_weights(cls) -> Mapping[str, Any]:
        torch = pytest.importorskip("torch")
        # stand-ins the suite's updates and adapters are built from (the engine refuses them all)
        return {"model.norm.weight": torch.ones(4), "model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)}
