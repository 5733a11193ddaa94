"""Prompts with images: the processor-aware encode against the model's own processor and forward, the
torch engine sampling a vision-language model (its tokens and log-probs against the HF forward on the
processor's inputs, whatever the batch does around them), what the trainer replays, and the sampler refusing
media that its engine would drop."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch_helpers import image_chat, patterned_image, replayed_logprobs

from twinkle_core import Sampler, create_sampler
from twinkle_core.data_format import IGNORE_INDEX, SampledSequence, SamplingParams, Trajectory
from twinkle_core.errors import PromptTooLongError, UnsupportedFeatureError
from twinkle_core.template.processor import ProcessorTemplate
from twinkle_core.testing.contract import MediaContractTests
from twinkle_core.testing.tiny_vlm import build_tiny_vlm


@pytest.fixture(scope="module")
def tiny_vlm() -> Path:
    return build_tiny_vlm()


@pytest.fixture(scope="module")
def template(tiny_vlm: Path) -> ProcessorTemplate:
    return ProcessorTemplate.from_pretrained(tiny_vlm)


@pytest.fixture(scope="module")
def text_sampler(tiny_qwen2: Path) -> Iterator[Sampler]:
    with create_sampler("torch", model_id=str(tiny_qwen2), device="cpu", dtype="float32") as sampler:
        yield sampler


@pytest.fixture(scope="module")
def vlm_sampler(tiny_vlm: Path) -> Iterator[Sampler]:
    with create_sampler("torch", model_id=str(tiny_vlm), device="cpu", dtype="float32") as sampler:
        yield sampler


@pytest.fixture(scope="module")
def hf_vlm(tiny_vlm: Path) -> Any:
    """The model as Hugging Face runs it: the reference for every image prompt's log-probs."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(tiny_vlm), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(tiny_vlm: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_vlm))


#: Float32 summation order between a batched, cached decode and one full forward (test_torch_architectures').
_TOLERANCE = 1e-3


def _processed(processor: Any, chat: list[dict[str, Any]]) -> dict[str, Any]:
    """What the model's own processor gives for a chat: the ids and the media inputs."""
    return dict(
        processor.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="np"
        )
    )


def _gap(model: Any, inputs: dict[str, Any], sequence: SampledSequence) -> tuple[float, bool]:
    """How far a sequence's log-probs are from one HF forward over ``inputs`` plus its tokens, and whether
    each token is that forward's argmax (greedy)."""
    prompt = [int(t) for t in inputs["input_ids"][0]]
    media = {k: torch.as_tensor(v) for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "labels")}
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + sequence.tokens]), **media).logits[0].float()
    logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    tokens = torch.tensor(sequence.tokens)
    own = logprobs.gather(-1, tokens[:, None])[:, 0]
    assert sequence.logprobs is not None and len(sequence.logprobs) == len(sequence.tokens) > 0
    gap = float((own - torch.tensor(sequence.logprobs)).abs().max())
    return gap, bool((logprobs.argmax(-1) == tokens).all())


_GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)


def test_a_vision_language_folder_loads_its_image_class_and_takes_images(
    vlm_sampler: Sampler, text_sampler: Sampler
) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    model = vlm_sampler.engine.model  # type: ignore[attr-defined]
    assert type(model) is MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(model.config)]
    assert vlm_sampler.engine.info.media == {"image"}
    assert text_sampler.engine.info.media == frozenset()


def test_greedy_image_prompts_are_the_hf_forward_on_the_processors_inputs(
    vlm_sampler: Sampler, hf_vlm: Any, processor: Any
) -> None:
    """Two images and a text prompt in one call, two samples each (one prefill shared): every sequence is the
    HF forward's on exactly what the processor gives, and neither image's output is the other image's."""
    chats = [
        image_chat(patterned_image(1)),
        [{"role": "user", "content": "What is it?"}],
        image_chat(patterned_image(2)),
    ]
    responses = vlm_sampler.sample([Trajectory(messages=c) for c in chats], _GREEDY.replace(num_samples=2))
    inputs = [_processed(processor, c) for c in chats]
    for response, own in zip(responses, inputs):
        assert response.prompt_token_ids == own["input_ids"][0].tolist()
        for sequence in response.sequences:
            gap, greedy = _gap(hf_vlm, own, sequence)
            assert greedy and gap < _TOLERANCE, gap
    # the image is read: each image prompt's tokens, under the other image, are not the HF forward's
    swapped = [
        {**inputs[0], "pixel_values": inputs[2]["pixel_values"]},
        {**inputs[2], "pixel_values": inputs[0]["pixel_values"]},
    ]
    for response, other in zip((responses[0], responses[2]), swapped):
        gap, _ = _gap(hf_vlm, other, response.sequences[0])
        assert gap > 10 * _TOLERANCE, gap


