"""Bad input: typed errors naming the offending value, and the sampler keeps working after each."""

from __future__ import annotations

from typing import Any

import pytest

from twinkle_core.data_format import InputFeature
from twinkle_core.errors import (
    InvalidInputError,
    InvalidSamplingParams,
    PromptTooLongError,
    TwinkleError,
    UnknownAdapterError,
    UnknownTemplateError,
)
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract.base import ContractBase
from twinkle_core.testing.contract.prompts import greedy_params, traj

__all__ = ["BadInputTests"]


class BadInputTests(ContractBase):
    """Bad parameters, inputs, prompts, adapters and templates raise typed errors; the engine goes on."""

    # -- bad input: typed errors, and the sampler keeps working --------------------------------
    @pytest.mark.parametrize(
        "bad",
        [
            {"temperature": -0.1},
            {"top_p": 0.0},
            {"top_p": 1.5},
            {"top_k": 0},
            {"top_k": -2},
            {"max_tokens": -1},
            {"num_samples": 0},
            {"logprobs": -1},
            {"seed": "abc"},
            {"stop": 5},
            {"max_new_token": 5},
            {"presence_penalty": 2.5},
            {"frequency_penalty": -3},
            {"min_tokens": -1},
            {"min_tokens": 20, "max_tokens": 10},
            {"logit_bias": {1: 500}},
            {"logit_bias": {"one": 1.0}},
            {"allowed_token_ids": []},
            {"bad_words": [""]},
            {"truncate_prompt_tokens": 0},
            {"skip_special_tokens": "yes"},
            {"structured_outputs": {"regex": "a", "choice": ["b"]}},
            {"structured_outputs": {"json": "{not json"}},
        ],
        ids=lambda d: next(iter(d)),
    )
    def test_bad_sampling_params(self, sampler: Sampler, bad: dict[str, Any]) -> None:
        key, _value = next(iter(bad.items()))
        with pytest.raises(InvalidSamplingParams) as info:
            sampler.sample(traj(0), bad)
        assert key in str(info.value)
        assert isinstance(info.value, ValueError)
        self.assert_still_works(sampler)

    @pytest.mark.parametrize(
        "bad_input",
        [
            {"messages": []},
            {"messages": [{"content": "no role"}]},
            {"messages": [{"role": "wizard", "content": "hi"}]},
            {"input_ids": []},
            "just a string",
        ],
        ids=["empty", "no-role", "unknown-role", "no-tokens", "string"],
    )
    def test_bad_inputs(self, sampler: Sampler, bad_input: Any) -> None:
        with pytest.raises(InvalidInputError):
            sampler.sample([traj(0), bad_input], greedy_params(max_tokens=2))
        self.assert_still_works(sampler)

    def test_prompt_too_long_names_the_input(self, sampler: Sampler) -> None:
        tok = sampler.template.encode(traj(0)).input_ids[0]
        too_long = InputFeature(input_ids=[tok] * (sampler.max_model_len + 1))
        with pytest.raises(PromptTooLongError, match=r"inputs\[1\]") as info:
            sampler.sample([traj(0), too_long, traj(1)], greedy_params(max_tokens=2))
        assert info.value.index == 1
        self.assert_still_works(sampler)
        # asked to, the other inputs are not lost
        out = sampler.sample([traj(0), too_long, traj(1)], greedy_params(max_tokens=2), on_invalid="skip")
        assert [len(r.sequences) for r in out] == [1, 0, 1]
        assert out[1].error is not None and "inputs[1]" in out[1].error
        assert out[0].error is None and out[2].error is None

    def test_unknown_adapter(self, sampler: Sampler) -> None:
        with pytest.raises(UnknownAdapterError, match="no-such-adapter"):
            sampler.sample(traj(0), greedy_params(max_tokens=2), adapter_name="no-such-adapter")
        with pytest.raises(UnknownAdapterError):
            sampler.remove_adapter("no-such-adapter")
        self.assert_still_works(sampler)

    def test_unknown_template(self, sampler: Sampler) -> None:
        with pytest.raises(UnknownTemplateError, match="no-such-template"):
            sampler.set_template("no-such-template")
        self.assert_still_works(sampler)

    def test_errors_share_a_base_class(self, sampler: Sampler) -> None:
        with pytest.raises(TwinkleError):
            sampler.sample(traj(0), {"temperature": -1})
