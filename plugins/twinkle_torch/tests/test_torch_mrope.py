"""Images for a model with multimodal rotary positions (the Qwen-VL family) on the torch engine, on a tiny
Qwen3-VL (plain attention) and a tiny Qwen3.5 (Gated DeltaNet layers, whose state the engine carries per row):
the processor built without torchvision, its expansion checked against the model's own vision tower, and the
samples against the HF forward, which places image tokens on a grid by its own code. One engine at a time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch_helpers import image_chat, patterned_image, replayed_logprobs

from twinkle_core import Sampler, create_sampler
from twinkle_core.data_format import InputFeature, SampledSequence, SamplingParams, Trajectory
from twinkle_core.errors import UnsupportedFeatureError
from twinkle_core.template.processor import ProcessorTemplate
from twinkle_core.testing.parity import hf_logprobs
from twinkle_core.testing.tiny_layouts import build_tiny_qwen3_5_vl
from twinkle_core.testing.tiny_qwen_vl import build_tiny_qwen_vl

#: Float32 summation order between a batched, cached decode and one full forward (as test_torch_media's).
_TOLERANCE = 1e-3
_GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5_vl"])
def folder(request: pytest.FixtureRequest) -> Path:
    return build_tiny_qwen_vl() if request.param == "qwen3_vl" else build_tiny_qwen3_5_vl()


@pytest.fixture(scope="module")
def sampler(folder: Path) -> Iterator[Sampler]:
    with create_sampler("torch", model_id=str(folder), device="cpu", dtype="float32") as sampler:
        yield sampler


@pytest.fixture(scope="module")
def hf_model(folder: Path) -> Any:
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(folder), dtype=torch.float32).eval()


def _gap(model: Any, feature: InputFeature, sequence: SampledSequence) -> tuple[float, bool]:
    """How far a sequence's log-probs are from the HF forward's, and whether each token is its argmax."""
    logprobs = hf_logprobs(model, feature, sequence.tokens)
    tokens = torch.tensor(sequence.tokens)
    own = logprobs.gather(-1, tokens[:, None])[:, 0]
    assert sequence.logprobs is not None and len(sequence.logprobs) == len(sequence.tokens) > 0
    return float((own - torch.tensor(sequence.logprobs)).abs().max()), bool((logprobs.argmax(-1) == tokens).all())


def test_the_processor_is_built_for_images_without_torchvision_and_expands_as_the_tower_reads(
    folder: Path, sampler: Sampler, hf_model: Any
) -> None:
    """AutoProcessor cannot build it here; the template's is the model's processor class without its video
    processor, and its expansion is the one the model's forward accepts: one image token per merged patch of
    the vision tower's output, each image's tokens the tokenizer's own ids for the placeholder repeated."""
    from transformers import AutoProcessor, Qwen3VLProcessor

    with pytest.raises(ImportError, match=r"[Tt]orchvision"):
        AutoProcessor.from_pretrained(str(folder))
    template = sampler.template
    assert isinstance(template, ProcessorTemplate) and isinstance(template.processor, Qwen3VLProcessor)
    tokenizer = template.tokenizer
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for image in (patterned_image(1, (90, 40)), patterned_image(2, (96, 96))):
        feature = template.encode(Trajectory(messages=image_chat(image)))
        assert feature.multimodal is not None
        grid = feature.multimodal["image_grid_thw"]
        count = int(np.prod(grid)) // 4  # merge_size 2: four patches to a token
        text = template.render(Trajectory(messages=image_chat(image))).replace("<|image_pad|>", "<|image_pad|>" * count)
        assert feature.input_ids == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert feature.multimodal["mm_token_type_ids"][0].tolist() == [int(t == image_id) for t in feature.input_ids]
        with torch.no_grad():
            out = hf_model.model.get_image_features(
                torch.from_numpy(feature.multimodal["pixel_values"]), torch.from_numpy(grid), return_dict=True
            )
        assert sum(len(part) for part in out.pooler_output) == feature.input_ids.count(image_id) == count
    with pytest.raises(UnsupportedFeatureError, match="takes images only"):
        template.encode(
            Trajectory(messages=[{"role": "user", "content": "<video>"}], videos=[[patterned_image(1, (32, 32))]])
        )


