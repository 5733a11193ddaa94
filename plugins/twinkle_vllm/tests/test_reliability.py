"""Faults and bad input on the vLLM engine: nothing wrong is ever returned, nothing is lost.

One LoRA-enabled engine for the module.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from twinkle_core import InputFeature, SamplingParams, Trajectory
from twinkle_core.errors import InvalidInputError, InvalidSamplingParams, NumericalError, UnknownAdapterError
from twinkle_core.testing import TINY_CHAT_PROMPTS
from twinkle_core.testing.faults import check_refused_changes, run_soak, soak_seconds

from .conftest import make_sampler

PROMPTS = [Trajectory(messages=m) for m in TINY_CHAT_PROMPTS[:3]]


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[Any]:
    with make_sampler(tiny_model, enable_lora=True, max_lora_rank=8, max_loras=3, max_cpu_loras=4) as s:
        yield s


def _states(model_dir: Path) -> list[dict[str, torch.Tensor]]:
    state = load_file(str(model_dir / "model.safetensors"))
    key = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"
    head = state[key]
    return [state, {**state, key: head.flip(0).contiguous()}]


def test_refused_weights_and_adapters_change_nothing(engine: Any, tiny_model: Path, adapters: dict[str, Path]) -> None:
    check_refused_changes(engine, PROMPTS, _states(tiny_model)[0], adapters["a"])


def test_a_removed_adapter_never_serves_the_base_model(engine: Any, adapters: dict[str, Path]) -> None:
    """The old race: a sample issued while remove_adapter waits ran on the base model under the adapter's name."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_adapter_to_model("c", adapters["b"])
    expected = [r.sequences[0].tokens for r in engine.sample(PROMPTS, params, adapter_name="c")]
    base = [r.sequences[0].tokens for r in engine.sample(PROMPTS, params)]
    assert expected != base
    for _ in range(20):
        started = threading.Event()
        results: list[Any] = []

        def sample(started: threading.Event = started, results: list[Any] = results) -> None:
            started.set()
            try:
                results.append(engine.sample(PROMPTS, params, adapter_name="c"))
            except UnknownAdapterError as exc:
                results.append(exc)

        worker = threading.Thread(target=sample)
        worker.start()
        started.wait(10)
        engine.remove_adapter("c")
        worker.join(60)
        out = results[0]
        if not isinstance(out, Exception):
            assert [r.sequences[0].tokens for r in out] == expected
            assert {r.sequences[0].adapter_name for r in out} == {"c"}
        engine.add_adapter_to_model("c", adapters["b"])
    engine.remove_adapter("c")


def test_one_bad_input_does_not_lose_the_batch(engine: Any) -> None:
    good = PROMPTS[0]
    bad = [
        {"messages": [{"role": "user", "content": "\ud800"}]},
        {"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": 1}]},
        {"messages": [{"role": "wizard", "content": "hi"}]},
    ]
    out = engine.sample([good, *bad, good], {"max_tokens": 3, "temperature": 0}, on_invalid="skip")
    assert out[0].sequences[0].tokens == out[-1].sequences[0].tokens
    for k, resp in enumerate(out[1:-1], start=1):
        assert resp.error and f"inputs[{k}]" in resp.error and not resp.sequences
    for item in bad:
        with pytest.raises(InvalidInputError):
            engine.sample([good, item], {"max_tokens": 1})


@pytest.mark.parametrize(
    "params",
    [
        {"logprobs": 10**9},
        {"temperature": 1e-300},
        {"stop_token_ids": [2**70]},
        {"num_samples": 10**6},
        {"max_tokens": 2**64},
    ],
    ids=lambda p: next(iter(p)),
)
def test_values_beyond_limits_are_typed_errors(engine: Any, params: dict) -> None:
    with pytest.raises(InvalidSamplingParams, match=next(iter(params))):
        engine.sample(InputFeature(input_ids=[1, 2, 3]), params)
    assert len(engine.sample(InputFeature(input_ids=[1, 2, 3]), {"max_tokens": 2})[0].sequences[0].tokens) == 2


def test_a_huge_max_tokens_within_bounds_stops_at_the_context(engine: Any) -> None:
    seq = engine.sample(
        InputFeature(input_ids=[1, 2, 3]), {"max_tokens": 2**31 - 1, "ignore_eos": True, "temperature": 0}
    )[0].sequences[0]
    assert seq.stop_reason == "length" and len(seq.tokens) == engine.max_model_len - 3


@pytest.mark.soak
def test_weights_that_overflow_in_the_forward_fail_the_call_with_or_without_log_probs(
    engine: Any, tiny_model: Path
) -> None:
    """vLLM draws token 0 from NaN logits; its log-prob (NaN) shows it, asked for or not, and the call gets a
    typed error. Calls without log-probs used to get token 0 over and over; scoring, -inf prompt log-probs."""
    scored = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=1)
    base = engine.sample(PROMPTS[0], scored)[0].sequences[0]
    norm = _states(tiny_model)[0]["model.norm.weight"]
    engine.update_weights({"model.norm.weight": torch.full_like(norm, 3e38)})
    try:
        for params in (
            scored,
            scored.replace(temperature=1.0, top_p=0.9),
            SamplingParams(temperature=0.0, max_tokens=4),
            SamplingParams(max_tokens=4, num_samples=2),
            scored.replace(logprobs_mode="raw"),
            scoring,
        ):
            with pytest.raises(NumericalError, match="NaN or infinity: its weights"):
                engine.sample(PROMPTS[0], params)
    finally:
        engine.update_weights({"model.norm.weight": norm})
    again = engine.sample(PROMPTS[0], scored)[0].sequences[0]
    assert (again.tokens, again.logprobs) == (base.tokens, base.logprobs)
    prompt = engine.sample(PROMPTS[0], scoring)[0].prompt_logprobs
    assert prompt is not None and all(math.isfinite(v) for v in prompt[1:])


def test_soak_every_sequence_matches_its_weights_and_adapter(
    engine: Any, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    report = run_soak(
        engine, PROMPTS, _states(tiny_model), {"a": adapters["a"], "b": adapters["b"]}, seconds=soak_seconds()
    )
    assert report.sequences > 0 and report.updates > 0 and report.swaps > 0, report
