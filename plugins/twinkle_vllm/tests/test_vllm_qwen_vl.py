"""Images for the Qwen-VL family on the vLLM engine: the tiny Qwen3-VL (multimodal rotary positions), one engine.

vLLM builds the model's processor without torchvision (``twinkle_vllm._vllm_plugin``), expands each image as the
template did (the engine refuses a prompt whose expansions differ), and samples what the torch engine samples.

The tolerance is derived, as ``test_vllm_media`` derives its own: the largest gap between transformers'
float32 and float64 forwards over the compared tokens is the rounding one float32 computation of this model
carries, and two computations (the torch engine's, vLLM's) that are each within it of the exact value differ by
at most twice it. An image ignored, or its tokens placed on other rotary positions, moves log-probs by far more.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from twinkle_core.data_format import InputFeature, SampledSequence, SamplingParams, Trajectory
from twinkle_core.errors import InvalidInputError
from twinkle_core.testing.contract import MediaContractTests
from twinkle_core.testing.parity import assert_greedy_parity

from .conftest import make_sampler

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def _image(seed: int, size: tuple[int, int]) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


#: Two images of other sizes (other grids: 6 x 2 and 4 x 3 merged patches), then both in one prompt with text between.
IMAGES = [_image(1, (90, 40)), _image(2, (64, 48))]
PROMPTS = [
    Trajectory(messages=[{"role": "user", "content": "<image>What is in the picture?"}], images=[IMAGES[0]]),
    Trajectory(messages=[{"role": "user", "content": "<image>What is in the picture?"}], images=[IMAGES[1]]),
    Trajectory(messages=[{"role": "user", "content": "Compare <image> with <image> please."}], images=IMAGES),
]


@pytest.fixture(scope="module")
def folder() -> Path:
    from twinkle_core.testing.tiny_qwen_vl import build_tiny_qwen_vl

    return build_tiny_qwen_vl()


@pytest.fixture(scope="module")
def qwen_vl_sampler(folder: Path) -> Iterator[Any]:
    with make_sampler(folder, kv_cache_memory_bytes=1 << 28) as sampler:
        yield sampler


def _rounding(folder: Path, features: list[InputFeature], sequences: list[SampledSequence]) -> float:
    """The largest gap between transformers' float32 and float64 log-probs of ``sequences``' tokens.

    Log-probs are taken in the forward's dtype, as the engines take them: a log-prob near -6 in float32 is
    itself rounded to 4.8e-7, which a float64 log-softmax of float32 logits would not count.
    """
    import torch
    from transformers import AutoModelForImageTextToText

    out: list[list[float]] = []
    for dtype in (torch.float32, torch.float64):
        model = AutoModelForImageTextToText.from_pretrained(str(folder), dtype=dtype).eval()
        values: list[float] = []
        for feature, sequence in zip(features, sequences):
            media = {k: torch.from_numpy(np.asarray(v)) for k, v in (feature.multimodal or {}).items()}
            media = {k: v.to(dtype) if v.is_floating_point() else v for k, v in media.items()}
            tokens = list(sequence.tokens)
            if "mm_token_type_ids" in media:  # one per token: the samples are text
                media["mm_token_type_ids"] = torch.nn.functional.pad(media["mm_token_type_ids"], (0, len(tokens)))
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([[*feature.input_ids, *tokens]]), **media).logits[0]
            logprobs = logits.log_softmax(-1)[len(feature.input_ids) - 1 : -1]  # in the dtype, as an engine does
            values += logprobs.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        out.append(values)
    return max(abs(a - b) for a, b in zip(*out))


def test_qwen_vl_images_sample_on_vllm_as_on_the_torch_engine(qwen_vl_sampler: Any, folder: Path) -> None:
    from twinkle_torch.sampler import TorchSampler

    assert qwen_vl_sampler.engine.info.media == frozenset({"image"})
    features = [qwen_vl_sampler.encode(p) for p in PROMPTS]
    got = [r.sequences[0] for r in qwen_vl_sampler.sample(PROMPTS, GREEDY)]
    assert got[0].tokens != got[1].tokens  # the same text, another image: another answer
    for feature, sequence in zip(features, got):  # the ids vLLM ran are the template's, then the samples
        assert sequence.training_feature is not None
        assert sequence.training_feature.input_ids[: len(feature.input_ids)] == feature.input_ids
    with TorchSampler(folder, dtype="float32") as torch_sampler:
        want = [r.sequences[0] for r in torch_sampler.sample(PROMPTS, GREEDY)]
    rounding = _rounding(folder, features, want)
    assert 0 < rounding < 1e-3, rounding
    assert_greedy_parity(got, want, atol=2 * rounding, min_compared=1.0)


def test_qwen_vl_ids_that_vllm_would_expand_differently_are_refused_by_name(qwen_vl_sampler: Any) -> None:
    feature = qwen_vl_sampler.encode(PROMPTS[1])
    pad = qwen_vl_sampler.template.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    at = feature.input_ids.index(pad)
    ids = [*feature.input_ids[:at], pad, *feature.input_ids[at:]]  # one image token more than the image takes
    wrong = InputFeature(input_ids=ids, multimodal=feature.multimodal, images=feature.images)
    n = len(feature.input_ids)
    refused = rf"inputs\[0\]: vLLM expands its 1 image\(s\) into {n} prompt tokens but the template's processor gave"
    with pytest.raises(InvalidInputError, match=rf"{refused} {n + 1}"):
        qwen_vl_sampler.sample([wrong], GREEDY)


class TestMediaContract(MediaContractTests):
    """The shared suite's image cases, on this module's engine."""

    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls, qwen_vl_sampler: Any) -> Any:
        return qwen_vl_sampler