def test_greedy_image_prompts_are_the_hf_forward_on_their_grid_positions(
    folder: Path, sampler: Sampler, hf_model: Any
) -> None:
    """Images of two shapes (Qwen3-VL's grids: 1x3 and 3x3 tokens, positions behind length by 0 and 6) and a
    text prompt in one call, two samples each sharing a prefill: every sequence is the HF forward's (the VL
    class's, which the engine runs), and each image prompt's log-probs are not the HF forward's under another
    image. A checkpoint that also loads as a text model (Qwen3.5's) gives the text prompt that model's log-probs."""
    assert type(sampler.engine.model) is type(hf_model)  # type: ignore[attr-defined]
    assert sampler.engine.info.media == {"image"}
    chats = [
        image_chat(patterned_image(1, (90, 40))),
        [{"role": "user", "content": "What is it?"}],
        image_chat(patterned_image(2, (96, 96))),
    ]
    trajectories = [Trajectory(messages=c) for c in chats]
    responses = sampler.sample(trajectories, _GREEDY.replace(num_samples=2))
    features = [sampler.template.encode(t) for t in trajectories]
    for response, feature in zip(responses, features):
        assert response.prompt_token_ids == feature.input_ids
        for sequence in response.sequences:
            gap, greedy = _gap(hf_model, feature, sequence)
            assert greedy and gap < _TOLERANCE, gap
    first, last = responses[0].sequences[0], responses[2].sequences[0]
    assert (first.tokens, first.logprobs) != (last.tokens, last.logprobs)
    text_model = _text_model(folder)
    if text_model is not None:
        gap, greedy = _gap(text_model, features[1], responses[1].sequences[0])
        assert greedy and gap < _TOLERANCE, gap
    swapped = InputFeature(
        input_ids=features[2].input_ids, multimodal={**features[2].multimodal, "pixel_values": _pixels(sampler, 3)}
    )
    gap, _ = _gap(hf_model, swapped, responses[2].sequences[0])
    assert gap > 10 * _TOLERANCE, gap


def _text_model(folder: Path) -> Any:
    """The folder's model as ``AutoModelForCausalLM`` loads it (Qwen3.5's text class); ``None`` if it has none."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(AutoConfig.from_pretrained(str(folder))) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _pixels(sampler: Sampler, seed: int) -> Any:
    feature = sampler.template.encode(Trajectory(messages=image_chat(patterned_image(seed, (96, 96)))))
    assert feature.multimodal is not None
    return feature.multimodal["pixel_values"]


def test_an_image_prompt_joins_a_running_batch_and_resumes_after_an_abort(sampler: Sampler, hf_model: Any) -> None:
    """A text call is decoding when an image prompt arrives: it joins the batch with its own positions. An
    aborted image prompt resumes by a prefill of its ids and what it generated: the whole is the HF forward's."""
    stats = sampler.engine._decoder.stats  # type: ignore[attr-defined]
    steps, joined = stats.steps, stats.joined_rows
    feature = sampler.template.encode(Trajectory(messages=image_chat(patterned_image(4, (64, 96)))))
    running = sampler.submit(
        Trajectory(messages=[{"role": "user", "content": "Tell me a story."}]), _GREEDY.replace(max_tokens=400)
    )
    deadline = time.monotonic() + 120
    while stats.steps < steps + 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    late = sampler.sample(feature, _GREEDY)[0].sequences[0]
    assert stats.joined_rows > joined
    running.abort()
    assert running.result(timeout=300)[0].sequences[0].stop_reason == "abort"
    gap, greedy = _gap(hf_model, feature, late)
    assert greedy and gap < _TOLERANCE, gap

    steps = stats.steps
    handle = sampler.submit(feature, _GREEDY.replace(max_tokens=40))
    while stats.steps < steps + 3 and time.monotonic() < deadline + 120:
        time.sleep(0.005)
    handle.abort()
    first = handle.result(timeout=120)[0].sequences[0]
    assert first.stop_reason == "abort" and 0 < len(first.tokens) < 40
    whole = handle.resume().result(timeout=300)[0].sequences[0]
    assert whole.tokens[: len(first.tokens)] == first.tokens and len(whole.tokens) == 40
    gap, greedy = _gap(hf_model, feature, whole)
    assert greedy and gap < _TOLERANCE, gap


def test_the_trainer_replays_each_sample_from_its_training_feature(sampler: Sampler, hf_model: Any) -> None:
    """An HF forward over each seeded sample's training feature, as a trainer gets it (through JSON), gives its
    log-probs: the feature's per-token media inputs cover the completion too, which the model's forward needs."""
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=0, num_samples=3, seed=3)
    response = sampler.sample(Trajectory(messages=image_chat(patterned_image(5, (96, 64)))), params)[0]
    assert len({tuple(sequence.tokens) for sequence in response.sequences}) > 1  # the trained Qwen3.5 is sharp
    for sequence in response.sequences:
        tokens, logprobs = replayed_logprobs(hf_model, sequence)
        assert tokens == sequence.tokens
        assert sequence.logprobs == pytest.approx(logprobs, abs=_TOLERANCE)


def test_a_checkpoint_whose_tokenizer_places_no_image_refuses_it_by_name() -> None:
    """The tiny Qwen3.5 layout ships Qwen3-VL's processor configs beside a text tokenizer without the vision
    tokens: its processor builds, but an image would vanish from the ids, so it is refused, not dropped."""
    from twinkle_core.testing.tiny_layouts import build_tiny_checkpoint_layout

    template = ProcessorTemplate.from_pretrained(build_tiny_checkpoint_layout())
    with pytest.raises(UnsupportedFeatureError, match=r"0 of the image token '<\|image_pad\|>'"):
        template.encode(Trajectory(messages=image_chat(patterned_image(1, (64, 64)))))
