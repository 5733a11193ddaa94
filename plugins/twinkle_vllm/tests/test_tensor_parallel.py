"""Tensor parallel (TP=2) on vLLM's CPU build, against a TP=1 engine on the same model.

The two engines reduce the same sums in a different order, so a float32 tie
between two tokens may break differently: the comparison
(:func:`twinkle_core.testing.parity.assert_greedy_parity`) accepts a
divergence only where both engines' top log-probs are equal within ``ATOL``
(a true near-tie), and compares everything up to it. A wrong shard, a missing
all-reduce or an update that reaches one worker only moves the log-probs far
more than that.

On a CPU the engine binds each worker's threads to its own core; the user
does not set ``VLLM_CPU_OMP_THREADS_BIND`` (vLLM's default binding needs a
NUMA node per worker, which this machine does not have).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.errors import EngineDeadError
from twinkle_core.mesh import DeviceMesh
from twinkle_core.testing import TINY_CHAT_PROMPTS
from twinkle_core.testing.parity import assert_greedy_parity

from .conftest import TEST_ENGINE_ARGS, perturbed_state

ATOL = 1e-4
PROMPTS = [Trajectory(messages=m) for m in TINY_CHAT_PROMPTS[:6]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}

if len(os.sched_getaffinity(0)) < 2:  # pragma: no cover - every CI machine has 2 cores
    pytest.skip("tensor parallel needs a core per worker", allow_module_level=True)


def _make(model: Path, tp: int) -> Any:
    from twinkle_vllm.sampler import vLLMSampler

    return vLLMSampler(model, DeviceMesh.from_sizes(tp_size=tp), engine_args={**TEST_ENGINE_ARGS, **LORA})


#: Engine processes of the TP=1 engine, which outlives the TP=2 one's close.
TP1_PIDS: set[int] = set()


def engine_processes() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "Worker" in p.name() or "EngineCore" in p.name()]


@pytest.fixture(scope="module")
def tp1(tiny_model: Path) -> Iterator[Any]:
    before = {p.pid for p in engine_processes()}
    with _make(tiny_model, 1) as s:
        TP1_PIDS.update(p.pid for p in engine_processes() if p.pid not in before)
        yield s


@pytest.fixture(scope="module")
def tp2(tiny_model: Path) -> Iterator[Any]:
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ
    s = _make(tiny_model, 2)
    yield s
    s.close()


@pytest.fixture(scope="module")
def original(tiny_model: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(tiny_model / "model.safetensors"))


def run(sampler: Any, adapter: str = "") -> list[Any]:
    return [r.sequences[0] for r in sampler.sample(PROMPTS, GREEDY, adapter_name=adapter)]


def assert_parity(got: list[Any], want: list[Any]) -> None:
    assert all(len(s.tokens) == GREEDY.max_tokens for s in got)
    assert_greedy_parity(got, want, atol=ATOL)


def tokens(out: list[Any]) -> list[list[int]]:
    return [s.tokens for s in out]


def test_two_workers_start_without_a_user_binding(tp2: Any) -> None:
    assert len(tp2.engine._process.workers) == 2
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ  # set only while the engine was spawned


def test_greedy_parity_with_tp1(tp1: Any, tp2: Any) -> None:
    assert_parity(run(tp2), run(tp1))


@pytest.mark.parametrize("kind", ["full", "partial"])
def test_update_weights_reaches_every_shard(tp1: Any, tp2: Any, original: dict[str, Any], kind: str) -> None:
    before = run(tp2)
    first = before[0].tokens[0]
    new = perturbed_state(original, seed=7, swap=(first, first + 1))
    if kind == "partial":  # a row-parallel and a merged column-parallel weight (both halves), and the head
        kept = ("o_proj.weight", "gate_proj.weight", "up_proj.weight", "lm_head.weight")
        new = {k: v for k, v in new.items() if k.endswith(kept)}
    try:
        for s in (tp1, tp2):
            s.update_weights(new)
        after = run(tp2)
        assert tokens(after) != tokens(before), "the update must change outputs"
        assert {s.weights_version for s in after} == {tp2.weights_version}
        assert_parity(after, run(tp1))
    finally:
        for s in (tp1, tp2):
            s.update_weights(original)
    assert tokens(run(tp2)) == tokens(before)


@pytest.mark.parametrize("merge", [False, True])
def test_lora_adapter(tp1: Any, tp2: Any, adapters: dict[str, Path], merge: bool) -> None:
    base = run(tp2)
    for s in (tp1, tp2):
        s.add_adapter_to_model("a", adapters["a"], merge=merge)
    try:
        with_a = run(tp2, "a")
        assert tokens(with_a) != tokens(base)
        assert {s.adapter_name for s in with_a} == {"a"}
        assert_parity(with_a, run(tp1, "a"))
    finally:
        for s in (tp1, tp2):
            s.remove_adapter("a")
    assert tokens(run(tp2)) == tokens(base)


def test_abort_keeps_an_exact_prefix(tp2: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, logprobs=0)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    handle = tp2.submit(PROMPTS[1], params)
    tp2.sample(PROMPTS[0], short)  # the long call is decoding by the time this returns
    handle.abort()
    seq = handle.result(timeout=300)[0].sequences[0]
    assert seq.stop_reason == "abort" and 0 < len(seq.tokens) < 400
    full = tp2.sample(PROMPTS[1], params)[0].sequences[0]
    assert seq.tokens == full.tokens[: len(seq.tokens)]


def test_restart_after_the_engine_dies(tp2: Any, original: dict[str, Any]) -> None:
    first = run(tp2)[0].tokens[0]
    tp2.update_weights(perturbed_state(original, seed=3, swap=(first, first + 1)))
    expected = tokens(run(tp2))
    workers = [p for p in engine_processes() if "Worker" in p.name() and p.pid not in TP1_PIDS]
    assert len(workers) == 2
    workers[1].send_signal(signal.SIGKILL)  # one shard dies
    with pytest.raises(EngineDeadError):
        for _ in range(3):  # the death may be noticed by the first call or the next
            run(tp2)
    out = run(tp2)
    assert tokens(out) == expected  # restarted with the pushed weights replayed
    tp2.update_weights(original)


def test_close_leaves_no_process(tp1: Any, tp2: Any) -> None:
    mine = [p for p in engine_processes() if p.pid not in TP1_PIDS]
    assert len([p for p in mine if "Worker" in p.name()]) == 2
    tp2.close()
    _, alive = psutil.wait_procs(mine, timeout=60)
    assert not alive, [p.name() for p in alive]
