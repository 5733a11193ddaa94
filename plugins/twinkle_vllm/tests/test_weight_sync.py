"""Weight sync into a running vLLM engine: correctness, validation, versions, timeouts."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.errors import WeightSyncTimeoutError, WeightUpdateError
from twinkle_vllm import IPC_TIMEOUT_ENV

from .conftest import hf_greedy, make_sampler, perturbed_state

TIMEOUT_S = 3.0
PROMPTS = [
    Trajectory(messages=[{"role": "user", "content": "What is the capital of France?"}]),
    Trajectory(messages=[{"role": "user", "content": "Count to five."}]),
    Trajectory(messages=[{"role": "user", "content": "Tell me a short story about a cat and a dog."}]),
    Trajectory(messages=[{"role": "user", "content": "Hello! What is two plus two?"}]),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def store() -> Any:
    """The module engine's replay store (given to it, so tests read what it keeps)."""
    from twinkle_vllm import ReplayStore

    return ReplayStore()


@pytest.fixture(scope="module")
def sampler(tiny_model: Path, store: Any) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(IPC_TIMEOUT_ENV, str(TIMEOUT_S))
        # Small buckets: the embedding (768 x 128 float32) is split into chunks.
        options = {"replay_store": store, "sync_bucket_bytes": 96 << 10}
        s = make_sampler(tiny_model, options, enable_lora=True, max_lora_rank=8)
    with s:
        yield s


@pytest.fixture(scope="module")
def original(tiny_model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(tiny_model / "model.safetensors"))