def test_an_image_prompt_joins_a_running_batch(vlm_sampler: Sampler, hf_vlm: Any, processor: Any) -> None:
    """A text call is decoding when an image prompt arrives: it joins the batch (its prefill reads its image)."""
    stats = vlm_sampler.engine._decoder.stats  # type: ignore[attr-defined]
    steps, joined = stats.steps, stats.joined_rows
    image_prompt = vlm_sampler.template.encode(
        Trajectory(messages=image_chat(patterned_image(3)))
    )  # encoded before, to be quick
    text = Trajectory(messages=[{"role": "user", "content": "Tell me a story."}])
    running = vlm_sampler.submit(text, _GREEDY.replace(max_tokens=400))
    deadline = time.monotonic() + 120
    while stats.steps < steps + 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    late = vlm_sampler.sample(image_prompt, _GREEDY)[0].sequences[0]
    assert stats.joined_rows > joined
    running.abort()  # its long budget only kept it decoding while the image prompt came
    assert running.result(timeout=300)[0].sequences[0].stop_reason == "abort"
    gap, greedy = _gap(hf_vlm, _processed(processor, image_chat(patterned_image(3))), late)
    assert greedy and gap < _TOLERANCE, gap


def test_an_aborted_image_prompt_resumes_with_its_image(vlm_sampler: Sampler, hf_vlm: Any, processor: Any) -> None:
    """The continuation is prefilled again from the prompt's ids and media: the whole sequence is the HF
    forward's, and its training feature still carries the image."""
    stats = vlm_sampler.engine._decoder.stats  # type: ignore[attr-defined]
    steps = stats.steps
    handle = vlm_sampler.submit(Trajectory(messages=image_chat(patterned_image(4))), _GREEDY.replace(max_tokens=40))
    deadline = time.monotonic() + 120
    while stats.steps < steps + 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    handle.abort()
    first = handle.result(timeout=120)[0].sequences[0]
    assert first.stop_reason == "abort" and 0 < len(first.tokens) < 40
    whole = handle.resume().result(timeout=300)[0].sequences[0]
    assert whole.tokens[: len(first.tokens)] == first.tokens and len(whole.tokens) == 40
    own = _processed(processor, image_chat(patterned_image(4)))
    gap, greedy = _gap(hf_vlm, own, whole)
    assert greedy and gap < _TOLERANCE, gap
    assert whole.training_feature is not None and whole.training_feature.multimodal is not None
    assert np.array_equal(whole.training_feature.multimodal["pixel_values"], own["pixel_values"])


def test_the_trainer_replays_each_sample_from_its_training_feature(vlm_sampler: Sampler, hf_vlm: Any) -> None:
    """Two seeded samples of an image prompt (one prefill): an HF forward over each sequence's training feature,
    as a trainer gets it (through a dict and JSON), gives its log-probs; the media are shared, not copied."""
    stats = vlm_sampler.engine._decoder.stats  # type: ignore[attr-defined]
    prefills = stats.prefills
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=0, num_samples=2, seed=3)
    response = vlm_sampler.sample(Trajectory(messages=image_chat(patterned_image(5))), params)[0]
    assert stats.prefills == prefills + 1
    features = [s.training_feature for s in response.sequences]
    assert all(f is not None and f.multimodal is not None for f in features)
    assert features[0].multimodal["pixel_values"] is features[1].multimodal["pixel_values"]  # type: ignore[union-attr]
    assert response.sequences[0].tokens != response.sequences[1].tokens
    for sequence in response.sequences:
        tokens, logprobs = replayed_logprobs(hf_vlm, sequence)
        assert tokens == sequence.tokens
        assert sequence.logprobs == pytest.approx(logprobs, abs=_TOLERANCE)


