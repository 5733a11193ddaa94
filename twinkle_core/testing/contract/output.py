"""The shape of what ``sample()`` returns: one response per input, in order, as many samples as asked."""

from __future__ import annotations

from typing import Any

import pytest

from twinkle_core.data_format import IGNORE_INDEX, SamplingParams
from twinkle_core.errors import InvalidSamplingParams
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract.base import ContractBase
from twinkle_core.testing.contract.prompts import greedy_params, traj

__all__ = ["OutputShapeTests"]


class OutputShapeTests(ContractBase):
    """One response per input in input order, ``num_samples`` sequences, ``max_tokens``, the metadata."""

    # -- shape of the output -----------------------------------------------------------------
    def test_empty_input_returns_empty_list(self, sampler: Sampler) -> None:
        assert sampler.sample([], greedy_params()) == []

    def test_one_response_per_input_in_order(self, sampler: Sampler) -> None:
        trajs = [traj(i) for i in range(4)]
        features = [sampler.template.encode(t) for t in trajs]
        mixed: list[Any] = [trajs[0], features[1], trajs[2], features[3]]
        out = sampler.sample(mixed, greedy_params(max_tokens=3))
        assert [r.prompt_token_ids for r in out] == [f.input_ids for f in features]
        assert all(len(r.sequences) == 1 for r in out)
        # a single input (not a list) is one input
        single = sampler.sample(trajs[1], greedy_params(max_tokens=3))
        assert len(single) == 1 and single[0].prompt_token_ids == features[1].input_ids

    def test_num_samples_keyword_params_and_dict(self, sampler: Sampler) -> None:
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=1)
        out = sampler.sample([traj(0), traj(1)], params, num_samples=3)
        assert [len(r.sequences) for r in out] == [3, 3]
        out = sampler.sample([traj(2)], params.replace(num_samples=2))
        assert len(out[0].sequences) == 2
        out = sampler.sample([traj(2)], {"max_tokens": 2, "n": 2})
        assert len(out[0].sequences) == 2 and all(len(s.tokens) <= 2 for s in out[0].sequences)
        with pytest.raises(InvalidSamplingParams, match="num_samples"):
            sampler.sample([traj(0)], params.replace(num_samples=2), num_samples=3)
        self.assert_still_works(sampler)

    def test_max_tokens_and_length_stop_reason(self, sampler: Sampler) -> None:
        for n in (1, 7):
            seq = sampler.sample(traj(1), greedy_params(max_tokens=n))[0].sequences[0]
            assert len(seq.tokens) == n
            assert seq.stop_reason == "length"
            assert seq.stop is None

    def test_sequence_metadata_and_training_feature(self, sampler: Sampler) -> None:
        resp = sampler.sample(traj(3), greedy_params(max_tokens=6))[0]
        seq = resp.sequences[0]
        assert seq.weights_version == sampler.weights_version
        assert seq.adapter_name == ""
        assert seq.text == sampler.template.decode(seq.tokens)
        feat = seq.training_feature
        assert feat is not None
        assert feat.input_ids == resp.prompt_token_ids + seq.tokens
        assert feat.labels == [IGNORE_INDEX] * len(resp.prompt_token_ids) + seq.tokens
