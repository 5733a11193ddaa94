"""A user's script, type-checked by mypy in ``make lint`` (strict, like a careful user's project).

It is not run: it proves that the public API's annotations hold for code that
uses it. ``assert_type`` fails the check when a public name hands back ``Any``
or a wrong type, so an annotation loosened in the library shows up here.
``test_user_api_types.py`` proves mypy does report errors in this setting.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import assert_type

import twinkle_core
from twinkle_core import (
    InputFeature,
    NamedSampler,
    SampledSequence,
    Sampler,
    SampleResponse,
    SamplingParams,
    Trajectory,
    TwinkleError,
    create_sampler,
)
from twinkle_core.engine import BatchEngine, EngineContext, EngineInfo


class ConstantEngine(BatchEngine):
    """An engine author's engine: the one required method, typed as the contract declares it."""

    def __init__(self, context: EngineContext, token: int = 7, *, window: int = 64) -> None:
        super().__init__(context)
        self._token = token
        self.info = EngineInfo(name="constant", max_model_len=window, supported_params={"seed"})

    def generate(self, prompts: list[InputFeature], params: SamplingParams, adapter_name: str) -> list[SampleResponse]:
        return [
            SampleResponse(
                prompt_token_ids=list(p.input_ids),
                sequences=[
                    self.context.make_sequence(
                        list(p.input_ids),
                        [self._token] * params.max_tokens,
                        stop_reason="length",
                        adapter_name=adapter_name,
                        text="",
                    )
                    for _ in range(params.num_samples)
                ],
            )
            for p in prompts
        ]


class ConstantSampler(NamedSampler):
    """The engine's constructor under a name, as ``TorchSampler`` is ``Sampler(TorchEngine, ...)``."""

    engine_class = ConstantEngine

    def __init__(self, token: int = 7, *, window: int = 64, remote_group: str | None = None) -> None:
        super().__init__(token, window=window)


def train_step(sampler: Sampler, prompts: list[Trajectory], new_weights: dict[str, Any]) -> list[float]:
    """One RL step as a trainer writes it: sample, score, push weights."""
    params = SamplingParams(max_tokens=32, temperature=0.7, top_p=0.9, logprobs=0, seed=1)
    responses = sampler.sample(prompts, params, num_samples=4)
    assert_type(responses, list[SampleResponse])
    rewards: list[float] = []
    for response in responses:
        for seq in response.sequences:
            assert_type(seq, SampledSequence)
            assert_type(seq.tokens, list[int])
            assert_type(seq.text, str)
            assert_type(seq.weights_version, int)
            logprobs = seq.logprobs
            rewards.append(sum(logprobs) if logprobs is not None else 0.0)
    version = sampler.update_weights(new_weights)
    assert_type(version, int)
    assert_type(sampler.update_weights(list(new_weights.items()), version=version + 1), int)
    return rewards


def main() -> None:
    by_name = create_sampler("torch", model_id="builtin://smollm2-135m")
    assert_type(by_name, Sampler)
    # With remote_group= it is a RemoteSampler, so a class argument still gives a Sampler.
    by_class = create_sampler(ConstantSampler, token=3)
    assert_type(by_class, Sampler)
    by_engine = create_sampler(ConstantEngine, token=3)
    assert_type(by_engine, Sampler)
    direct = ConstantSampler(5, window=128)
    assert_type(direct, ConstantSampler)
    with direct as sampler:
        assert_type(sampler, ConstantSampler)
        train_step(sampler, [Trajectory(messages=[{"role": "user", "content": "hi"}])], {})
        feature = InputFeature(input_ids=[1, 2, 3])
        first = sampler.sample(feature, {"max_tokens": 4})[0]
        assert_type(first.sequences, list[SampledSequence])
    try:
        by_name.sample([], SamplingParams(max_tokens=1))
    except TwinkleError as exc:
        print(f"refused: {exc}")
    assert_type(twinkle_core.__version__, str)
