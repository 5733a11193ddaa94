"""The tiny test models: loadable, sane tokenizer and template, fluent greedy output, deterministic.

Both variants are built once into twinkle's cache (``$TWINKLE_CACHE`` or
``~/.cache/twinkle``; well under a minute each on two cores) and reused by every
later run and by the engine tests.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from twinkle_core.testing import tiny_model
from twinkle_core.testing.tiny_model import (
    TINY_ARCHS,
    TINY_CHAT_PROMPTS,
    TINY_MAX_MODEL_LEN,
    TINY_MODEL_VERSION,
    build_tiny_model,
    train_tiny_tokenizer,
    write_tiny_model,
)

ROUND_TRIP_TEXTS = [
    "Hello world",
    "  leading spaces,\n\nblank lines\tand tabs  ",
    "unicode: héllo wörld, 東京, emoji 🎉, ß and ø",
    "What's 12+30? It's 42!! I'll've {\"json\": [1, 2.5, null]}",
    "x" * 40 + " " + "9" * 17,
    "<|im_start|>user\nHi<|im_end|>\n",
]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """The models are tiny: one thread is as fast, and much faster on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=TINY_ARCHS)
def tiny(request: pytest.FixtureRequest) -> tuple[str, Path]:
    arch = request.param
    return arch, build_tiny_model(arch)


@pytest.fixture(scope="module")
def loaded(tiny: tuple[str, Path]) -> tuple[str, Path, Any, Any]:
    arch, folder = tiny
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return arch, folder, tokenizer, model


def test_folder_layout_and_cache(tiny: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    arch, folder = tiny
    assert folder.name == f"{arch}-v{TINY_MODEL_VERSION}" and folder.parent.name == "tiny-models"
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (folder / name).is_file(), name

    def no_rebuild(*args: Any) -> None:
        raise AssertionError("a cached tiny model was built again")

    monkeypatch.setattr(tiny_model, "write_tiny_model", no_rebuild)
    assert build_tiny_model(arch) == folder  # the cache hit: nothing is built


def test_config(loaded: tuple[str, Path, Any, Any]) -> None:
    arch, folder, tokenizer, _ = loaded
    config = AutoConfig.from_pretrained(str(folder))
    assert config.model_type == {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}.get(arch, arch)
    assert config.architectures == [
        {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3_5": "Qwen3_5ForCausalLM",
            "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
            "qwen3_next": "Qwen3NextForCausalLM",
        }[arch]
    ]
    if arch in ("qwen3_5_moe", "qwen3_next"):  # a few small experts beside the shared one, sizes vLLM's CPU MoE takes
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 128)
        assert config.shared_expert_intermediate_size == config.intermediate_size
    assert config.hidden_size // config.num_attention_heads == 64 == config.head_dim
    assert config.max_position_embeddings == TINY_MAX_MODEL_LEN
    assert config.tie_word_embeddings is False
    assert config.vocab_size == len(tokenizer)
    assert 512 <= len(tokenizer) <= 1024
    generation = json.loads((folder / "generation_config.json").read_text())
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert generation["eos_token_id"] == end_id == tokenizer.eos_token_id
    assert tokenizer.pad_token == "<|endoftext|>"


def test_tokenizer_matches_raw_and_round_trips(loaded: tuple[str, Path, Any, Any]) -> None:
    """AutoTokenizer must encode exactly like the trained tokenizer (the qwen2 rebuild quirk) and round-trip."""
    arch, folder, tokenizer, _ = loaded
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in ROUND_TRIP_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=True)
        assert ids == raw.encode(text).ids, (arch, text)
        assert tokenizer.decode(ids) == text, (arch, text)
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tokenizer.encode(token)) == 1
    if arch == "llama":  # no normaliser: even non-NFC text round-trips exactly
        decomposed = unicodedata.normalize("NFD", "café")
        assert tokenizer.decode(tokenizer.encode(decomposed)) == decomposed