def test_encode_gives_exactly_what_the_models_own_processor_gives(tiny_vlm: Path, template: ProcessorTemplate) -> None:
    from transformers import AutoProcessor

    reference = AutoProcessor.from_pretrained(str(tiny_vlm))
    for image in (patterned_image(1), patterned_image(2)):
        ours = template.encode(Trajectory(messages=image_chat(image)))
        theirs = reference.apply_chat_template(
            image_chat(image), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="np"
        )
        assert ours.input_ids == theirs["input_ids"][0].tolist()
        assert ours.multimodal is not None and set(ours.multimodal) == set(theirs) - {"input_ids", "attention_mask"}
        assert (ours.multimodal["pixel_values"] == theirs["pixel_values"]).all()
    # each image's placeholder expanded as the processor does it: more ids than the text's own
    image_id = reference.tokenizer.convert_tokens_to_ids("<image>")
    assert ours.input_ids.count(image_id) > 1


def test_the_placeholder_form_encodes_as_the_block_form(template: ProcessorTemplate) -> None:
    blocks = template.encode(Trajectory(messages=image_chat(patterned_image(3))))
    placed = template.encode(
        Trajectory(messages=[{"role": "user", "content": "<image>What is it?"}], images=[patterned_image(3)])
    )
    assert placed.input_ids == blocks.input_ids
    assert placed.multimodal is not None and blocks.multimodal is not None
    assert (placed.multimodal["pixel_values"] == blocks.multimodal["pixel_values"]).all()


def test_a_hf_forward_over_the_encoded_feature_runs_and_depends_on_the_image(
    tiny_vlm: Path, template: ProcessorTemplate
) -> None:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm)).eval()
    logits = []
    for seed in (4, 5):
        feature = template.encode(Trajectory(messages=image_chat(patterned_image(seed))))
        feature = feature.from_dict(feature.to_dict())  # what a trainer gets across a process boundary
        assert feature.multimodal is not None
        inputs = {k: torch.from_numpy(v) for k, v in feature.multimodal.items()}
        with torch.no_grad():
            out = model(input_ids=torch.tensor([feature.input_ids]), **inputs)
        assert out.logits.shape[:2] == (1, len(feature.input_ids))
        logits.append(out.logits[0, -1])
    assert not torch.allclose(logits[0], logits[1])


def test_the_length_checked_is_the_expanded_one(template: ProcessorTemplate) -> None:
    trajectory = Trajectory(messages=image_chat(patterned_image(6)))
    expanded = len(template.encode(trajectory).input_ids)
    text_only = len(template.tokenize(template.render(trajectory)))
    assert text_only < expanded
    with pytest.raises(PromptTooLongError) as info:
        template.encode(trajectory, max_tokens=expanded - 1)
    assert info.value.length == expanded and info.value.limit == expanded - 1
    assert len(template.encode(trajectory, max_tokens=expanded).input_ids) == expanded


def test_a_video_is_unsupported_where_the_processor_takes_images_only(template: ProcessorTemplate) -> None:
    trajectory = Trajectory(messages=[{"role": "user", "content": "<video>"}], videos=[[patterned_image(1)]])
    with pytest.raises(UnsupportedFeatureError, match="takes images only"):
        template.encode(trajectory)


def test_the_sampler_refuses_media_for_an_engine_that_takes_none(text_sampler: Sampler) -> None:
    good = Trajectory(messages=[{"role": "user", "content": "Hello"}])
    with_image = Trajectory(messages=image_chat(patterned_image(1)))
    for on_invalid in ("raise", "skip"):
        with pytest.raises(UnsupportedFeatureError, match=r"inputs\[1\] holds an image, but the torch engine"):
            text_sampler.sample([good, with_image], {"max_tokens": 2}, on_invalid=on_invalid)  # type: ignore[arg-type]


def test_a_text_model_given_an_image_is_unsupported(text_sampler: Sampler) -> None:
    with pytest.raises(UnsupportedFeatureError, match="has no processor"):
        text_sampler.template.encode(Trajectory(messages=image_chat(patterned_image(1))))


def test_skip_isolates_a_bad_image(vlm_sampler: Sampler) -> None:
    good = Trajectory(messages=[{"role": "user", "content": "Hello"}])
    bad = Trajectory(messages=[{"role": "user", "content": "a <image>"}], images=[b"not an image"])
    responses = vlm_sampler.sample([good, bad, good], {"max_tokens": 2}, on_invalid="skip")
    assert [r.error is None for r in responses] == [True, False, True]
    assert responses[1].error is not None and responses[1].error.startswith("Trajectory.images[0]")
    assert all(r.sequences and r.sequences[0].tokens for r in (responses[0], responses[2]))


