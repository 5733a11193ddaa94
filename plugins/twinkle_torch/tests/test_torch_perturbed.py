"""The shared suites again, on tiny models whose every weight is nudged: the guard against luck.

Expectations in the shared suites must come from the engine's own outputs.
One that holds only because the tiny model's greedy decoding happened to emit
(or not emit) some token passes on the CPU it was written on and fails on a
CPU that rounds a near-tie the other way (AMD and Intel do), or that trains
the tiny model (built on the machine) to slightly other weights. Two other
models decode the suites' prompts differently: the Qwen2 tiny model and the
Llama one with noise on every weight
(:func:`twinkle_core.testing.tiny_model.perturbed_tiny_model`), so such a
test fails here too, on the developer's machine, before a user on another
CPU sees it. The torch engine is the cheap one to run them on; the suites
are the same for every engine.
"""

from __future__ import annotations

from pathlib import Path

import pytest

# the modules, not their classes: a class imported here would be collected twice
import test_torch_async as torch_async
import test_torch_contract as torch_contract

from twinkle_core.data_format import Trajectory
from twinkle_core.testing import CONTRACT_PROMPTS
from twinkle_core.testing.tiny_model import build_tiny_model, perturbed_tiny_model
from twinkle_torch import TorchSampler


@pytest.fixture(scope="module", params=["qwen2", "llama-nudged"])
def nudged(request: pytest.FixtureRequest) -> Path:
    """Another tiny model: the Qwen2 one (trained apart), and the Llama one with 10% noise on its weights."""
    if request.param == "qwen2":
        return build_tiny_model("qwen2")
    return perturbed_tiny_model("llama", seed=2, scale=0.1)


def test_the_nudged_models_decode_differently(nudged: Path, tiny_llama: Path) -> None:
    # the guard is only a guard if the suites' own prompts decode differently on these models
    prompts = [Trajectory(messages=m) for m in CONTRACT_PROMPTS]
    params = {"temperature": 0.0, "max_tokens": 64, "ignore_eos": True}
    with TorchSampler(tiny_llama, device="cpu") as base, TorchSampler(nudged, device="cpu") as other:
        a = [r.sequences[0].tokens for r in base.sample(prompts, params)]
        b = [r.sequences[0].tokens for r in other.sample(prompts, params)]
    assert a != b


class TestNudgedContract(torch_contract.TestTorchSamplerContract):
    @pytest.fixture(scope="class")
    @classmethod
    def tiny_llama(cls, nudged: Path) -> Path:  # the same tests, on the other model
        return nudged


class TestNudgedAsync(torch_async.TestTorchAsync):
    @pytest.fixture(scope="class")
    @classmethod
    def tiny_llama(cls, nudged: Path) -> Path:
        return nudged
