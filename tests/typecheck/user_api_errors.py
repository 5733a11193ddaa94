"""Mistakes a user's type checker must catch; ``test_user_api_types.py`` checks that mypy reports each one.

Every line ending in ``# E: <code>`` must get exactly that mypy error and no
other line may get one. Not part of ``make lint`` (it is wrong on purpose).
"""

from __future__ import annotations

from twinkle_core import InputFeature, Sampler, SampleResponse, SamplingParams, create_sampler
from twinkle_core.engine import BatchEngine


class WrongHookEngine(BatchEngine):
    """An engine whose methods do not match the contract's signatures."""

    def max_prompt_len(self, params: SamplingParams) -> str:  # E: override
        return "64"

    def generate(self, prompts: list[str], params: SamplingParams, name: str) -> list[SampleResponse]:  # E: override
        return []


def misuse(sampler: Sampler, prompt: InputFeature) -> None:
    """Wrong argument and result types against the public API."""
    SamplingParams(max_tokens="ten")  # E: arg-type
    sampler.sample(prompt, num_samples="4")  # E: arg-type
    sampler.sample(prompt, adapter_name=None)  # E: arg-type
    text: int = sampler.sample(prompt)[0].sequences[0].text  # E: assignment
    version: str = sampler.update_weights({"lm_head.weight": None})  # E: assignment
    sampler.update_weights({"lm_head.weight": None}, version="2")  # E: arg-type
    sampler.update_weights({1: None})  # E: arg-type
    create_sampler(42)  # E: arg-type
    print(text, version)
