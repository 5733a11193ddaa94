"""Prompts with images on the vLLM engine: the tiny Llava, one engine for the module.

The reference is transformers' own forward of the same folder on exactly the
template's feature (expanded ids, ``pixel_values``), decoded greedily. Both
sides run float32, so they differ by rounding alone; the tolerance is
measured, as ``test_hybrid`` measures its own: the largest gap between
transformers' float32 and float64 forwards over the compared tokens is the
rounding a float32 computation of this model carries, and two such
computations differ by at most twice it. An image ignored, misplaced or
expanded twice moves log-probs by far more.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from twinkle_core.data_format import InputFeature, SamplingParams, Trajectory
from twinkle_core.errors import InvalidInputError, UnsupportedFeatureError
from twinkle_core.testing.contract import MediaContractTests
from twinkle_core.testing.parity import assert_greedy_parity

from .conftest import make_sampler

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)


def _image(seed: int) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(28, 28, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


IMAGES = [_image(1), _image(2)]
PROMPTS = [
    Trajectory(messages=[{"role": "user", "content": "<image>What is in the picture?"}], images=[IMAGES[0]]),
    Trajectory(messages=[{"role": "user", "content": "<image>What is in the picture?"}], images=[IMAGES[1]]),
    Trajectory(messages=[{"role": "user", "content": "Compare <image><image> please."}], images=IMAGES),
]


@pytest.fixture(scope="module")
def tiny_vlm() -> Path:
    from twinkle_core.testing.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm()


@pytest.fixture(scope="module")
def vlm_sampler(tiny_vlm: Path) -> Iterator[Any]:
    with make_sampler(tiny_vlm, kv_cache_memory_bytes=1 << 28) as sampler:
        yield sampler


def _hf_greedy(folder: Path, features: list[InputFeature], steps: int, dtype: Any) -> list[Any]:
    """transformers' greedy decode of each feature (a full forward per step), with each token's log-prob."""
    import torch
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(str(folder), dtype=dtype).eval()
    out = []
    for feature in features:
        media = {k: torch.from_numpy(v).to(dtype) for k, v in (feature.multimodal or {}).items()}
        ids, tokens, logprobs = list(feature.input_ids), [], []
        for _ in range(steps):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids]), **media).logits[0, -1]
            row = torch.log_softmax(logits.double(), dim=-1)
            token = int(row.argmax())
            tokens.append(token)
            logprobs.append(float(row[token]))
            ids.append(token)
        out.append(types.SimpleNamespace(tokens=tokens, logprobs=logprobs))
    return out


def test_the_engine_takes_images_and_its_greedy_outputs_equal_transformers_forward(
    vlm_sampler: Any, tiny_vlm: Path
) -> None:
    import torch

    assert vlm_sampler.engine.info.media == frozenset({"image"})
    features = [vlm_sampler.encode(p) for p in PROMPTS]
    got = [r.sequences[0] for r in vlm_sampler.sample(PROMPTS, GREEDY)]
    assert got[0].tokens != got[1].tokens  # the same text, another image: another answer
    want = _hf_greedy(tiny_vlm, features, GREEDY.max_tokens, torch.float32)
    wide = _hf_greedy(tiny_vlm, features, GREEDY.max_tokens, torch.float64)
    rounding = max(abs(a - b) for w, v in zip(want, wide) for a, b in zip(w.logprobs, v.logprobs))
    assert_greedy_parity(got, want, atol=2 * rounding, min_compared=1.0)


def test_ids_that_vllm_would_expand_differently_are_refused_by_name(vlm_sampler: Any) -> None:
    feature = vlm_sampler.encode(PROMPTS[0])
    image_token = vlm_sampler.template.tokenizer.convert_tokens_to_ids("<image>")
    at = feature.input_ids.index(image_token)
    ids = [*feature.input_ids[:at], image_token, *feature.input_ids[at:]]  # one image token too many
    wrong = InputFeature(input_ids=ids, multimodal=feature.multimodal, images=feature.images)
    n = len(feature.input_ids)
    refused = (
        rf"inputs\[1\]: vLLM expands its 1 image\(s\) into {n} prompt tokens but the template's processor gave {n + 1}"
    )
    with pytest.raises(InvalidInputError, match=refused):
        vlm_sampler.sample([feature, wrong], GREEDY)
    with pytest.raises(UnsupportedFeatureError, match=r"inputs\[0\] carries processed media.*not the images"):
        vlm_sampler.sample([attrs.evolve(feature, images=[])], GREEDY)
    assert len(vlm_sampler.sample([feature], GREEDY)[0].sequences[0].tokens) == GREEDY.max_tokens  # still serving


def test_an_aborted_image_prompt_resumes_with_its_image(vlm_sampler: Any, tiny_vlm: Path) -> None:
    """A resumed image sequence is prompted again with its image (vLLM needs the images, not only the arrays):
    it goes on from its partial tokens as transformers' forward over the prompt, the image and those tokens does."""
    import time

    import torch

    params = GREEDY.replace(max_tokens=400)  # far more than any CPU decodes in the 50 ms before the abort
    handle = vlm_sampler.submit(PROMPTS[0], params)
    time.sleep(0.05)
    handle.abort()
    first = handle.result(timeout=120)[0].sequences[0]
    assert first.stop_reason == "abort", "the call finished before the abort: give it more tokens"
    whole = handle.resume().result(timeout=300)[0].sequences[0]
    assert whole.tokens[: len(first.tokens)] == first.tokens and len(whole.tokens) == params.max_tokens
    assert whole.training_feature is not None and len(whole.training_feature.images) == 1
    feature = vlm_sampler.encode(PROMPTS[0])
    ahead = InputFeature(input_ids=[*feature.input_ids, *first.tokens], multimodal=feature.multimodal)
    steps = GREEDY.max_tokens
    want = _hf_greedy(tiny_vlm, [ahead], steps, torch.float32)[0]
    rest = types.SimpleNamespace(
        tokens=whole.tokens[len(first.tokens) : len(first.tokens) + steps],
        logprobs=whole.logprobs[len(first.tokens) : len(first.tokens) + steps],
    )
    # A re-prefill of prompt and tokens against a forward over them: float32 in another order of sums (1e-6 at a
    # log-prob of -6 was seen here), so the torch engine's image tests' 1e-3; without its image (or with another)
    # the continuation moves by tenths of a nat.
    assert_greedy_parity([rest], [want], atol=1e-3, min_compared=1.0)


