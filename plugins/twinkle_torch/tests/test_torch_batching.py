"""Continuous batching: concurrent calls share one decode loop, and each still gets its solo result.

What batching did is read from the decoder's counters (``TorchEngine._decoder.stats``):
decode forwards, the most rows one forward carried, rows that joined a running batch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from twinkle_core import SamplingParams, Trajectory
from twinkle_core.data_format import InputFeature
from twinkle_core.testing.async_contract import AsyncContractTests
from twinkle_torch.decoding import DecoderStats
from twinkle_torch.sampler import TorchSampler


@pytest.fixture(scope="module")
def sampler(tiny_llama: Path) -> Iterator[TorchSampler]:
    with TorchSampler(tiny_llama, device="cpu") as s:
        yield s


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def fresh_stats(sampler: TorchSampler) -> DecoderStats:
    """Start the counters from zero (the loop reads ``stats`` at each step)."""
    stats = DecoderStats()
    sampler.engine._decoder.stats = stats
    return stats


def run_threads(calls: list[Any]) -> list[Any]:
    """Run each call in its own thread, released together; their results (errors re-raised)."""
    barrier = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            barrier.wait()
            out[i] = calls[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize(
    "params",
    [
        greedy(40, logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, seed=11, repetition_penalty=1.2, logprobs=0),
    ],
    ids=["greedy", "seeded"],
)
def test_concurrent_calls_are_batched_together_and_equal_their_solo_results(
    sampler: TorchSampler, chat_prompts: list[Trajectory], params: SamplingParams
) -> None:
    prompts = chat_prompts[:6]
    stats = fresh_stats(sampler)
    solo = [sampler.sample(p, params, num_samples=2)[0] for p in prompts]
    solo_steps = stats.steps
    assert stats.peak_rows == 2  # alone, a call's batch holds its own rows only
    stats = fresh_stats(sampler)
    together = run_threads([lambda p=p: sampler.sample(p, params, num_samples=2)[0] for p in prompts])
    for got, want in zip(together, solo):
        assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
        for g, w in zip(got.sequences, want.sequences):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    # the calls shared decode forwards: some forward carried rows of several calls
    assert stats.peak_rows > 2
    assert stats.steps < solo_steps


def test_a_call_submitted_while_another_decodes_joins_it(sampler: TorchSampler, chat_prompts: list[Trajectory]) -> None:
    params = greedy(400)
    # a short prompt and a long one, and a token that ends the short one early (never the long one)
    short, long_, stop = AsyncContractTests().prompts(sampler, params)
    params = params.replace(stop_token_ids=[stop])
    late = sampler.template.encode(chat_prompts[3])
    late_solo = sampler.sample(late, greedy(8))[0].sequences[0].tokens
    stats = fresh_stats(sampler)
    handle = sampler.submit([short, long_], params)
    seen: dict[str, Any] = {}
    for item in handle.as_completed(timeout=300):
        if item.input_index == 0:  # the short one is back: the long one is mid-flight
            seen["late"] = sampler.sample(late, greedy(8))[0].sequences[0].tokens
            seen["first_done"] = handle.done()
            seen["joined"] = stats.joined_rows
    assert seen["late"] == late_solo
    assert seen["joined"] == 1  # the late call's row joined the running batch
    assert seen["first_done"] is False  # and finished while the first call's long row was still going
    assert len(handle.result()[1].sequences[0].tokens) == 400


def test_the_token_budget_bounds_the_running_batch(sampler: TorchSampler, chat_prompts: list[Trajectory]) -> None:
    params = greedy(24)
    feats = [sampler.template.encode(t) for t in chat_prompts[:4]]
    solo = [sampler.sample(f, params, num_samples=3)[0] for f in feats]
    longest = max(len(f.input_ids) for f in feats) + params.max_tokens
    budget = sampler.max_batch_tokens
    stats = fresh_stats(sampler)
    try:
        sampler.max_batch_tokens = 2 * longest  # two rows at a time, whatever arrives
        together = run_threads([lambda f=f: sampler.sample(f, params, num_samples=3)[0] for f in feats])
    finally:
        sampler.max_batch_tokens = budget
    assert [[s.tokens for s in r.sequences] for r in together] == [[s.tokens for s in r.sequences] for r in solo]
    assert stats.peak_rows == 2


def test_rows_of_different_lengths_and_budgets_join_and_leave(
    sampler: TorchSampler, chat_prompts: list[Trajectory]
) -> None:
    # prompts of very different lengths (the running cache is padded on the left for the new rows, or
    # the other way round) and budgets (rows leave the batch at different steps)
    base = [sampler.template.encode(t) for t in chat_prompts[:3]]
    long_prompt = InputFeature(input_ids=[*base[0].input_ids, *base[1].input_ids, *base[2].input_ids])
    feats = [base[0], long_prompt, base[1], long_prompt, base[2]]
    budgets = [5, 60, 30, 9, 45]
    solo = [sampler.sample(f, greedy(b, logprobs=0))[0].sequences[0] for f, b in zip(feats, budgets)]
    stats = fresh_stats(sampler)
    together = run_threads(
        [lambda f=f, b=b: sampler.sample(f, greedy(b, logprobs=0))[0].sequences[0] for f, b in zip(feats, budgets)]
    )
    for got, want, b in zip(together, solo, budgets):
        assert got.tokens == want.tokens and len(got.tokens) == b
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert stats.peak_rows > 1


@pytest.mark.parametrize("kernel", ["native", "sdpa"])
def test_a_large_batch_prefilled_in_chunks_equals_its_solo_results(
    sampler: TorchSampler,
    tiny_llama: Path,
    chat_prompts: list[Trajectory],
    monkeypatch: pytest.MonkeyPatch,
    kernel: str,
) -> None:
    """Prompts of very different lengths, prefilled in several chunks. Decoded by the native kernel
    (the default: it skips each row's masked columns itself), or by SDPA in row blocks."""
    if kernel == "native":
        _large_batch_in_chunks(sampler, chat_prompts, monkeypatch, row_blocks=False)
    else:
        with TorchSampler(tiny_llama, device="cpu", attention_kernel="sdpa") as s:
            _large_batch_in_chunks(s, chat_prompts, monkeypatch, row_blocks=True)


def _large_batch_in_chunks(
    sampler: TorchSampler, chat_prompts: list[Trajectory], monkeypatch: pytest.MonkeyPatch, row_blocks: bool
) -> None:
    from twinkle_torch import admission, attention

    base = [sampler.template.encode(t) for t in chat_prompts[:4]]
    long_prompt = InputFeature(input_ids=[i for f in base for i in f.input_ids])
    feats = [base[0], long_prompt, base[1], base[2], long_prompt, base[3], base[0], base[1]]
    params = greedy(12, logprobs=1)
    solo = [sampler.sample(f, params, num_samples=5)[0] for f in feats]
    split: list[Any] = []
    real_split = attention._split
    monkeypatch.setattr(attention, "_split", lambda mask: split.append(real_split(mask)) or split[-1])
    monkeypatch.setattr(admission, "_PREFILL_CHUNK_TOKENS", 2 * len(long_prompt.input_ids))
    stats = fresh_stats(sampler)
    together = sampler.sample(feats, params, num_samples=5)  # 40 rows in one call
    assert stats.prefills > 2 and stats.peak_rows == 40
    assert any(blocks is not None for blocks in split) == row_blocks  # the decode steps attended in row blocks
    for got, want in zip(together, solo):
        assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
        for g, w in zip(got.sequences, want.sequences):
            assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
            assert [[t for t, _ in top] for top in g.top_logprobs or []] == [
                [t for t, _ in top] for top in w.top_logprobs or []
            ]
