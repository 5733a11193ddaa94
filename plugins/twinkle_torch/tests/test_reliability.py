"""Faults and bad input on the torch engine: nothing wrong is ever returned, nothing is lost."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from twinkle_core import InputFeature, SamplingParams, Trajectory
from twinkle_core.errors import InvalidInputError, InvalidSamplingParams
from twinkle_core.testing.faults import check_refused_changes, run_soak, soak_seconds
from twinkle_torch import TorchSampler


def _states(model_dir: Path) -> list[dict[str, torch.Tensor]]:
    state = load_file(str(model_dir / "model.safetensors"))
    head = state["lm_head.weight"] if "lm_head.weight" in state else state["model.embed_tokens.weight"]
    swapped = head.clone()
    top = torch.arange(head.shape[0])
    swapped[top] = head[top.flip(0)]  # a permuted output layer: every greedy choice moves
    key = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"
    return [state, {**state, key: swapped}]


def test_refused_weights_and_adapters_change_nothing(
    tiny_llama: Path, chat_prompts: list[Trajectory], lora_dirs: dict[str, Path]
) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        check_refused_changes(s, chat_prompts[:3], _states(tiny_llama)[0], lora_dirs["a"])


def test_one_bad_input_does_not_lose_the_batch(tiny_llama: Path, chat_prompts: list[Trajectory]) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        good = chat_prompts[0]
        bad = [
            {"messages": [{"role": "user", "content": "\ud800"}]},  # a lone surrogate no tokenizer can encode
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": 1}]},
            {"messages": [{"role": "wizard", "content": "hi"}]},
            {"messages": [{"content": "no role"}]},
            42,
        ]
        out = s.sample([good, *bad, good], {"max_tokens": 3, "temperature": 0}, on_invalid="skip")
        assert len(out) == len(bad) + 2
        assert out[0].sequences and out[-1].sequences and out[0].sequences[0].tokens == out[-1].sequences[0].tokens
        for k, resp in enumerate(out[1:-1], start=1):
            assert resp.error and f"inputs[{k}]" in resp.error and not resp.sequences, resp
        for item in bad:
            with pytest.raises(InvalidInputError):
                s.sample([good, item], {"max_tokens": 1})


@pytest.mark.parametrize(
    "params",
    [
        {"logprobs": 10**9},
        {"logprobs": 769},
        {"prompt_logprobs": 10**6},
        {"temperature": 1e-300},
        {"stop_token_ids": [2**70]},
        {"stop_token_ids": [768]},
        {"num_samples": 10**6},
        {"max_tokens": 2**64},
    ],
    ids=lambda p: next(iter(p)),
)
def test_values_beyond_limits_are_refused_before_any_allocation(tiny_llama: Path, params: dict) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        with pytest.raises(InvalidSamplingParams, match=next(iter(params))):
            s.sample(InputFeature(input_ids=[1, 2, 3]), params)
        assert len(s.sample(InputFeature(input_ids=[1, 2, 3]), {"max_tokens": 2})[0].sequences[0].tokens) == 2


def test_logprobs_up_to_the_vocabulary_work(tiny_llama: Path) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        seq = s.sample(InputFeature(input_ids=[1, 2, 3]), SamplingParams(max_tokens=2, logprobs=s.vocab_size))[0]
        assert len(seq.sequences[0].top_logprobs[0]) == s.vocab_size


@pytest.mark.soak
def test_soak_every_sequence_matches_its_weights_and_adapter(
    tiny_llama: Path, chat_prompts: list[Trajectory], lora_dirs: dict[str, Path]
) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        report = run_soak(
            s, chat_prompts[:3], _states(tiny_llama), {"a": lora_dirs["a"], "b": lora_dirs["b"]}, seconds=soak_seconds()
        )
    assert report.sequences > 0 and report.updates > 0 and report.swaps > 0, report
