"""Idle OpenMP workers (`twinkle_torch.openmp`): a thread that waits for the decode loop gives its pool back.

A thread's OpenMP workers are started by that thread and inherit its kernel
name, so a thread with a name of its own counts its workers in
``/proc/self/task``: no other thread of the test process shares it (the
decode loop names its thread ``twinkle-decode``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from twinkle_core import SamplingParams, Trajectory
from twinkle_torch import openmp
from twinkle_torch.sampler import TorchSampler

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc (Linux)"),
    pytest.mark.skipif("OpenMP" not in torch.__config__.parallel_info(), reason="this PyTorch does not run on OpenMP"),
    pytest.mark.skipif(torch.get_num_threads() < 2, reason="one intra-op thread: OpenMP starts no workers"),
]

_PR_SET_NAME = 15


def _named(name: str) -> int:
    """Threads of this process whose kernel name is ``name``."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as comm:
                count += comm.read().strip() == name
        except OSError:  # the thread ended meanwhile
            pass
    return count


def _parallel_work() -> None:
    torch.ones(1 << 22).mul_(2.0)  # far over PyTorch's grain: the op runs on an OpenMP team


def _in_named_thread(name: str, body: Callable[[], Any]) -> Any:
    """Run ``body`` in a new thread named ``name`` (its kernel name, which its OpenMP workers inherit)."""
    out: dict[str, Any] = {}

    def run() -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.prctl(_PR_SET_NAME, name.encode(), 0, 0, 0)
        try:
            out["value"] = body()
        except BaseException as exc:  # re-raised in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_releasing_ends_the_calling_threads_idle_workers_and_no_one_elses() -> None:
    workers = torch.get_num_threads() - 1
    other_ready, other_done = threading.Event(), threading.Event()

    def other() -> None:  # holds a pool of its own while the probe releases
        _parallel_work()
        other_ready.set()
        other_done.wait(60)

    other_thread = threading.Thread(target=lambda: _in_named_thread("twk-omp-other", other))
    other_thread.start()
    assert other_ready.wait(60)
    try:

        def probe() -> tuple[int, int, int, int, int]:
            _parallel_work()
            before = _named("twk-omp-probe")
            released = openmp.release_idle_workers()
            openmp.release_idle_workers()  # no pool now: nothing to end, and no error
            after = _named("twk-omp-probe")
            _parallel_work()  # the thread runs parallel work again: a new pool
            again = _named("twk-omp-probe")
            return before, released, after, again, _named("twk-omp-other")

        before, released, after, again, other_count = _in_named_thread("twk-omp-probe", probe)
    finally:
        other_done.set()
        other_thread.join(60)
    assert released >= 1  # PyTorch's libgomp at least
    assert before == 1 + workers and after == 1, (before, after)
    assert again == 1 + workers
    assert other_count == 1 + workers  # the other thread's pool was left alone


@pytest.fixture(scope="module")
def sampler(tiny_llama: Path) -> Iterator[TorchSampler]:
    with TorchSampler(tiny_llama, device="cpu", dtype="float32") as s:
        yield s


def test_a_thread_that_waits_for_its_sample_leaves_no_idle_workers_behind(
    sampler: TorchSampler, chat_prompts: list[Trajectory]
) -> None:
    """The caller's pool would slow every parallel loop of the decode loop's thread (see twinkle_torch.openmp)."""
    workers = torch.get_num_threads() - 1
    params = SamplingParams(max_tokens=4, seed=3)
    reference = sampler.sample(chat_prompts[:2], params)

    def caller() -> tuple[int, int, Any]:
        _parallel_work()  # as a trainer's thread does before it samples: its pool exists
        before = _named("twk-omp-caller")
        out = sampler.sample(chat_prompts[:2], params)
        return before, _named("twk-omp-caller"), out

    before, after, out = _in_named_thread("twk-omp-caller", caller)
    assert before == 1 + workers
    assert after == 1  # the call gave the idle workers back
    assert [s.tokens for r in out for s in r.sequences] == [s.tokens for r in reference for s in r.sequences]


def test_building_the_engine_and_pushing_weights_leave_no_idle_workers_on_the_callers_thread(
    tiny_llama: Path, chat_prompts: list[Trajectory]
) -> None:
    """Calls handed to a thread of their own (asample, submit, the server) wait there: the pool that the
    thread which loaded the model or pushed weights made must not outlive that work."""
    workers = torch.get_num_threads() - 1
    params = SamplingParams(max_tokens=4, seed=5)

    def owner() -> tuple[list[int], Any, Any]:
        counts = []
        _parallel_work()
        counts.append(_named("twk-omp-owner"))
        built = TorchSampler(tiny_llama, device="cpu", dtype="float32")
        try:
            counts.append(_named("twk-omp-owner"))
            before = built.sample(chat_prompts[:2], params)
            weights = [(name, value.detach().clone()) for name, value in built.model.state_dict().items()]
            _parallel_work()
            counts.append(_named("twk-omp-owner"))
            built.update_weights(weights, version=1)
            counts.append(_named("twk-omp-owner"))
            return counts, before, built.sample(chat_prompts[:2], params)
        finally:
            built.close()

    counts, before, after = _in_named_thread("twk-omp-owner", owner)
    assert counts == [1 + workers, 1, 1 + workers, 1]
    assert [s.tokens for r in after for s in r.sequences] == [s.tokens for r in before for s in r.sequences]
