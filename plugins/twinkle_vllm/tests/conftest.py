"""Shared set-up of the vLLM engine tests: one small CPU engine per test module."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

# The CPU engine reads these when it starts; keep it small and quiet.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

#: Engine options for the tests: eager mode (no compilation: fast start),
#: a 1 GiB KV cache, float32 like the tiny model and the torch engine.
TEST_ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "kv_cache_memory_bytes": 1 << 30,
    "dtype": "float32",
    "max_num_seqs": 64,
}


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The core's tiny Llama (head size 64, float32, ChatML), built once and cached."""
    from twinkle_core.testing import build_tiny_model

    return build_tiny_model("llama")


_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def engine_sockets(sampler: Any) -> set[str]:
    """The Unix socket files vLLM's code bound (named by a UUID) in the processes of ``sampler``'s engine."""
    import psutil

    from twinkle_vllm._reaper import _bound_sockets

    paths: set[str] = set()
    for pid in sampler.engine._process.reaper.pids:
        try:
            paths |= _bound_sockets(psutil.Process(pid))
        except psutil.Error:
            pass
    return {p for p in paths if is_vllm_socket(p)}


def is_vllm_socket(path: str) -> bool:
    """Whether ``path`` is named as vLLM names its ZMQ socket files (a UUID)."""
    return _UUID.fullmatch(os.path.basename(path)) is not None


def in_a_session_folder(path: str) -> bool:
    """Whether ``path`` lies in one of this process's private engine folders (removed with the engine)."""
    from twinkle_vllm._files import PREFIX

    return os.path.basename(os.path.dirname(path)).startswith(f"{PREFIX}{os.getpid()}-")


def make_sampler(model: Path, sampler_options: dict[str, Any] | None = None, **engine_args: Any) -> Any:
    """A vLLMSampler on the test engine options plus ``engine_args``, with ``sampler_options`` (its own arguments)."""
    from twinkle_vllm.sampler import vLLMSampler

    return vLLMSampler(model, engine_args={**TEST_ENGINE_ARGS, **engine_args}, **(sampler_options or {}))


#: The modules the test adapters put LoRA on (every linear layer of the tiny Llama).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(
    model_dir: Path,
    out_dir: Path,
    seed: int,
    rank: int = 4,
    scale: float = 0.3,
    targets: list[str] = LORA_TARGETS,
    **options: Any,
) -> Path:
    """Save a PEFT LoRA adapter for the tiny model whose ``lora_B`` is random.

    PEFT initialises ``lora_B`` to zero (a no-op adapter); randomising it makes
    the adapter change the model's outputs, so a wrong or missing adapter shows.
    ``options`` go to ``LoraConfig`` (``rank_pattern``, ...).
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0, **options)
    torch.manual_seed(seed)  # lora_A is initialised from the global generator
    peft_model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two different PEFT adapter folders for the tiny model."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_peft_adapter(tiny_model, root / name, seed) for name, seed in (("a", 1), ("b", 2))}


def hf_logprobs(
    model_dir: Path,
    prompt: list[int],
    completion: list[int],
    adapter: Path | None = None,
    state_dict: dict[str, Any] | None = None,
) -> list[float]:
    """Raw log-probs of ``completion`` after ``prompt`` under transformers (optionally + a PEFT adapter)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=False)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lps = torch.log_softmax(logits, dim=-1)
    return [float(lps[len(prompt) + i - 1, tok]) for i, tok in enumerate(completion)]


def hf_greedy(
    model_dir: Path, prompts: list[list[int]], max_new_tokens: int, state_dict: dict[str, Any] | None = None
) -> list[list[int]]:
    """Greedy continuations under transformers (``ignore_eos``-style: exactly ``max_new_tokens``)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state_dict is not None:
        model.load_state_dict(state_dict, strict=True)
    model.eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            gen = model.generate(
                ids,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        out.append(gen[0, len(prompt) :].tolist())
    return out


def perturbed_state(
    state: dict[str, Any], seed: int, swap: tuple[int, int] | None = None, scale: float = 0.02
) -> dict[str, Any]:
    """New weights for sync tests: every tensor gets mild noise, and optionally two
    rows of ``lm_head`` are swapped.

    The swap guarantees a visible change (a token the model would emit becomes
    another) without flattening the distributions, so greedy comparisons
    between engines stay robust however peaked the tiny model is.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    out = {k: v + scale * v.std() * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    if swap is not None:
        a, b = swap
        head = out["lm_head.weight"].clone()
        head[[a, b]] = head[[b, a]]
        out["lm_head.weight"] = head
    return out


# -- a hybrid model's module engine, for the shared suites (hybrid_suites.py); the module defines hybrid_model
@pytest.fixture(scope="module")
def hybrid_engine_args(hybrid_model: Path) -> dict[str, Any]:
    """The module engine's options: what the shared suites use (``suite_engine_args``); a module may override it."""
    from .hybrid_suites import suite_engine_args

    return suite_engine_args(hybrid_model)


@pytest.fixture(scope="module")
def hybrid_sampler(hybrid_model: Path, hybrid_engine_args: dict[str, Any]) -> Any:
    """The module's one engine on ``hybrid_model`` (bfloat16, found by itself)."""
    from twinkle_vllm.sampler import vLLMSampler

    with vLLMSampler(hybrid_model, engine_args=hybrid_engine_args) as sampler:
        yield sampler


@pytest.fixture(scope="module")
def top_rounding(hybrid_model: Path) -> float:
    """The rounding of one bfloat16 computation of ``hybrid_model`` over the top 8 (``rounding_over_the_top``)."""
    from .hybrid_suites import rounding_over_the_top

    return rounding_over_the_top(hybrid_model)


@pytest.fixture(scope="module")
def hybrid_weights(hybrid_model: Path) -> dict[str, Any]:
    """``hybrid_model``'s checkpoint in bfloat16, the engine's dtype."""
    from .hybrid_suites import bfloat16_weights

    return bfloat16_weights(hybrid_model)
