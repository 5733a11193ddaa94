"""Prompts with images: the processor-aware encode against the model's own processor and forward, and the
sampler refusing media that its engine would drop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from PIL import Image

from twinkle_core import Sampler, create_sampler
from twinkle_core.data_format import Trajectory
from twinkle_core.errors import PromptTooLongError, UnsupportedFeatureError
from twinkle_core.template.processor import ProcessorTemplate
from twinkle_core.testing.tiny_vlm import build_tiny_vlm
from twinkle_torch.engine import TorchEngine


def _image(seed: int) -> Any:
    data = bytes((seed * 53 + i * 11) % 256 for i in range(64 * 48 * 3))
    return Image.frombytes("RGB", (64, 48), data)


def _chat(image: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What is it?"}]}]


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


def test_encode_gives_exactly_what_the_models_own_processor_gives(tiny_vlm: Path, template: ProcessorTemplate) -> None:
    from transformers import AutoProcessor

    reference = AutoProcessor.from_pretrained(str(tiny_vlm))
    for image in (_image(1), _image(2)):
        ours = template.encode(Trajectory(messages=_chat(image)))
        theirs = reference.apply_chat_template(
            _chat(image), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="np"
        )
        assert ours.input_ids == theirs["input_ids"][0].tolist()
        assert ours.multimodal is not None and set(ours.multimodal) == set(theirs) - {"input_ids", "attention_mask"}
        assert (ours.multimodal["pixel_values"] == theirs["pixel_values"]).all()
    # each image's placeholder expanded as the processor does it: more ids than the text's own
    image_id = reference.tokenizer.convert_tokens_to_ids("<image>")
    assert ours.input_ids.count(image_id) > 1


def test_the_placeholder_form_encodes_as_the_block_form(template: ProcessorTemplate) -> None:
    blocks = template.encode(Trajectory(messages=_chat(_image(3))))
    placed = template.encode(
        Trajectory(messages=[{"role": "user", "content": "<image>What is it?"}], images=[_image(3)])
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
        feature = template.encode(Trajectory(messages=_chat(_image(seed))))
        feature = feature.from_dict(feature.to_dict())  # what a trainer gets across a process boundary
        assert feature.multimodal is not None
        inputs = {k: torch.from_numpy(v) for k, v in feature.multimodal.items()}
        with torch.no_grad():
            out = model(input_ids=torch.tensor([feature.input_ids]), **inputs)
        assert out.logits.shape[:2] == (1, len(feature.input_ids))
        logits.append(out.logits[0, -1])
    assert not torch.allclose(logits[0], logits[1])


def test_the_length_checked_is_the_expanded_one(template: ProcessorTemplate) -> None:
    trajectory = Trajectory(messages=_chat(_image(6)))
    expanded = len(template.encode(trajectory).input_ids)
    text_only = len(template.tokenize(template.render(trajectory)))
    assert text_only < expanded
    with pytest.raises(PromptTooLongError) as info:
        template.encode(trajectory, max_tokens=expanded - 1)
    assert info.value.length == expanded and info.value.limit == expanded - 1
    assert len(template.encode(trajectory, max_tokens=expanded).input_ids) == expanded


def test_a_video_is_unsupported_where_the_processor_takes_images_only(template: ProcessorTemplate) -> None:
    trajectory = Trajectory(messages=[{"role": "user", "content": "<video>"}], videos=[[_image(1)]])
    with pytest.raises(UnsupportedFeatureError, match="takes images only"):
        template.encode(trajectory)


def test_the_sampler_refuses_media_for_an_engine_that_takes_none(text_sampler: Sampler) -> None:
    good = Trajectory(messages=[{"role": "user", "content": "Hello"}])
    with_image = Trajectory(messages=_chat(_image(1)))
    for on_invalid in ("raise", "skip"):
        with pytest.raises(UnsupportedFeatureError, match=r"inputs\[1\] holds an image, but the torch engine"):
            text_sampler.sample([good, with_image], {"max_tokens": 2}, on_invalid=on_invalid)  # type: ignore[arg-type]


def test_a_text_model_given_an_image_is_unsupported(text_sampler: Sampler) -> None:
    with pytest.raises(UnsupportedFeatureError, match="has no processor"):
        text_sampler.template.encode(Trajectory(messages=_chat(_image(1))))


class _ImageTorchEngine(TorchEngine):
    """The torch engine declaring images: for the skip path, whose bad image fails at encode, before any engine."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.info = attrs.evolve(self.info, media=frozenset({"image"}))


def test_skip_isolates_a_bad_image(tiny_qwen2: Path, tiny_vlm: Path) -> None:
    with Sampler(_ImageTorchEngine, model_id=str(tiny_qwen2), device="cpu", dtype="float32") as sampler:
        sampler.set_template(ProcessorTemplate.from_pretrained(tiny_vlm))
        good = Trajectory(messages=[{"role": "user", "content": "Hello"}])
        bad = Trajectory(messages=[{"role": "user", "content": "a <image>"}], images=[b"not an image"])
        responses = sampler.sample([good, bad, good], {"max_tokens": 2}, on_invalid="skip")
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
            sampler.sample(Trajectory(messages=_chat(_image(1))), {"max_tokens": 3})
    assert "could not be loaded" in caplog.text
