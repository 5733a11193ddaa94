"""Qwen3.5 with images on vLLM's CPU build: the tiny Qwen3.5 VL, its tower loaded on request, one engine.

A Qwen3.5 checkpoint runs its language model only unless the engine is
started with ``language_model_only=False`` (:mod:`twinkle_vllm._hybrid`);
then vLLM runs ``Qwen3_5ForConditionalGeneration`` with its vision tower,
in bfloat16 (its CPU Gated DeltaNet kernels' only dtype), and the images'
expansion is checked against the template's (:mod:`twinkle_vllm._media`).

**Parity with the torch engine, in bfloat16**, under a tolerance derived as
``test_hybrid`` derives its own: twice the largest gap between transformers'
bfloat16 and float32 forwards of the VL class over the compared tokens, the
images' processed inputs included (the rounding one bfloat16 computation of
this model carries, images and all). An image ignored or misplaced moves
the log-probs by whole nats, and the tiny model answers the same question
about two images differently.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.testing.parity import assert_greedy_parity, hf_logprobs

from .conftest import TEST_ENGINE_ARGS

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)
#: The test engine's options without a dtype (bfloat16 is the engine's own choice), with the tower.
ENGINE_ARGS = {
    **{k: v for k, v in TEST_ENGINE_ARGS.items() if k != "dtype"},
    "kv_cache_memory_bytes": 1 << 28,
    "language_model_only": False,
}


def _image_chat(seed: int, size: tuple[int, int]) -> list[dict[str, Any]]:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    content = [{"type": "image", "image": Image.fromarray(pixels)}, {"type": "text", "text": "What is it?"}]
    return [{"role": "user", "content": content}]


#: Two images of two shapes (grids of 2x1 and 2x2 tokens) and a text prompt.
PROMPTS = [
    Trajectory(messages=_image_chat(1, (90, 40))),
    Trajectory(messages=_image_chat(2, (96, 96))),
    Trajectory(messages=[{"role": "user", "content": "What is the capital of France?"}]),
]


@pytest.fixture(scope="module")
def folder() -> Path:
    from twinkle_core.testing.tiny_layouts import build_tiny_qwen3_5_vl

    return build_tiny_qwen3_5_vl()


@pytest.fixture(scope="module")
def vllm_sampler(folder: Path) -> Iterator[Any]:
    from twinkle_vllm.sampler import vLLMSampler

    with vLLMSampler(folder, engine_args=ENGINE_ARGS) as sampler:
        yield sampler


def _rounding_of_bfloat16(folder: Path, features: list[Any], sequences: list[Any]) -> float:
    """The largest gap between the VL class's bfloat16 and float32 forwards over these sequences' tokens."""
    import torch
    from transformers import AutoModelForImageTextToText

    logprobs = []
    for dtype in (torch.bfloat16, torch.float32):
        model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=dtype).eval()
        logprobs.append(
            [
                hf_logprobs(model, f, s.tokens).gather(-1, torch.tensor(s.tokens)[:, None])[:, 0]
                for f, s in zip(features, sequences)
            ]
        )
    return max(float((a - b).abs().max()) for a, b in zip(*logprobs))


def test_images_sample_in_bfloat16_at_greedy_parity_with_the_torch_engine(vllm_sampler: Any, folder: Path) -> None:
    from twinkle_torch.sampler import TorchSampler

    assert str(vllm_sampler.engine._facts.dtype) == "torch.bfloat16"
    assert vllm_sampler.engine.info.media == {"image"}
    got = [r.sequences[0] for r in vllm_sampler.sample(PROMPTS, GREEDY)]
    with TorchSampler(folder, dtype="bfloat16") as torch_sampler:
        features = [torch_sampler.template.encode(t) for t in PROMPTS]
        want = [r.sequences[0] for r in torch_sampler.sample(PROMPTS, GREEDY)]
    tolerance = 2 * _rounding_of_bfloat16(folder, features, want)
    assert_greedy_parity(got, want, atol=tolerance)
    assert got[0].tokens != got[1].tokens  # one question, two images: two answers


def test_without_the_tower_the_engine_declares_no_media_so_an_image_is_refused(folder: Path) -> None:
    """The default (``language_model_only``, the tower skipped): vLLM takes no image, and the engine says so,
    so the sampler refuses a prompt with one by name before any work instead of sampling it without its image."""
    from vllm.config import ModelConfig

    from twinkle_vllm._hybrid import hybrid_options
    from twinkle_vllm._media import engine_media

    options = hybrid_options(folder, {}, cpu=True)
    assert options["language_model_only"] is True
    config = ModelConfig(model=str(folder), language_model_only=True, dtype=options["dtype"])
    assert engine_media(config) == frozenset()