def test_a_processor_this_machine_cannot_load_leaves_the_model_sampling_text(
    tiny_qwen2: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A vision-language checkpoint whose processor cannot be built here (Qwen2-VL's needs torchvision) still
    samples text: the sampler falls back to the tokenizer's template and says why, and an image is refused."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_qwen2, folder)
    (folder / "preprocessor_config.json").write_text('{"image_processor_type": "NoSuchImageProcessor"}')
    with caplog.at_level("WARNING"), create_sampler("torch", model_id=str(folder), device="cpu") as sampler:
        assert not isinstance(sampler.template, ProcessorTemplate)
        out = sampler.sample(
            Trajectory(messages=[{"role": "user", "content": "Hi"}]), {"max_tokens": 3, "ignore_eos": True}
        )
        assert len(out[0].sequences[0].tokens) == 3
        with pytest.raises(UnsupportedFeatureError):
            sampler.sample(Trajectory(messages=image_chat(patterned_image(1))), {"max_tokens": 3})
    assert "could not be loaded" in caplog.text


def test_a_prefill_batches_media_inputs_as_a_processor_batches_them() -> None:
    """Per-image arrays concatenated in row order; per-token ones under their row's tokens, left-padded, zero
    under padding and under tokens past the prompt (a resumed row); a text row adds nothing."""
    from twinkle_torch.media import media_inputs

    first = {"pixel_values": np.ones((1, 3, 2, 2), np.float32), "mm_token_type_ids": np.array([[0, 1, 1, 0]])}
    resumed = {"pixel_values": np.zeros((2, 3, 2, 2), np.float32), "mm_token_type_ids": np.array([[1, 1, 0]])}
    out = media_inputs([first, None, resumed], [4, 2, 5], 6, device=torch.device("cpu"), dtype=torch.float64)
    assert out["pixel_values"].dtype == torch.float64
    assert out["pixel_values"].tolist() == np.concatenate([first["pixel_values"], resumed["pixel_values"]]).tolist()
    assert out["mm_token_type_ids"].tolist() == [[0, 0, 0, 1, 1, 0], [0] * 6, [0, 1, 1, 0, 0, 0]]
    assert media_inputs([None, None], [2, 3], 3, device=torch.device("cpu"), dtype=torch.float32) == {}


def test_twinkle_sample_reads_images_from_jsonl_rows(vlm_sampler: Sampler, tiny_vlm: Path, tmp_path: Path) -> None:
    """``twinkle sample``, run as a user runs it: rows naming an image file (with ``<image>`` in the text) or
    carrying a ``data:`` URL block sample what the sampler samples for the same images."""
    import base64
    import io
    import os
    import shutil
    import subprocess
    import sys

    images = [patterned_image(6), patterned_image(7)]
    path = tmp_path / "six.png"
    images[0].save(path)
    buffer = io.BytesIO()
    images[1].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    rows = [
        {"messages": [{"role": "user", "content": "<image>What is it?"}], "images": [str(path)]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]},
    ]
    twinkle = shutil.which("twinkle", path=str(Path(sys.executable).parent)) or "twinkle"
    args = [twinkle, "sample", "-e", "torch", "-m", str(tiny_vlm), "--max-tokens", "8", "--temperature", "0"]
    out = subprocess.run(
        [*args, "--ignore-eos", "--full"],
        input="\n".join(json.dumps(row) for row in rows),
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    want = vlm_sampler.sample([Trajectory.from_dict(row) for row in rows], _GREEDY)
    assert [r["sequences"][0]["tokens"] for r in records] == [w.sequences[0].tokens for w in want]
    assert records[0]["sequences"][0]["tokens"] != records[1]["sequences"][0]["tokens"]  # the image counts


def _hf_chat(messages: list[Any]) -> list[dict[str, Any]]:
    return [m.to_hf() for m in messages]


def test_an_episode_carries_each_later_turns_images_token_exact_and_the_trainer_replays_every_turn(
    vlm_sampler: Sampler, hf_vlm: Any, processor: Any
) -> None:
    """A screenshot in a tool result, then a picture in a user turn: each delta is what the processor gives
    for the whole conversation cut at the previous end, every prompt carries all images so far, a bad image
    changes nothing, and an HF forward over the exported training feature gives every turn's log-probs."""
    from twinkle_core.episode import Episode
    from twinkle_core.errors import InvalidMediaError

    images = [patterned_image(11), patterned_image(12), patterned_image(13)]
    episode = Episode(vlm_sampler, {"messages": [{"role": "user", "content": "<image>Open it."}], "images": images[:1]})
    episode.sample(vlm_sampler, _GREEDY)
    kept = (list(episode.tokens), len(episode.segments), len(episode.messages))
    with pytest.raises(InvalidMediaError, match=r"messages\[0\]\.content\[1\].*not a decodable image") as bad:
        episode.add_tool_result([{"type": "text", "text": "shot"}, {"type": "image", "image": b"not an image"}])
    assert bad.value.part == "messages[0].content[1]"
    assert (episode.tokens, len(episode.segments), len(episode.messages)) == kept
    additions = (
        lambda: episode.add_tool_result([{"type": "image", "image": images[1]}, {"type": "text", "text": "shot"}]),
        lambda: episode.add_user([{"type": "text", "text": "And this?"}, {"type": "image", "image": images[2]}]),
    )
    for count, add in enumerate(additions, start=2):
        old = processor.apply_chat_template(_hf_chat(episode.messages), tokenize=True, return_dict=True)
        add()
        whole = _processed(processor, _hf_chat(episode.messages))
        assert episode.segments[-1].tokens == whole["input_ids"][0].tolist()[len(old["input_ids"][0]) :]
        prompt = episode.prompt()
        assert prompt.multimodal is not None and len(prompt.images) == count
        assert np.array_equal(prompt.multimodal["pixel_values"], whole["pixel_values"])
        episode.sample(vlm_sampler, _GREEDY)
    exported = json.loads(json.dumps(episode.to_dict()))
    feature = type(prompt).from_dict(exported["feature"])
    assert feature.multimodal is not None and feature.labels is not None and len(feature.images) == 3
    blocks = [p for m in exported["messages"] if isinstance(m["content"], list) for p in m["content"]]
    assert [p["image"] for p in blocks if p["type"] == "image"] == feature.images  # the messages hold them too
    for image, url in zip(images, feature.images):  # the images themselves, losslessly
        assert np.array_equal(
            np.asarray(image), np.asarray(vlm_sampler.template.load_media([("image", url, "")])[0][0])
        )
    labels = torch.tensor(feature.labels)
    trained = (labels != IGNORE_INDEX).nonzero()[:, 0]
    replays = []
    for pixels in (feature.multimodal["pixel_values"], feature.multimodal["pixel_values"][[0, 0, 2]]):
        with torch.no_grad():
            logits = hf_vlm(input_ids=torch.tensor([feature.input_ids]), pixel_values=torch.from_numpy(pixels)).logits
        replays.append(logits[0, trained - 1].log_softmax(-1).gather(-1, labels[trained][:, None])[:, 0])
    sampled = torch.tensor([lp for turn in episode.turns for lp in turn.logprobs or []])
    assert labels[trained].tolist() == [t for turn in episode.turns for t in turn.tokens] and len(episode.turns) == 3
    assert float((replays[0] - sampled).abs().max()) < _TOLERANCE
    assert float((replays[1] - sampled).abs().max()) > 10 * _TOLERANCE  # the tool's screenshot was read


def test_an_episode_holds_no_more_images_than_a_prompt_may(template: ProcessorTemplate) -> None:
    from twinkle_core.data_format.media_loading import MediaLimits
    from twinkle_core.episode import Episode
    from twinkle_core.errors import InvalidMediaError

    bounded = ProcessorTemplate(template.tokenizer, processor=template.processor, limits=MediaLimits(max_images=2))
    episode = Episode(bounded, Trajectory(messages=image_chat(patterned_image(1))))
    answer = bounded.tokenize("A cat.<|im_end|>")
    episode.append_sampled(SampledSequence(tokens=answer, text="A cat.<|im_end|>", stop_reason="stop"))
    three = [{"type": "image", "image": patterned_image(2)}, {"type": "image", "image": patterned_image(3)}]
    with pytest.raises(InvalidMediaError, match=r"messages\[0\]\.content\[1\] would be image 3 of the episode"):
        episode.add_user(three)
    assert len(episode.add_user(three[:1])) > 16 and len(episode.prompt().images) == 2


class TestMediaContract(MediaContractTests):
    """The shared suite's image cases, on this module's engine."""

    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls, vlm_sampler: Any) -> Any:
        return vlm_sampler