def test_the_server_samples_from_image_url_parts_as_the_sampler_does(vlm_sampler: Any, tmp_path: Path) -> None:
    import base64
    import io

    import openai

    from twinkle_core.server import start_server

    buffer = io.BytesIO()
    IMAGES[1].save(buffer, format="PNG")
    IMAGES[0].save(tmp_path / "first.png")
    parts = [
        {"type": "image_url", "image_url": {"url": f"file://{tmp_path / 'first.png'}"}},
        {"type": "text", "text": "Compare "},
        {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()},
        },
    ]
    bad = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]
    want = vlm_sampler.sample(
        [Trajectory(messages=[{"role": "user", "content": "<image>Compare <image>"}], images=IMAGES)], GREEDY
    )[0].sequences[0]
    with start_server(vlm_sampler, model_name="vlm", allowed_local_media_path=tmp_path) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="vlm",
            messages=[{"role": "user", "content": parts}],
            temperature=0.0,
            max_tokens=GREEDY.max_tokens,
            extra_body={"ignore_eos": True},
        )
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.content\[0\].*not a decodable image"):
            client.chat.completions.create(model="vlm", messages=[{"role": "user", "content": bad}], max_tokens=2)
    assert reply.choices[0].message.content == want.text


def test_an_episode_with_a_picture_in_its_second_turn_samples_as_the_torch_engine_does(
    vlm_sampler: Any, tiny_vlm: Path
) -> None:
    """The second turn's prompt holds both images, the first turn's sampled tokens between them: vLLM expands
    them as the template did, and each turn is the torch engine's own episode's, greedily, both in float32."""
    import torch

    from twinkle_core.episode import Episode
    from twinkle_torch.sampler import TorchSampler

    opening = {"messages": [{"role": "user", "content": "<image>What is in the picture?"}], "images": IMAGES[:1]}
    picture = [{"type": "text", "text": "And in this one?"}, {"type": "image", "image": IMAGES[1]}]

    def run(sampler: Any) -> tuple[Episode, list[InputFeature]]:
        episode, prompts = Episode(sampler, opening), []
        for add in (lambda: None, lambda: episode.add_user(picture)):
            add()
            prompts.append(episode.prompt())
            episode.sample(sampler, GREEDY)
        return episode, prompts

    got, prompts = run(vlm_sampler)
    assert len(prompts[1].images) == 2 and prompts[1].multimodal is not None
    with TorchSampler(tiny_vlm, dtype="float32") as torch_sampler:
        want, _ = run(torch_sampler)
    wide, narrow = (_hf_greedy(tiny_vlm, prompts, GREEDY.max_tokens, dtype) for dtype in (torch.float64, torch.float32))
    rounding = max(abs(a - b) for w, v in zip(wide, narrow) for a, b in zip(w.logprobs, v.logprobs))
    assert_greedy_parity(got.turns, want.turns, atol=2 * rounding, min_compared=1.0)
    assert got.tokens == want.tokens


class TestMediaContract(MediaContractTests):
    """The shared suite's image cases, on this module's engine."""

    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls, vlm_sampler: Any) -> Any:
        return vlm_sampler
