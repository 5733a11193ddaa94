"""The log-prob contract's shape: none unless asked, one per token, top-k sorted, prompt log-probs."""

from __future__ import annotations

import math

import pytest

from twinkle_core.data_format import InputFeature, SamplingParams
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract.base import ContractBase
from twinkle_core.testing.contract.prompts import greedy_params, traj

__all__ = ["LogprobTests"]


class LogprobTests(ContractBase):
    """Which log-probs come back and how they relate: sampled, top-k, processed and raw, prompt."""

    # -- the log-prob contract ---------------------------------------------------------------
    def test_no_logprobs_unless_asked(self, sampler: Sampler) -> None:
        resp = sampler.sample(traj(0), greedy_params(max_tokens=3))[0]
        assert resp.sequences[0].logprobs is None and resp.sequences[0].top_logprobs is None
        assert resp.prompt_logprobs is None

    def test_sampled_token_logprob_every_position(self, sampler: Sampler) -> None:
        params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=3, logprobs=0)
        seq = sampler.sample(traj(1), params)[0].sequences[0]
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        assert all(isinstance(x, float) and math.isfinite(x) and x <= 1e-6 for x in seq.logprobs)
        assert seq.top_logprobs is None

    def test_greedy_token_has_top_logprob_and_topk_sorted(self, sampler: Sampler) -> None:
        seq = sampler.sample(traj(3), greedy_params(max_tokens=8, logprobs=3))[0].sequences[0]
        assert seq.logprobs is not None and seq.top_logprobs is not None
        assert len(seq.top_logprobs) == len(seq.tokens)
        for tok, lp, top in zip(seq.tokens, seq.logprobs, seq.top_logprobs):
            assert len(top) == 3
            values = [v for _, v in top]
            assert values == sorted(values, reverse=True)
            assert top[0][0] == tok
            assert lp == pytest.approx(top[0][1], abs=self.logprob_atol)

    def test_sampled_logprob_present_when_outside_topk(self, sampler: Sampler) -> None:
        params = SamplingParams(temperature=3.0, max_tokens=24, ignore_eos=True, seed=11, logprobs=1)
        seqs = sampler.sample([traj(i) for i in range(4)], params)
        outside = 0
        for r in seqs:
            seq = r.sequences[0]
            assert seq.logprobs is not None and seq.top_logprobs is not None
            assert len(seq.logprobs) == len(seq.tokens)
            for tok, lp, top in zip(seq.tokens, seq.logprobs, seq.top_logprobs):
                if top[0][0] != tok:
                    outside += 1
                    assert lp <= top[0][1] + self.logprob_atol
        assert outside > 0, "at temperature 3 some sampled tokens should fall outside the top-1"

    def test_processed_equals_raw_without_processing(self, sampler: Sampler) -> None:
        base = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=5, logprobs=0)
        proc = sampler.sample(traj(1), base)[0].sequences[0]
        raw = sampler.sample(traj(1), base.replace(logprobs_mode="raw"))[0].sequences[0]
        assert proc.tokens == raw.tokens
        assert proc.logprobs == pytest.approx(raw.logprobs, abs=self.logprob_atol)

    def test_processed_logprobs_follow_the_sampling_distribution(self, sampler: Sampler) -> None:
        params = SamplingParams(temperature=0.7, top_k=3, max_tokens=8, ignore_eos=True, seed=9, logprobs=3)
        proc = sampler.sample(traj(2), params)[0].sequences[0]
        raw = sampler.sample(traj(2), params.replace(logprobs_mode="raw"))[0].sequences[0]
        assert proc.tokens == raw.tokens
        assert proc.top_logprobs is not None and raw.top_logprobs is not None
        for top_p, top_r in zip(proc.top_logprobs, raw.top_logprobs):
            # after top-k=3 the three survivors carry all the probability mass
            assert sum(math.exp(v) for _, v in top_p if v > -math.inf) == pytest.approx(1.0, abs=1e-3)
            assert sum(math.exp(v) for _, v in top_r) < 1.0 + 1e-6
        assert proc.logprobs is not None and raw.logprobs is not None
        # a renormalised distribution gives the sampled token at least its raw... up to temperature
        assert any(abs(a - b) > 1e-3 for a, b in zip(proc.logprobs, raw.logprobs))

    def test_prompt_logprobs_and_scoring_only(self, sampler: Sampler) -> None:
        gen = sampler.sample(traj(0), greedy_params(max_tokens=6, logprobs=0, logprobs_mode="raw"))[0]
        seq = gen.sequences[0]
        full = InputFeature(input_ids=gen.prompt_token_ids + seq.tokens)
        scored = sampler.sample(full, SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
        assert len(scored.sequences) == 1 and scored.sequences[0].tokens == []
        assert scored.prompt_logprobs is not None and len(scored.prompt_logprobs) == len(full.input_ids)
        assert scored.prompt_logprobs[0] is None
        tail = scored.prompt_logprobs[len(gen.prompt_token_ids) :]
        assert tail == pytest.approx(seq.logprobs, abs=1e-3)
        assert all(x is not None and x <= 1e-6 for x in scored.prompt_logprobs[1:])
        topk = sampler.sample(full, SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
        assert topk.prompt_top_logprobs is not None and topk.prompt_top_logprobs[0] is None
        for entry in topk.prompt_top_logprobs[1:]:
            assert entry is not None and len(entry) == 2 and entry[0][1] >= entry[1][1]