def greedy(sampler: Any) -> list[list[int]]:
    return [r.sequences[0].tokens for r in sampler.sample(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def first_token(sampler: Any) -> int:
    """The first greedy token of the first prompt under the original weights."""
    return greedy(sampler)[0][0]


def perturbed(state: dict[str, torch.Tensor], seed: int, token: int) -> dict[str, torch.Tensor]:
    """Noisy weights in which ``token`` and its neighbour id trade places in ``lm_head``."""
    return perturbed_state(state, seed, swap=(token, token + 1))


@pytest.fixture
def restore(sampler: Any, original: dict[str, torch.Tensor]) -> Iterator[Any]:
    yield sampler
    sampler.update_weights(original)


def test_synced_weights_drive_the_outputs(
    restore: Any, tiny_model: Path, original: dict[str, torch.Tensor], first_token: int
) -> None:
    sampler = restore
    before = greedy(sampler)
    new = perturbed(original, seed=1, token=first_token)
    version = sampler.update_weights(new)
    assert version == sampler.weights_version
    after = greedy(sampler)
    assert after != before, "perturbed weights must change greedy outputs"
    prompts = [sampler.template.encode(p).input_ids for p in PROMPTS]
    assert after == hf_greedy(tiny_model, prompts, 16, state_dict=new)
    assert sampler.last_sync_stats["buckets"] > 3
    sampler.update_weights(original)
    assert greedy(sampler) == before


def test_sequences_carry_their_version(restore: Any, original: dict[str, torch.Tensor]) -> None:
    sampler = restore
    v = sampler.update_weights(original)
    assert sampler.sample(PROMPTS[0], GREEDY)[0].sequences[0].weights_version == v
    assert sampler.update_weights(list(original.items()), version=v + 10) == v + 10
    assert sampler.sample(PROMPTS[0], GREEDY)[0].sequences[0].weights_version == v + 10
    with pytest.raises(WeightUpdateError, match="version"):
        sampler.update_weights(original, version=v)


def test_bad_updates_change_nothing(sampler: Any, original: dict[str, torch.Tensor]) -> None:
    before, version = greedy(sampler), sampler.weights_version
    name = "model.layers.0.self_attn.q_proj.weight"
    cases: list[tuple[dict[str, Any] | list[tuple[str, Any]], str]] = [
        ({**original, "model.layers.0.self_attn.q_prj.weight": original[name]}, "q_proj"),
        ({**original, name: original[name][:, :-1]}, "shape"),
        ({**original, name: original[name].to(torch.bfloat16)}, "dtype"),
        ({**original, name: original[name].numpy()}, "torch.Tensor"),
        ([*original.items(), (name, original[name])], "twice"),
        ({name: original[name] * 2}, "k_proj"),  # half of a fused qkv layer
    ]
    for update, match in cases:
        with pytest.raises(WeightUpdateError, match=match):
            sampler.update_weights(update)
    assert sampler.weights_version == version
    assert greedy(sampler) == before


def test_update_of_some_layers(restore: Any, tiny_model: Path, original: dict[str, torch.Tensor]) -> None:
    sampler = restore
    mlp = {k: v for k, v in perturbed_state(original, seed=2, scale=0.5).items() if k.startswith("model.layers.1.mlp.")}
    assert len(mlp) == 3
    sampler.update_weights(mlp)
    prompts = [sampler.template.encode(p).input_ids for p in PROMPTS]
    assert greedy(sampler) == hf_greedy(tiny_model, prompts, 16, state_dict={**original, **mlp})


def test_stalled_worker_times_out_and_the_next_sync_works(
    restore: Any, original: dict[str, torch.Tensor], first_token: int
) -> None:
    sampler = restore
    before = greedy(sampler)
    version = sampler.weights_version
    sampler.engine._debug_stall_next_sync(60)
    started = time.monotonic()
    with pytest.raises(WeightSyncTimeoutError) as info:
        sampler.update_weights(perturbed(original, seed=3, token=first_token))
    elapsed = time.monotonic() - started
    assert info.value.stage.startswith("bucket 1/")
    assert isinstance(info.value, TimeoutError) and IPC_TIMEOUT_ENV in str(info.value)
    # It waited the timeout and no less; that it raised at all shows it did not wait out the 60 s
    # stall (the stalled worker would have answered then). No upper bound: a loaded machine is slow.
    assert elapsed >= TIMEOUT_S
    assert sampler.weights_version == version
    # the channel was reset: the next sync goes through and the engine serves it
    new = perturbed(original, seed=4, token=first_token)
    sampler.update_weights(new)
    assert sampler.weights_version > version
    changed = greedy(sampler)
    assert changed != before
    sampler.update_weights(original)
    assert greedy(sampler) == before


def test_replay_copies_taken_while_the_workers_apply(
    restore: Any, store: Any, original: dict[str, torch.Tensor]
) -> None:
    sampler = restore
    assert store.overlap is False  # decided by the engine at start: CPU workers copy after the push
    store.overlap = True  # the GPU path: copies for replay taken bucket by bucket during the push
    try:
        new = perturbed_state(original, seed=7, scale=0.5)
        sampler.update_weights(new)
        assert sampler.last_sync_stats["driver_side_work"] > 0
        for name, tensor in new.items():
            kept = store.tensors[name]
            assert kept.data_ptr() != tensor.data_ptr() and torch.equal(kept, tensor), name
    finally:
        store.overlap = False


def test_a_sync_that_fails_part_way_is_undone(
    restore: Any, original: dict[str, torch.Tensor], first_token: int
) -> None:
    sampler = restore
    before, version = greedy(sampler), sampler.weights_version
    new = perturbed(original, seed=5, token=first_token)
    sampler.update_weights(new)
    assert greedy(sampler) != before
    # A trainer's tensors, which its optimizer changes in place after the push: the undo below must
    # put back the values pushed, not what the tensors hold later (the copies kept for replay are
    # written over the previous ones, so this also checks that reuse).
    trainer = {k: v.clone() for k, v in original.items()}
    sampler.update_weights(trainer)
    for tensor in trainer.values():
        tensor.mul_(-3.0)
    # Every bucket but the last is answered, so applied; then the workers stall and the driver gives up.
    sampler.engine._debug_stall_next_sync(60, at_bucket=-1)
    with pytest.raises(WeightSyncTimeoutError) as info:
        sampler.update_weights(new)
    index, count = map(int, info.value.stage.removeprefix("bucket ").split("/"))
    assert index == count > 3, info.value.stage
    assert sampler.weights_version == version + 2
    # The layers it had applied were put back: the engine runs the version it names.
    assert greedy(sampler) == before


def test_lora_adapters_survive_a_base_sync(
    restore: Any, adapters: dict[str, Path], original: dict[str, torch.Tensor]
) -> None:
    sampler = restore
    sampler.add_adapter_to_model("a", adapters["a"])
    try:
        with_a = [r.sequences[0].tokens for r in sampler.sample(PROMPTS, GREEDY, adapter_name="a")]
        sampler.update_weights(original)  # same weights: the adapter's outputs must not move
        again = [r.sequences[0].tokens for r in sampler.sample(PROMPTS, GREEDY, adapter_name="a")]
        assert again == with_a
    finally:
        sampler.remove_adapter("a")


def test_samples_in_flight_never_mix_versions(
    restore: Any, original: dict[str, torch.Tensor], first_token: int
) -> None:
    """Concurrent samples and syncs: each sequence matches the weights of the version it carries."""
    sampler = restore
    new = perturbed(original, seed=5, token=first_token)
    outputs = {"original": greedy(sampler)}
    kind_of = {sampler.weights_version: "original"}
    kind_of[sampler.update_weights(new)] = "new"
    outputs["new"] = greedy(sampler)
    kind_of[sampler.update_weights(original)] = "original"
    seen: list[tuple[int, list[list[int]]]] = []
    errors: list[BaseException] = []
    progress = threading.Condition()  # notified whenever a sample call ends
    stop = threading.Event()

    def sample_loop() -> None:
        try:
            while not stop.is_set():
                out = sampler.sample(PROMPTS, GREEDY)
                versions = {r.sequences[0].weights_version for r in out}
                assert len(versions) == 1, "one call, one version"
                with progress:
                    seen.append((versions.pop(), [r.sequences[0].tokens for r in out]))
                    progress.notify_all()
        except BaseException as exc:  # pragma: no cover - reported below
            with progress:
                errors.append(exc)
                progress.notify_all()

    threads = [threading.Thread(target=sample_loop) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for i in range(4):
            kind = "new" if i % 2 == 0 else "original"
            version = sampler.update_weights(new if kind == "new" else original)
            kind_of[version] = kind
            # Updates go before waiting samples, so back-to-back updates could starve them: wait
            # until a sample has run under this version (the deadline only stops a hang).
            with progress:
                ran = progress.wait_for(
                    lambda version=version: errors or any(v == version for v, _ in seen), timeout=300
                )
            assert ran and not errors, errors or f"no sample ran under version {version}"
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    assert len({kind_of[v] for v, _ in seen}) == 2, "samples ran under both weights"
    for version, got in seen:
        assert got == outputs[kind_of[version]], f"a sample stamped version {version} was not produced by it"
