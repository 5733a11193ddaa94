"""What the ``Sampler`` does for every engine: params, inputs, versions, lifecycle."""

from __future__ import annotations

import pytest

from twinkle_core import InputFeature, SamplingParams, Trajectory
from twinkle_core.data_format import SampleResponse
from twinkle_core.engine import BatchEngine, EngineContext, EngineInfo
from twinkle_core.errors import (
    InvalidInputError,
    InvalidSamplingParams,
    SamplerClosedError,
    UnsupportedFeatureError,
    WeightUpdateError,
)
from twinkle_core.sampler import Sampler, normalize_inputs, resolve_params


class CountingEngine(BatchEngine):
    """Generates ``[prompt[-1] + 1, ...]``: enough to watch the sampler work."""

    def __init__(self, context: EngineContext) -> None:
        super().__init__(context)
        self.info = EngineInfo(name="counting", max_model_len=8, vocab_size=100)
        self.calls: list[int] = []
        self.closed_count = 0
        self.applied: list[list[str]] = []

    def generate(self, prompts, params, adapter_name):  # type: ignore[no-untyped-def]
        self.calls.append(len(prompts))
        out = []
        for p in prompts:
            toks = [p.input_ids[-1] + 1 + i for i in range(params.max_tokens)]
            seqs = [
                self.context.make_sequence(p.input_ids, toks, stop_reason="length", adapter_name=adapter_name, text="x")
                for _ in range(params.num_samples)
            ]
            out.append(SampleResponse(prompt_token_ids=p.input_ids, sequences=seqs))
        return out

    def update_weights(self, named_tensors, *, version):  # type: ignore[no-untyped-def]
        if any(name.startswith("bad") for name, _ in named_tensors):
            raise WeightUpdateError("bad name")
        self.applied.append([n for n, _ in named_tensors])

    def close(self) -> None:
        self.closed_count += 1


def test_resolve_params_num_samples_rules():
    assert resolve_params(None, None) == SamplingParams()
    assert resolve_params({"max_tokens": 3}, 4).num_samples == 4
    assert resolve_params(SamplingParams(num_samples=2), 2).num_samples == 2
    with pytest.raises(InvalidSamplingParams, match="conflicts"):
        resolve_params(SamplingParams(num_samples=2), 3)
    with pytest.raises(InvalidSamplingParams, match="conflicts"):
        resolve_params({"num_samples": 2}, 3)
    with pytest.raises(InvalidSamplingParams, match="num_samples=0"):
        resolve_params(None, 0)


def test_normalize_inputs_accepts_mixed_lists_and_single_items():
    f = InputFeature(input_ids=[1])
    t = Trajectory(messages=[{"role": "user", "content": "hi"}])
    assert normalize_inputs(f) == [f]
    assert normalize_inputs([t, f, {"input_ids": [2]}, {"messages": [{"role": "user", "content": "x"}]}])[
        2
    ].input_ids == [2]
    with pytest.raises(InvalidInputError, match="single chat message"):
        normalize_inputs([{"role": "user", "content": "hi"}])
    with pytest.raises(InvalidInputError, match=r"inputs\[1\]"):
        normalize_inputs([f, 42])


def test_sample_counts_order_and_version_stamp():
    eng = Sampler(CountingEngine)
    out = eng.sample([InputFeature(input_ids=[i, i + 1]) for i in range(3)], {"max_tokens": 2}, num_samples=2)
    assert [r.sequences[0].tokens for r in out] == [[2, 3], [3, 4], [4, 5]]
    assert all(len(r.sequences) == 2 for r in out)
    assert out[0].sequences[0].weights_version == 0
    assert out[0].sequences[0].training_feature.labels == [-100, -100, 2, 3]


def test_invalid_token_ids_and_length_checked_before_generation():
    eng = Sampler(CountingEngine)
    with pytest.raises(InvalidInputError, match="token id 100 outside the vocabulary"):
        eng.sample([InputFeature(input_ids=[1]), InputFeature(input_ids=[100])], {"max_tokens": 1})
    assert eng.engine.calls == []
    out = eng.sample(
        [InputFeature(input_ids=[1] * 9), InputFeature(input_ids=[1])], {"max_tokens": 1}, on_invalid="skip"
    )
    assert out[0].error and "at most 7" in out[0].error and out[1].sequences
    # scoring only (max_tokens=0) may use the whole window
    assert eng.sample(InputFeature(input_ids=[1] * 8), {"max_tokens": 0})[0].sequences[0].tokens == []
    with pytest.raises(InvalidInputError, match="on_invalid='ignore'"):
        eng.sample([InputFeature(input_ids=[1])], on_invalid="ignore")  # type: ignore[arg-type]


def test_update_weights_versions_are_monotonic_and_all_or_nothing():
    eng = Sampler(CountingEngine)
    assert eng.update_weights({"w": 1}) == 1
    assert eng.update_weights([("w", 2)], version=10) == 10
    with pytest.raises(WeightUpdateError, match="greater than the current weights_version 10"):
        eng.update_weights({"w": 3}, version=10)
    with pytest.raises(WeightUpdateError, match="bad name"):
        eng.update_weights({"bad.w": 3})
    assert eng.weights_version == 10
    with pytest.raises(WeightUpdateError, match="no tensors"):
        eng.update_weights({})
    with pytest.raises(WeightUpdateError, match=r"named_tensors\[0\]"):
        eng.update_weights([("only-a-name",)])  # type: ignore[list-item]
    out = eng.sample(InputFeature(input_ids=[1]), {"max_tokens": 1})
    assert out[0].sequences[0].weights_version == 10


def test_adapters_unsupported_by_default_with_clear_error():
    eng = Sampler(CountingEngine)
    with pytest.raises(UnsupportedFeatureError, match="counting engine has no LoRA support"):
        eng.add_adapter_to_model("a", "/nowhere")
    assert dict(eng.adapters) == {} and eng.weights_version == 0


def test_close_twice_and_context_manager():
    with Sampler(CountingEngine) as eng:
        pass
    assert eng.closed and eng.engine.closed_count == 1
    eng.close()
    assert eng.engine.closed_count == 1
    with pytest.raises(SamplerClosedError):
        eng.sample(InputFeature(input_ids=[1]))
