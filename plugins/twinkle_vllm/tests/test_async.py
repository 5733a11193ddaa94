"""The asynchronous API on the vLLM engine: the shared ``AsyncContractTests``.

vLLM draws the i-th sample of a seeded request from ``seed + i`` over the
whole request: a continued sequence is a fresh request, so it is a valid
sample of the same distribution but not the uninterrupted one
(``exact_seeded_resume = False``; see docs/async.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from twinkle_core.testing.async_contract import AsyncContractTests

from .conftest import make_sampler


class TestVllmAsync(AsyncContractTests):
    exact_seeded_resume = False
    async_logprob_atol = 1e-3

    @pytest.fixture(scope="class")
    @classmethod
    def sampler(cls, tiny_model: Path) -> Iterator[Any]:
        with make_sampler(tiny_model) as s:
            yield s

    @pytest.fixture(scope="class")
    @classmethod
    def weights_a(cls, tiny_model: Path) -> dict[str, Any]:
        return load_file(str(tiny_model / "model.safetensors"))

    @pytest.fixture(scope="class")
    @classmethod
    def weights_b(cls, weights_a: dict[str, Any]) -> dict[str, Any]:
        import torch

        key = "lm_head.weight" if "lm_head.weight" in weights_a else "model.embed_tokens.weight"
        return {**weights_a, key: torch.roll(weights_a[key], 1, dims=0)}

    def test_resume_goes_on_under_the_same_constraint(self, sampler: Any) -> None:
        # A continuation is a new vLLM request; vLLM's own grammar would start over at its first token
        # (a second "<" here). The engine feeds the earlier tokens to its own matcher first instead.
        import time

        from twinkle_core.data_format import SamplingParams, Trajectory
        from twinkle_core.data_format.structured import compile_structured
        from twinkle_core.testing.contract import CONTRACT_PROMPTS

        structured = {"regex": "<[a-z ]+"}
        # min_tokens holds the end token back: the sequence runs to max_tokens unless aborted
        params = SamplingParams(temperature=1.0, max_tokens=300, min_tokens=300, seed=5, structured_outputs=structured)
        prompt = sampler.template.encode(Trajectory(messages=CONTRACT_PROMPTS[0]))
        for delay in (0.3, 0.6, 1.2, 2.4, 4.8):
            handle = sampler.submit([prompt], params)
            time.sleep(delay)
            handle.abort()
            partial = handle.result(timeout=300)[0].sequences[0]
            if partial.stop_reason == "abort" and len(partial.tokens) >= 3:
                break
        else:
            pytest.fail("no abort landed mid-sequence")
        resumed = handle.resume().result(timeout=300)[0].sequences[0]
        assert resumed.tokens[: len(partial.tokens)] == partial.tokens
        assert len(resumed.tokens) == 300 and resumed.stop_reason == "length"
        stops = sorted(set(sampler.engine.eos_token_ids))
        matcher = compile_structured(params.structured_outputs, sampler.tokenizer, sampler.vocab_size, stops)
        for i, token in enumerate(resumed.tokens):
            assert matcher.accept_token(token), f"token {i} of {resumed.text!r} breaks the constraint"
        assert resumed.text.startswith("<") and resumed.text.count("<") == 1