def test_chat_template(loaded: tuple[str, Path, Any, Any]) -> None:
    _, _, tokenizer, _ = loaded
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "12 degrees and sunny"},
        {"role": "assistant", "content": [{"type": "text", "text": "It is 12 degrees."}]},
        {"role": "user", "content": "Thanks!"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\nTools:\n{")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n12 degrees and sunny<|im_end|>\n" in text
    assert "<|im_start|>assistant\nIt is 12 degrees.<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    plain = tokenizer.apply_chat_template(TINY_CHAT_PROMPTS[0], tokenize=False, add_generation_prompt=False)
    assert plain == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert tokenizer.apply_chat_template(TINY_CHAT_PROMPTS[0], tokenize=False, tools=None) == plain


def test_chat_prompts_shape() -> None:
    assert len(TINY_CHAT_PROMPTS) >= 8
    assert all(messages[-1]["role"] == "user" for messages in TINY_CHAT_PROMPTS)
    assert len({len(messages) for messages in TINY_CHAT_PROMPTS}) >= 3


def test_greedy_generation_is_fluent_and_peaked(loaded: tuple[str, Path, Any, Any]) -> None:
    arch, _, tokenizer, model = loaded
    answers, margins = [], []
    for messages in TINY_CHAT_PROMPTS:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        out = model.generate(
            **ids, max_new_tokens=40, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        completion = out.sequences[0, ids["input_ids"].shape[1] :].tolist()
        assert len(set(completion)) >= 3, (arch, messages, completion)  # not one token repeated
        answers.append(tokenizer.decode(completion, skip_special_tokens=True))
        for scores in out.scores:
            top = torch.topk(scores[0], 2).values
            margins.append(float(top[0] - top[1]))
    assert "Paris" in answers[0], answers[0]
    assert answers[1].startswith("Hello"), answers[1]
    assert statistics.median(margins) > 3.0, (arch, statistics.median(margins))
    # Greedy comparisons across engines are not fragile: every step is decided by
    # far more than float32 noise (closest calls are sums and counting, ~0.4).
    assert min(margins) > 0.2, (arch, min(margins))
    assert sum(m > 1.0 for m in margins) / len(margins) > 0.9


def test_prompt_too_long_is_cheap(loaded: tuple[str, Path, Any, Any]) -> None:
    _, _, tokenizer, _ = loaded
    long_prompt = [{"role": "user", "content": "Count from 1 to 7. " * 80}]
    text = tokenizer.apply_chat_template(long_prompt, tokenize=False, add_generation_prompt=True)
    assert len(tokenizer.encode(text)) > TINY_MAX_MODEL_LEN


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_build_is_deterministic(arch: str, tmp_path: Path) -> None:
    """Two builds (a few training steps each) give byte-identical tokenizers and weights."""
    assert train_tiny_tokenizer(arch).to_str() == train_tiny_tokenizer(arch).to_str()
    first = write_tiny_model(tmp_path / "a", arch, train_steps=3)
    second = write_tiny_model(tmp_path / "b", arch, train_steps=3)
    assert first["tokenizer_sha256"] == second["tokenizer_sha256"]
    assert first["weights_sha256"] == second["weights_sha256"]
    assert first["first_loss"] == second["first_loss"] and first["last_loss"] == second["last_loss"]
    cached = build_tiny_model(arch)
    digest = hashlib.sha256((cached / "tokenizer.json").read_bytes()).hexdigest()
    assert digest == first["tokenizer_sha256"]  # the cached model was built from the same tokenizer


def test_unknown_arch() -> None:
    with pytest.raises(ValueError, match="mistral"):
        build_tiny_model("mistral")


def test_custom_cache_dir_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """cache_dir (and $TWINKLE_CACHE) choose the root; a complete folder there is reused without rebuilding."""
    folder = tmp_path / "root" / "tiny-models" / f"llama-v{TINY_MODEL_VERSION}"
    folder.mkdir(parents=True)
    (folder / "twinkle_tiny_model.json").write_text("{}")
    assert build_tiny_model("llama", cache_dir=tmp_path / "root") == folder
    monkeypatch.setenv("TWINKLE_CACHE", str(tmp_path / "root"))
    assert build_tiny_model("llama") == folder
