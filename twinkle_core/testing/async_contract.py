"""``AsyncContractTests``: submit, stream, abort, resume and updates with calls in flight, as pytest tests.

Subclass it next to ``SamplerContractTests`` and provide three fixtures:
``sampler`` (the engine), ``weights_a`` and ``weights_b`` (two full weight
updates whose greedy outputs differ). Expectations come from the engine's own
greedy outputs. The tests never order threads with sleeps: an abort or a
weight change is triggered when a short sequence of the same call is
streamed back, so a long one is always mid-flight then.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from typing import Any

import pytest

from twinkle_core.data_format import InputFeature, SamplingParams, Trajectory
from twinkle_core.requests import SampleHandle
from twinkle_core.sampler import Sampler
from twinkle_core.testing.contract import CONTRACT_PROMPTS

__all__ = ["AsyncContractTests"]

#: Tokens of the long sequence: enough that an abort sent when the short one finishes lands mid-flight.
LONG = 400
#: The earliest token of the short continuation the stop token may end it at (its index).
SHORT_STOP_AT = 5


def _greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": LONG, "ignore_eos": True, **kw})


class AsyncContractTests:
    """The asynchronous API of every engine whose ``_run`` stops early and streams."""

    #: Tolerance on log-probs of the same tokens computed in two calls.
    async_logprob_atol: float = 1e-4
    #: Whether a seeded sequence aborted and resumed equals the uninterrupted one token for token.
    exact_seeded_resume: bool = True

    @pytest.fixture
    def sampler(self) -> Sampler:  # pragma: no cover - always overridden
        raise NotImplementedError

    @pytest.fixture
    def weights_a(self) -> Mapping[str, Any]:  # pragma: no cover - always overridden
        raise NotImplementedError

    @pytest.fixture
    def weights_b(self) -> Mapping[str, Any]:  # pragma: no cover - always overridden
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------
    def prompts(self, sampler: Sampler, params: SamplingParams) -> tuple[InputFeature, InputFeature, int]:
        """A short prompt, a long one, and a stop token that ends the short one early but never the long one.

        Found from the engine's own outputs under ``params`` (greedy, or seeded:
        either way reproducible whatever else is in the batch), and checked on
        the very batch the tests submit (``[short, long]`` with the stop token
        set): a candidate the long continuation reaches there after all (a
        near-tie that broke another way in another batch) is passed over.
        """
        trajs = [Trajectory(messages=m) for m in CONTRACT_PROMPTS]
        feats = [sampler.template.encode(t) for t in trajs]
        outs = [r.sequences[0].tokens for r in sampler.sample(feats, params)]
        candidates = (
            (a, b, k, tok)
            for a in range(len(feats))
            for b in range(len(feats))
            if a != b
            for k, tok in enumerate(outs[a][: params.max_tokens // 4])
            # not earlier in the short one, and late enough that the long one, whose request may join the batch a
            # step or two after the short one's, has a few tokens when the short one ends (k >= 2 left it 2 tokens)
            if k >= SHORT_STOP_AT and tok not in outs[b] and tok not in outs[a][:k]
        )
        for _, (a, b, k, tok) in zip(range(3), candidates):
            got = sampler.sample([feats[a], feats[b]], params.replace(stop_token_ids=[tok]))
            short, long_ = (r.sequences[0] for r in got)
            if short.stop_reason == "stop" and len(short.tokens) <= k + 1 and len(long_.tokens) == params.max_tokens:
                return feats[a], feats[b], tok
        pytest.fail(
            "no stop token ends one of CONTRACT_PROMPTS' continuations early without ending another: either"
            " stop_token_ids are not honoured, or the engine's outputs are degenerate (every continuation"
            " repeats the same few tokens)"
        )

    def run_until_short_finishes(
        self, sampler: Sampler, params: SamplingParams, action: Any
    ) -> tuple[SampleHandle, InputFeature, InputFeature, SamplingParams]:
        """Submit [short, long]; when the short one is streamed back, call ``action(handle)``.

        Returns the handle, the two prompts and the parameters the call used.
        """
        short, long_, stop = self.prompts(sampler, params)
        params = params.replace(stop_token_ids=[stop])
        handle = sampler.submit([short, long_], params)
        for item in handle.as_completed(timeout=300):
            if item.input_index == 0:
                action(handle)
        return handle, short, long_, params

    def abort_mid_flight(
        self, sampler: Sampler, params: SamplingParams, min_tokens: int
    ) -> tuple[SampleHandle, InputFeature, SamplingParams]:
        """Abort ``[short, long]`` when the short one is back, until the long one has ``min_tokens``.

        When the two prompts run on different replicas (a Ray group), the long
        one can still be waiting for its first steps when the short one is
        back: that is scheduling, not a fault, so the call is tried again (at
        most three times) rather than the test asserting a race.
        """
        for _ in range(3):
            handle, _short, long_, used = self.run_until_short_finishes(sampler, params, lambda h: h.abort())
            if len(handle.result()[1].sequences[0].tokens) >= min_tokens:
                return handle, long_, used
        pytest.fail(f"three aborts, each sent when the short prompt was back, left fewer than {min_tokens} tokens")

    # -- tests -----------------------------------------------------------------------------
    def test_submit_result_equals_sample(self, sampler: Sampler) -> None:
        trajs = [Trajectory(messages=m) for m in CONTRACT_PROMPTS]
        params = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3, logprobs=1)
        handle = sampler.submit(trajs, params, num_samples=2)
        got = handle.result(timeout=300)
        assert handle.done()
        want = sampler.sample(trajs, params, num_samples=2)
        assert [[s.tokens for s in r.sequences] for r in got] == [[s.tokens for s in r.sequences] for r in want]

    def test_stream_yields_every_sequence_once(self, sampler: Sampler) -> None:
        trajs = [Trajectory(messages=m) for m in CONTRACT_PROMPTS]
        handle = sampler.submit(trajs, _greedy(max_tokens=8), num_samples=3)
        items = list(handle.as_completed(timeout=300))
        assert sorted((i.input_index, i.sample_index) for i in items) == [(i, s) for i in range(4) for s in range(3)]
        result = handle.result()
        for item in items:
            assert result[item.input_index].sequences[item.sample_index].tokens == item.sequence.tokens

    def test_short_sequences_stream_before_long_ones_finish(self, sampler: Sampler) -> None:
        order: list[int] = []
        handle, _, _, _ = self.run_until_short_finishes(sampler, _greedy(), lambda h: order.append(len(order)))
        items = handle.result()
        assert order == [0]  # the short one came back alone first
        assert len(items[1].sequences[0].tokens) == LONG

    def test_asyncio_does_not_block_the_loop(self, sampler: Sampler) -> None:
        trajs = [Trajectory(messages=m) for m in CONTRACT_PROMPTS]

        async def main() -> tuple[list[Any], list[Any], int, int]:
            ticks = 0
            done = asyncio.Event()

            async def ticker() -> None:
                # After the first ticks, a short sleep rather than sleep(0): a loop spinning on
                # sleep(0) holds the GIL, and slowed a Python decode thread 100-fold here.
                nonlocal ticks
                while not done.is_set():
                    ticks += 1
                    await asyncio.sleep(0 if ticks < 20 else 0.002)

            task = asyncio.create_task(ticker())
            result = await sampler.asample(trajs, _greedy(max_tokens=24))
            during = ticks
            streamed = [item async for item in sampler.submit(trajs, _greedy(max_tokens=8))]
            done.set()
            await task
            return result, streamed, during, ticks

        result, streamed, during, ticks = asyncio.run(main())
        assert len(result) == 4 and len(streamed) == 4
        assert during > 0, "the event loop was blocked while asample ran"
        assert ticks > 10, "the event loop was blocked while sampling"

    def test_abort_keeps_an_exact_prefix(self, sampler: Sampler) -> None:
        handle, long_, params = self.abort_mid_flight(sampler, _greedy(logprobs=0), min_tokens=1)
        out = handle.result()
        seq = out[1].sequences[0]
        full = sampler.sample(long_, params)[0].sequences[0]
        assert seq.stop_reason == "abort" and 0 < len(seq.tokens) < LONG
        assert seq.tokens == full.tokens[: len(seq.tokens)]
        assert seq.logprobs is not None and full.logprobs is not None
        assert seq.logprobs == pytest.approx(full.logprobs[: len(seq.tokens)], abs=self.async_logprob_atol)
        assert seq.weights_version == sampler.weights_version
        assert out[0].sequences[0].stop_reason == "stop"  # finished sequences are untouched
        handle.abort()  # twice, and on a finished call: harmless
        assert handle.result() == out

    def test_abort_all(self, sampler: Sampler) -> None:
        handle, _, _, _ = self.run_until_short_finishes(sampler, _greedy(), lambda h: sampler.abort_all())
        assert handle.result()[1].sequences[0].stop_reason == "abort"
        assert sampler.abort_all() == 0

    def test_resume_continues_an_aborted_sequence(self, sampler: Sampler) -> None:
        params = SamplingParams(temperature=1.0, max_tokens=LONG, ignore_eos=True, seed=17, logprobs=0)
        handle, long_, params = self.abort_mid_flight(sampler, params, min_tokens=3)
        partial = handle.result()[1].sequences[0]
        assert partial.stop_reason == "abort" and len(partial.tokens) >= 3
        resumed = handle.resume().result(timeout=300)[1].sequences[0]
        assert resumed.tokens[: len(partial.tokens)] == partial.tokens
        assert len(resumed.tokens) > len(partial.tokens) and resumed.stop_reason != "abort"
        assert resumed.training_feature is not None
        assert resumed.training_feature.input_ids == list(long_.input_ids) + resumed.tokens
        assert resumed.logprobs is not None and len(resumed.logprobs) == len(resumed.tokens)
        if self.exact_seeded_resume:
            whole = sampler.sample(long_, params)[0].sequences[0]
            assert resumed.tokens == whole.tokens and resumed.stop_reason == whole.stop_reason
            assert resumed.logprobs == pytest.approx(whole.logprobs, abs=self.async_logprob_atol)

    @pytest.mark.parametrize("policy", ["wait", "abort", "keep"])
    def test_update_with_calls_in_flight(
        self, sampler: Sampler, policy: str, weights_a: Mapping[str, Any], weights_b: Mapping[str, Any]
    ) -> None:
        sampler.update_weights(dict(weights_a))
        old = sampler.weights_version
        updated = threading.Event()

        def change(handle: SampleHandle) -> None:
            sampler.update_weights(dict(weights_b), in_flight=policy)
            updated.set()

        handle, _short, long_, params = self.run_until_short_finishes(sampler, _greedy(logprobs=0), change)
        assert updated.is_set()
        new = sampler.weights_version
        assert new == old + 1
        seq = handle.result()[1].sequences[0]
        if policy == "wait":
            assert seq.weights_version == old and seq.version_spans is None and len(seq.tokens) == LONG
        elif policy == "abort":
            assert seq.stop_reason == "abort" and seq.weights_version == old and len(seq.tokens) < LONG
        else:
            # The stop token was chosen so it never ends the long prompt under the old weights;
            # nothing says the new weights avoid it, so what follows the switch (its tokens, its
            # length and its stop reason) is whatever the new weights give from that prefix.
            assert seq.version_spans is not None and seq.version_spans[0] == (0, old)
            switch, version = seq.version_spans[1]
            assert version == new and 0 < switch < len(seq.tokens) and seq.weights_version == old
            assert seq.token_versions() == [old] * switch + [new] * (len(seq.tokens) - switch)
            # tokens before the switch are the old weights' greedy ones; after it, the new weights'
            sampler.update_weights(dict(weights_a))
            with_a = sampler.sample(long_, params)[0].sequences[0].tokens
            assert seq.tokens[:switch] == with_a[:switch]
            sampler.update_weights(dict(weights_b))
            rest = sampler.sample(
                InputFeature(input_ids=[*long_.input_ids, *seq.tokens[:switch]]),
                params.replace(max_tokens=LONG - switch),
            )[0].sequences[0]
            assert rest.tokens != with_a[switch:], (
                "weights_b continues the long prompt as weights_a does: the fixtures cannot show a switch"
            )
            assert seq.tokens[switch:] == rest.tokens and seq.stop_reason == rest.stop_reason
