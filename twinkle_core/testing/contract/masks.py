"""Sampling masks (``return_sampling_mask``) and routed experts: refused unless declared, exact when given."""

from __future__ import annotations

import math

import pytest

from twinkle_core.data_format import SamplingParams
from twinkle_core.errors import UnsupportedFeatureError
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract.base import ContractBase, engine_label
from twinkle_core.testing.contract.prompts import greedy_params, traj

__all__ = ["SamplingMaskTests"]


class SamplingMaskTests(ContractBase):
    """The kept set per position matches the processed top-k; greedy rows are empty."""

    # -- sampling masks (SamplingParams.return_sampling_mask) -----------------------------
    # Kept in one block at the end so the suite's other additions merge cleanly.
    def _needs_mask(self, sampler: Sampler) -> None:
        if "return_sampling_mask" not in sampler.supported_params:
            pytest.skip(f"the {engine_label(sampler)} engine does not declare return_sampling_mask")

    def test_sampling_mask_refused_unless_declared(self, sampler: Sampler) -> None:
        if "return_sampling_mask" in sampler.supported_params:
            pytest.skip(f"the {engine_label(sampler)} engine declares return_sampling_mask")
        with pytest.raises(UnsupportedFeatureError, match="return_sampling_mask"):
            sampler.sample(traj(0), greedy_params(max_tokens=2, return_sampling_mask=True))
        self.assert_still_works(sampler)

    def test_routed_experts_refused_unless_declared(self, sampler: Sampler) -> None:
        if "return_routed_experts" in sampler.supported_params:
            pytest.skip(f"the {engine_label(sampler)} engine declares return_routed_experts")
        with pytest.raises(UnsupportedFeatureError, match="return_routed_experts"):
            sampler.sample(traj(0), greedy_params(max_tokens=2, return_routed_experts=True))
        self.assert_still_works(sampler)

    def test_sampling_mask_under_top_k_is_the_top_k_set(self, sampler: Sampler) -> None:
        self._needs_mask(sampler)
        k = 4
        params = SamplingParams(
            max_tokens=8, top_k=k, temperature=1.3, seed=5, num_samples=2, logprobs=k, return_sampling_mask=True
        )
        for response in sampler.sample([traj(0), traj(1)], params):
            for seq in response.sequences:
                mask = seq.sampling_mask
                assert mask is not None and len(mask) == len(seq.tokens)
                assert seq.top_logprobs is not None and seq.logprobs is not None
                for i, token in enumerate(seq.tokens):
                    kept = mask.kept(i)
                    # the processed top-k alternatives are exactly the kept set, and they carry all the mass
                    assert sorted(kept) == sorted(t for t, _ in seq.top_logprobs[i]), f"position {i}"
                    assert token in kept
                    assert math.log(sum(math.exp(lp) for _, lp in seq.top_logprobs[i])) == pytest.approx(
                        0.0, abs=self.logprob_atol
                    )

    def test_sampling_mask_greedy_rows_are_empty_and_samples_unchanged(self, sampler: Sampler) -> None:
        self._needs_mask(sampler)
        greedy = sampler.sample(traj(0), greedy_params(return_sampling_mask=True))[0].sequences[0]
        assert greedy.sampling_mask is not None
        assert len(greedy.sampling_mask) == len(greedy.tokens) and greedy.sampling_mask.token_ids == []
        params = SamplingParams(max_tokens=8, top_p=0.8, temperature=1.2, seed=11, num_samples=3)
        plain = sampler.sample(traj(1), params)[0].sequences
        masked = sampler.sample(traj(1), params.replace(return_sampling_mask=True))[0].sequences
        assert [s.tokens for s in plain] == [s.tokens for s in masked]
        assert all(s.sampling_mask is None for s in plain)
