"""The asynchronous API through Ray: a ``remote_group`` torch sampler with two replicas, on a real local cluster.

The shared ``AsyncContractTests`` run against it (submit, stream, abort,
resume, each ``in_flight`` policy), plus what only a remote sampler has:
shares streamed from several replicas, aborts and updates reaching every
replica while calls from several threads are in flight. Threads are ordered
by what is observed (a streamed sequence), never by sleeping.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytest.importorskip("twinkle_torch")

import twinkle_core as tw  # noqa: E402
from twinkle_core import DeviceGroup, DeviceMesh, InputFeature, SamplingParams, Trajectory  # noqa: E402
from twinkle_core.errors import InvalidInputError  # noqa: E402
from twinkle_core.remote.sampler import RemoteSampler  # noqa: E402
from twinkle_core.testing import TINY_CHAT_PROMPTS, build_tiny_model  # noqa: E402
from twinkle_core.testing.async_contract import AsyncContractTests  # noqa: E402
from twinkle_core.testing.policy import PolicyContractTests, checkpoint_weights  # noqa: E402


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model("llama")


@pytest.fixture(scope="module")
def remote(model_dir: Path) -> Iterator[RemoteSampler]:
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    tw.initialize("ray", groups=[DeviceGroup(name="pair", ranks=2, device_type="cpu")], num_cpus=2)
    try:
        with tw.create_sampler(
            "torch", model_id=str(model_dir), device_mesh=DeviceMesh.from_sizes(dp_size=2), remote_group="pair"
        ) as sampler:
            assert isinstance(sampler, RemoteSampler)
            yield sampler
    finally:
        tw.shutdown()


def _weights(model_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


class TestRemoteAsync(AsyncContractTests):
    @pytest.fixture
    def sampler(self, remote: RemoteSampler) -> RemoteSampler:
        return remote

    @pytest.fixture(scope="class")
    @classmethod
    def weights_a(cls, model_dir: Path) -> dict[str, Any]:
        return _weights(model_dir)

    @pytest.fixture(scope="class")
    @classmethod
    def weights_b(cls, weights_a: dict[str, Any]) -> dict[str, Any]:
        key = "lm_head.weight" if "lm_head.weight" in weights_a else "model.embed_tokens.weight"
        return {**weights_a, key: torch.roll(weights_a[key], 1, dims=0)}


class TestRemotePolicy(PolicyContractTests):
    """Updates and adapters reach every replica: each call's prompts are shared between the two."""

    adapter_options = ({"merge": True},)

    @pytest.fixture
    def sampler(self, remote: RemoteSampler) -> RemoteSampler:
        return remote

    @pytest.fixture(scope="class")
    @classmethod
    def base_weights(cls, model_dir: Path) -> dict[str, Any]:
        return checkpoint_weights(model_dir)


def _features(sampler: RemoteSampler, n: int) -> list[InputFeature]:
    return [sampler.template.encode(Trajectory(messages=m)) for m in TINY_CHAT_PROMPTS[:n]]


def test_every_replica_streams_its_share_before_the_call_ends(remote: RemoteSampler) -> None:
    feats = _features(remote, 4)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    full = remote.sample(feats, long, num_samples=2)
    greedy = [r.sequences[0].tokens for r in full]
    # a stop token that ends one input early and none of the others: when it streams back,
    # every other share is still running, so the abort sent then lands mid-flight
    found = [
        (a, t)
        for a, mine in enumerate(greedy)
        for t in mine[2:100]
        if all(t not in g for b, g in enumerate(greedy) if b != a)
    ]
    if not found:
        pytest.skip("no token ends one greedy continuation early without appearing in the others")
    short, stop = found[0]
    handle = remote.submit(feats, long.replace(stop_token_ids=[stop]), num_samples=2)
    seen = []
    for item in handle.as_completed(timeout=300):
        seen.append((item.input_index, item.sample_index))
        if len(seen) == 1:
            assert item.input_index == short and item.sequence.stop_reason == "stop"
            handle.abort()
    out = handle.result()
    assert sorted(seen) == [(i, s) for i in range(4) for s in range(2)]
    aborted = [s for i, r in enumerate(out) if i != short for s in r.sequences if s.stop_reason == "abort"]
    assert aborted, "the abort did not stop any share"
    # what the replicas stopped is a prefix of the uninterrupted greedy run, whichever replica ran it
    for r, f in zip(out, full):
        for s, g in zip(r.sequences, f.sequences):
            assert s.tokens == g.tokens[: len(s.tokens)]


