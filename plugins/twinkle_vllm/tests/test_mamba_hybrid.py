"""A Mamba-2 hybrid on vLLM's CPU build: the tiny random Granite 4.0 hybrid, in float32, against the torch engine.

vLLM's CPU build runs Granite 4.0 hybrid's Mamba-2 layers in its own C++
kernels (causal convolution, selective state update) in any dtype, so unlike
the Gated DeltaNet hybrids the engine keeps float32 here, and its greedy
sequences are held to the torch engine's at the plain models' float32 bar
(:data:`test_parity.ATOL`). A state carried to the wrong row or a chunk
boundary mishandled moves log-probs by whole nats. The model is the torch
engine's tiny Granite (:func:`twinkle_core.testing.tiny_random.build_tiny_granite_hybrid`):
random weights, three Mamba-2 layers and one attention layer, prompts
longer than its 16-token scan chunks.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.testing import TINY_CHAT_PROMPTS
from twinkle_core.testing.parity import assert_greedy_parity
from twinkle_core.testing.tiny_random import build_tiny_granite_hybrid
from twinkle_vllm._hybrid import hybrid_options

from .conftest import make_sampler
from .test_parity import ATOL

pytest.importorskip("twinkle_torch", reason="the torch engine (twinkle-torch) is not installed")

PROMPTS = [Trajectory(messages=m) for m in TINY_CHAT_PROMPTS[:6]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_granite_hybrid(tmp_path_factory.mktemp("granite"))


def test_its_options_keep_float32_and_turn_prefix_caching_off(granite: Path) -> None:
    # vLLM caches a Mamba hybrid's prefixes only with chunked prefill, which twinkle turns off on CPU
    assert hybrid_options(granite, {"dtype": "float32"}, cpu=True) == {"enable_prefix_caching": False}


def test_greedy_parity_with_the_torch_engine_in_float32(granite: Path) -> None:
    from twinkle_torch import TorchSampler

    with make_sampler(granite) as sampler:
        assert str(sampler.engine._facts.dtype) == "torch.float32"
        got = sampler.sample(PROMPTS, GREEDY)
    with TorchSampler(granite, device="cpu") as torch_sampler:
        want = torch_sampler.sample(PROMPTS, GREEDY)
    assert_greedy_parity([r.sequences[0] for r in got], [r.sequences[0] for r in want], atol=ATOL)
