"""The reference's example model id on the torch engine: ``ms://Qwen/Qwen3.5-4B`` in the layout Qwen3.5 ships.

A Qwen3.5 checkpoint is a vision-language model (``Qwen3_5ForConditionalGeneration``,
the language model nested under ``model.language_model.*``, a vision tower and a
multi-token-prediction block beside it, a video processor that needs
torchvision). The stand-in is the tiny Qwen3.5 in that layout
(:mod:`twinkle_core.testing.tiny_layouts`), put in a ModelScope cache so the
reference's id resolves offline. Sampling it must give the tiny text model's
own tokens and log-probs, bit for bit: the engine runs the same language
weights through the same class, and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.errors import WeightUpdateError
from twinkle_core.testing import TINY_CHAT_PROMPTS, build_tiny_model
from twinkle_core.testing.tiny_layouts import build_tiny_checkpoint_layout, modelscope_snapshot

pytest.importorskip("twinkle_torch")

MODEL_ID = "ms://Qwen/Qwen3.5-4B"
PROMPTS = [Trajectory(messages=m) for m in TINY_CHAT_PROMPTS[:4]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)


@pytest.fixture(scope="module")
def layout() -> Path:
    return build_tiny_checkpoint_layout()


@pytest.fixture(scope="module")
def offline_hub(layout: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A ModelScope cache holding the layout as ``Qwen/Qwen3.5-4B``, and the hubs offline."""
    cache = tmp_path_factory.mktemp("modelscope")
    snapshot = modelscope_snapshot(layout, "Qwen/Qwen3.5-4B", cache)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MODELSCOPE_CACHE", str(cache))
        patch.setenv("TWINKLE_OFFLINE", "1")
        yield snapshot


@pytest.fixture(scope="module")
def sampler(offline_hub: Path) -> Iterator[Any]:
    from twinkle_torch import TorchSampler

    with TorchSampler(model_id=MODEL_ID) as sampler:
        yield sampler


def test_the_layout_is_the_checkpoints_and_loads_as_its_text_model(layout: Path) -> None:
    import json

    from safetensors import safe_open

    config = json.loads((layout / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["text_config"]["mtp_num_hidden_layers"] == 1 and "vision_config" in config
    with safe_open(str(layout / "model.safetensors"), framework="pt") as f:
        names = f.keys()
    prefixes = {name.split(".layers.")[0].split(".blocks.")[0] for name in names}
    assert {"model.language_model", "model.visual", "mtp"} <= prefixes
    assert not any(p.startswith("model.layers") for p in prefixes)


def test_the_reference_id_samples_exactly_the_text_model(sampler: Any, offline_hub: Path) -> None:
    from twinkle_torch import TorchSampler

    assert Path(sampler.model_path).resolve() == offline_hub.resolve()
    got = sampler.sample(PROMPTS, GREEDY)
    with TorchSampler(build_tiny_model("qwen3_5")) as text_model:
        want = text_model.sample(PROMPTS, GREEDY)
    assert "Paris" in (got[0].sequences[0].text or "")
    for a, b in zip(got, want):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.sequences[0].tokens == b.sequences[0].tokens
        assert a.sequences[0].logprobs == b.sequences[0].logprobs


def test_the_checkpoints_nested_names_update_it_and_its_other_parts_are_refused_by_name(
    sampler: Any, layout: Path
) -> None:
    from safetensors.torch import load_file

    weights = load_file(str(layout / "model.safetensors"))
    before = sampler.sample(PROMPTS[:1], GREEDY)
    for name, part in (("mtp.fc.weight", "multi-token-prediction"), ("model.visual.pos_embed.weight", "vision tower")):
        with pytest.raises(WeightUpdateError, match=part) as info:
            sampler.update_weights({name: weights[name]})
        assert name in str(info.value)
    nested = "model.language_model.layers.3.self_attn.o_proj.weight"
    sampler.update_weights({nested: weights[nested] * 2})
    moved = sampler.sample(PROMPTS[:1], GREEDY)
    sampler.update_weights({"model.layers.3.self_attn.o_proj.weight": weights[nested]})  # the trainer's name
    again = sampler.sample(PROMPTS[:1], GREEDY)
    assert moved[0].sequences[0].logprobs != before[0].sequences[0].logprobs
    assert again[0].sequences[0].logprobs == before[0].sequences[0].logprobs