def _submit_from_threads(remote: RemoteSampler, feats: list[InputFeature], lengths: list[int]) -> list[Any]:
    """One call per thread (two prompts each, ``lengths[t]`` tokens), submitted concurrently."""
    handles: list[Any] = [None] * len(lengths)

    def submit(t: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=lengths[t], ignore_eos=True, logprobs=0)
        handles[t] = remote.submit(feats[2 * t : 2 * t + 2], params)

    threads = [threading.Thread(target=submit, args=(t,)) for t in range(len(lengths))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return handles


def _first_streamed(handles: list[Any]) -> threading.Event:
    """Set when any of ``handles`` streams its first sequence: the others are still in flight then."""
    event = threading.Event()

    def watch(handle: Any) -> None:
        for _ in handle.as_completed(timeout=300):
            event.set()

    for handle in handles:
        threading.Thread(target=watch, args=(handle,), daemon=True).start()
    return event


# A short call and two long ones: whether the replicas batch them or run them one after another,
# when the first sequence comes back at least one long call has work left.
LENGTHS = [8, 300, 300]


def test_abort_all_stops_the_calls_of_every_thread_on_every_replica(remote: RemoteSampler) -> None:
    feats = _features(remote, 6)
    handles = _submit_from_threads(remote, feats, LENGTHS)
    assert _first_streamed(handles).wait(300)
    assert remote.abort_all() >= 1
    aborted = 0
    for t, handle in enumerate(handles):
        out = handle.result(timeout=300)
        params = SamplingParams(temperature=0.0, max_tokens=LENGTHS[t], ignore_eos=True, logprobs=0)
        full = remote.sample(feats[2 * t : 2 * t + 2], params)
        for r, f in zip(out, full):
            (seq,) = r.sequences
            assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
            if seq.stop_reason == "abort":
                aborted += 1
                assert seq.tokens == f.sequences[0].tokens[: len(seq.tokens)]
            else:
                assert seq.tokens == f.sequences[0].tokens
    assert aborted >= 1, "abort_all stopped nothing"
    assert remote.abort_all() == 0


def test_keep_update_while_threads_stream_switches_every_replica(remote: RemoteSampler, model_dir: Path) -> None:
    weights = _weights(model_dir)
    key = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    changed = {**weights, key: torch.roll(weights[key], 1, dims=0)}
    remote.update_weights(weights)
    old = remote.weights_version
    feats = _features(remote, 6)
    handles = _submit_from_threads(remote, feats, LENGTHS)
    assert _first_streamed(handles).wait(300)
    new = remote.update_weights(changed, in_flight="keep")
    seqs = [(t, r.prompt_token_ids, r.sequences[0]) for t, h in enumerate(handles) for r in h.result(timeout=300)]
    for t, _prompt, seq in seqs:
        assert len(seq.tokens) == LENGTHS[t] and seq.stop_reason == "length"  # nothing lost
        versions = seq.token_versions()
        assert set(versions) <= {old, new} and versions == sorted(versions)
        assert seq.weights_version == min(versions)
    assert any(new in seq.token_versions() for _, _, seq in seqs), "no call was in flight at the update"
    # each token is the greedy choice of the version recorded for it: check against plain updates
    for weights_now, version in ((weights, old), (changed, new)):
        remote.update_weights(weights_now)
        for _t, prompt, seq in seqs:
            versions = seq.token_versions()
            if version not in versions:
                continue
            start = versions.index(version)
            length = versions.count(version)
            fresh = remote.sample(
                InputFeature(input_ids=[*prompt, *seq.tokens[:start]]),
                SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True),
            )
            assert seq.tokens[start : start + length] == fresh[0].sequences[0].tokens
    remote.update_weights(weights)


def test_a_bad_policy_is_refused_before_anything_changes(remote: RemoteSampler, model_dir: Path) -> None:
    version = remote.weights_version
    with pytest.raises(InvalidInputError, match=r"in_flight='later'.*'wait', 'abort', 'keep'"):
        remote.update_weights(_weights(model_dir), in_flight="later")
    assert remote.weights_version == version
