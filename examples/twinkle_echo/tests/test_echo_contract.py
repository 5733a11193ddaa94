"""twinkle's conformance suite, run against the echo engine found by name.

``create_sampler("echo")`` goes through the installed entry point when the
distribution is installed (then passing here also proves it is discovered);
otherwise ``conftest.py`` registers the engine in process from the sources.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from twinkle_core import Sampler, create_sampler
from twinkle_core.testing import SamplerContractTests


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
