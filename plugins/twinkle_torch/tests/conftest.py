"""Shared fixtures: the core's tiny models and LoRA adapters trained on nothing (random, but fixed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch_helpers import make_lora

from twinkle_core.data_format import Trajectory
from twinkle_core.testing import TINY_CHAT_PROMPTS, build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama() -> Path:
    return build_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    return build_tiny_model("qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_5() -> Path:
    return build_tiny_model("qwen3_5")


@pytest.fixture(scope="session")
def chat_prompts() -> list[Trajectory]:
    return [Trajectory(messages=m) for m in TINY_CHAT_PROMPTS]


@pytest.fixture(scope="session")
def lora_dirs(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_lora(tiny_llama, root / "a", seed=1, targets=["q_proj", "v_proj"]),
        "b": make_lora(tiny_llama, root / "b", seed=2, targets=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
        "c": make_lora(tiny_llama, root / "c", seed=3, targets=["gate_proj", "up_proj", "down_proj"], rank=4),
    }
