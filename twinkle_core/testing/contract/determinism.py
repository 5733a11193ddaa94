"""Greedy and seeded sampling repeat; different seeds and samples differ."""

from __future__ import annotations

from twinkle_core.data_format import SamplingParams
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract.base import ContractBase
from twinkle_core.testing.contract.prompts import traj

__all__ = ["DeterminismTests"]


class DeterminismTests(ContractBase):
    """Greedy and seeded sampling are reproducible, alone or batched; seeds and samples differ."""

    # -- determinism -------------------------------------------------------------------------
    def test_greedy_is_deterministic_alone_and_batched(self, sampler: Sampler) -> None:
        alone = self.greedy_tokens(sampler, [traj(2)])[0]
        assert self.greedy_tokens(sampler, [traj(2)])[0] == alone
        batched = self.greedy_tokens(sampler, [traj(1), traj(2), traj(0), traj(3)])
        assert batched[1] == alone

    def test_seeded_sampling_is_reproducible(self, sampler: Sampler) -> None:
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1234)
        alone = sampler.sample([traj(2)], params)[0].sequences[0].tokens
        again = sampler.sample([traj(2)], params)[0].sequences[0].tokens
        assert again == alone
        # whatever else is in the batch
        batched = sampler.sample([traj(0), traj(2), traj(1)], params)[1].sequences[0].tokens
        assert batched == alone

    def test_different_seeds_differ(self, sampler: Sampler) -> None:
        def run(seed: int) -> list[list[int]]:
            params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True, seed=seed)
            return [r.sequences[0].tokens for r in sampler.sample([traj(i) for i in range(4)], params)]

        assert run(1) != run(2)

    def test_a_top_k_beyond_the_vocabulary_keeps_every_token(self, sampler: Sampler) -> None:
        """``top_k`` of the vocabulary size or more (up to any integer) is the same as no top-k."""
        params = SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True, seed=11, num_samples=2, logprobs=0)
        off = sampler.sample([traj(0), traj(1)], params)
        for top_k in (2**20, 2**64):  # wider than any vocabulary
            wide = sampler.sample([traj(0), traj(1)], params.replace(top_k=top_k))
            assert [[s.tokens for s in r.sequences] for r in wide] == [[s.tokens for s in r.sequences] for r in off]
        self.assert_still_works(sampler)

    def test_consecutive_seeds_share_no_samples(self, sampler: Sampler) -> None:
        """An RL loop that seeds step ``t`` with ``t`` must not get step ``t``'s sample ``i`` again as
        step ``t + 1``'s sample ``i - 1`` (as an engine seeding sample ``i`` with ``seed + i`` would).

        A peaked model may repeat a sample by chance; the fault repeats every one of them, shifted.
        """
        n = 6
        runs = {}
        for seed in (40, 41, 2**80, 2**80 + 1):  # any integer is a seed
            params = SamplingParams(temperature=3.0, max_tokens=12, ignore_eos=True, seed=seed, num_samples=n)
            runs[seed] = [tuple(s.tokens) for s in sampler.sample(traj(1), params)[0].sequences]
        for seed in (40, 2**80):
            shifted = [runs[seed][i] == runs[seed + 1][i - 1] for i in range(1, n)]
            assert not all(shifted), f"sample i of seed {seed} is sample i - 1 of seed {seed + 1}: {runs[seed]}"

    def test_samples_of_one_prompt_differ(self, sampler: Sampler) -> None:
        params = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True, seed=7)
        seqs = sampler.sample(traj(1), params, num_samples=4)[0].sequences
        assert len({tuple(s.tokens) for s in seqs}) > 1
