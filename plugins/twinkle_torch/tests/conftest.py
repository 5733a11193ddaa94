"""Shared fixtures: the core's tiny models and LoRA adapters trained on nothing (random, but fixed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from twinkle_core.testing import TINY_CHAT_PROMPTS, build_tiny_model
from twinkle_core.data_format import Trajectory


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return build_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    return build_tiny_model("qwen2")


@pytest.fixture(scope="session")
def chat_prompts() -> list[Trajectory]:
    return [Trajectory(messages=m) for m in TINY_CHAT_PROMPTS]


def make_lora(model_dir: Path, out: Path, *, seed: int, targets: list[str], rank: int = 8) -> Path:
    """Write a PEFT LoRA adapter folder with random (fixed-seed) A and B matrices."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    peft_model.save_pretrained(str(out))
    return out


@pytest.fixture(scope="session")
def lora_dirs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_lora(tiny_llama, root / "a", seed=1, targets=["q_proj", "v_proj"]),
        "b": make_lora(tiny_llama, root / "b", seed=2, targets=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
        "c": make_lora(tiny_llama, root / "c", seed=3, targets=["gate_proj", "up_proj", "down_proj"], rank=4),
    }


def hf_greedy(model: Any, prompts: list[list[int]], max_new_tokens: int, pad_id: int, **kw: Any) -> list[list[int]]:
    """HF ``generate`` greedy, batched with left padding; each output cut after its first EOS."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=pad_id, **kw
        )
    eos = model.generation_config.eos_token_id
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    result = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        result.append(row[:cut])
    return result
