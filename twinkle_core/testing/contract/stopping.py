"""Where a sequence stops: stop token ids, stop strings spanning tokens, end of sequence."""

from __future__ import annotations

import pytest

from twinkle_core.data_format import SamplingParams
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract.base import ContractBase
from twinkle_core.testing.contract.prompts import greedy_params, traj

__all__ = ["StoppingTests"]


class StoppingTests(ContractBase):
    """Stop token ids, stop strings and EOS end a sequence with the right reason and tokens."""

    # -- stopping ----------------------------------------------------------------------------
    def test_stop_token_ids(self, sampler: Sampler) -> None:
        tokens = self.greedy_tokens(sampler, traj(1), max_tokens=12)[0]
        stop_id = tokens[4]
        first = tokens.index(stop_id)
        seq = sampler.sample(traj(1), greedy_params(max_tokens=12, stop_token_ids=[stop_id]))[0].sequences[0]
        assert seq.tokens == tokens[: first + 1]
        assert seq.stop_reason == "stop"
        assert seq.stop == stop_id

    def test_stop_string_spanning_tokens(self, sampler: Sampler) -> None:
        tokens = self.greedy_tokens(sampler, traj(1), max_tokens=16)[0]
        full = sampler.template.decode(tokens)
        # character boundaries between tokens; pick a stop string straddling one
        bounds = [len(sampler.template.decode(tokens[:k])) for k in range(1, len(tokens))]
        stop, cut = None, 0
        for b in bounds:
            if 2 <= b <= len(full) - 2:
                cand = full[b - 2 : b + 2]
                if cand.strip() and full.find(cand) == b - 2:
                    stop, cut = cand, b - 2
                    break
        if stop is None:
            pytest.skip("the greedy text has no unique cross-token substring to stop on")
        seq = sampler.sample(traj(1), greedy_params(max_tokens=16, stop=[stop]))[0].sequences[0]
        assert seq.stop_reason == "stop"
        assert seq.stop == stop
        assert seq.text == full[:cut]
        # the tokens are what the model emitted, up to the token that completed the stop string
        emitted = sampler.template.decode(seq.tokens)
        assert emitted.startswith(full[:cut] + stop)
        assert seq.tokens == tokens[: len(seq.tokens)]
        assert len(sampler.template.decode(seq.tokens[:-1])) < cut + len(stop)

    def test_eos_stops_unless_ignored(self, sampler: Sampler) -> None:
        eos = sampler.template.eos_token_id
        if eos is None:
            pytest.skip("the tokenizer has no EOS token")
        # Force EOS through stop detection of the model's own EOS: a sequence that
        # reaches EOS ends there with reason 'stop'; with ignore_eos it runs on.
        outs = sampler.sample([traj(i) for i in range(4)], SamplingParams(temperature=0.0, max_tokens=48))
        ended = [r.sequences[0] for r in outs if r.sequences[0].stop_reason == "stop"]
        for seq in ended:
            assert seq.tokens[-1] == seq.stop
            assert seq.stop not in seq.tokens[:-1]
        for r in outs:
            seq = r.sequences[0]
            if seq.stop_reason == "length":
                assert len(seq.tokens) == 48
        ignored = sampler.sample(
            [traj(i) for i in range(4)], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        )
        assert all(len(r.sequences[0].tokens) == 48 and r.sequences[0].stop_reason == "length" for r in ignored)
        for a, b in zip(outs, ignored):
            n = len(a.sequences[0].tokens)
            assert b.sequences[0].tokens[:n] == a.sequences[0].tokens
