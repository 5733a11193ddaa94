"""Process-level faults on the vLLM engine: engine death and restart, a killed driver, long socket paths.

Every process killed here was started by these tests (the module's engine, or
a driver subprocess and its children).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.errors import EngineDeadError
from twinkle_vllm import IPC_TIMEOUT_ENV

from .conftest import (
    TEST_ENGINE_ARGS,
    engine_sockets,
    in_a_session_folder,
    is_vllm_socket,
    make_sampler,
    perturbed_state,
)

#: Small, so a stuck sync fails fast; large enough for a sync on a busy CI machine.
TIMEOUT_S = 20.0
PROMPTS = [
    Trajectory(messages=[{"role": "user", "content": "What is the capital of France?"}]),
    Trajectory(messages=[{"role": "user", "content": "Tell me a short story about a cat and a dog."}]),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
#: The no-replay engine's: its sync stalls on purpose, and waits this long to time out.
NO_REPLAY_TIMEOUT_S = 5.0
#: A call that keeps the engine busy long enough to be killed in the middle of it.
LONG = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True, num_samples=8)


def wait_for(
    condition: Callable[[], bool], what: str, deadline_s: float = 120.0, detail: Callable[[], object] | None = None
) -> None:
    """Poll ``condition`` until it holds; fail (not hang) if it never does, with ``detail()`` if given."""
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"gave up waiting for {what}" + (f": {detail()}" if detail else ""))
        time.sleep(0.05)


def alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (a zombie has exited; only its pid entry is left for a parent to reap)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def engine_processes(pid: int, kind: str = "Worker") -> list[psutil.Process]:
    """vLLM's processes of one ``kind`` (``"Worker"``, ``"EngineCore"``) under process ``pid``."""
    return [p for p in psutil.Process(pid).children(recursive=True) if kind in p.name()]


@pytest.fixture(scope="module")
def original(tiny_model: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(tiny_model / "model.safetensors"))


@pytest.fixture(scope="module")
def sampler(tiny_model: Path) -> Iterator[Any]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(IPC_TIMEOUT_ENV, str(TIMEOUT_S))
        s = make_sampler(tiny_model, enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=2)
    with s:
        yield s


def memory_adapter(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A PEFT folder as (config, tensors): an adapter given in memory."""
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    return config, load_file(str(folder / "adapter_model.safetensors"))


def greedy(sampler: Any, adapter: str = "") -> list[list[int]]:
    return [r.sequences[0].tokens for r in sampler.sample(PROMPTS, GREEDY, adapter_name=adapter)]


@pytest.fixture(scope="module")
def state(sampler: Any, original: dict[str, torch.Tensor], adapters: dict[str, Path]) -> dict[str, Any]:
    """The module sampler with updated weights and an adapter; its greedy outputs for both."""
    first = greedy(sampler)[0][0]
    new = perturbed_state(original, seed=7, swap=(first, first + 1))
    sampler.update_weights(new)
    sampler.add_adapter_to_model("a", adapters["a"])
    config, tensors = memory_adapter(adapters["b"])
    sampler.add_adapter_to_model("m", config, weights=tensors)
    expected = {name: greedy(sampler, name) for name in ("", "a", "m")}
    assert len({str(v) for v in expected.values()}) == 3  # each adapter shows in the outputs
    return {"weights": new, "expected": expected, "first": first}


@pytest.mark.parametrize("victim", ["Worker", "EngineCore"])
def test_killed_engine_process_during_sample_is_a_typed_error_and_the_engine_comes_back(
    sampler: Any, state: dict[str, Any], victim: str
) -> None:
    version, restarts = sampler.weights_version, sampler.restarts
    errors: list[BaseException] = []
    started = threading.Event()

    def call() -> None:
        started.set()
        try:
            sampler.sample(PROMPTS * 4, LONG)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    started.wait()
    # The requests are in the engine once it reports them unfinished.
    engine = sampler.engine._process.engine
    wait_for(lambda: engine.output_processor.get_num_unfinished_requests() > 0, "the requests to start")
    victims = engine_processes(os.getpid(), victim)
    assert victims
    for proc in victims:
        proc.send_signal(signal.SIGKILL)
    thread.join(TIMEOUT_S * 10)
    assert not thread.is_alive(), "sample() hung after its engine died"
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
    assert isinstance(errors[0], RuntimeError)
    assert "restarted" in str(errors[0]) and "call it again" in str(errors[0])
    assert sampler.restarts == restarts + 1
    assert not any(alive(p) for p in victims)
    # The restarted engine has the updated weights and the adapter back, under the same version.
    assert {name: greedy(sampler, name) for name in ("", "a", "m")} == state["expected"]
    assert [r.sequences[0].weights_version for r in sampler.sample(PROMPTS, GREEDY)] == [version] * len(PROMPTS)


def test_killed_worker_during_update_weights_changes_nothing(
    sampler: Any, state: dict[str, Any], original: dict[str, torch.Tensor]
) -> None:
    version = sampler.weights_version
    errors: list[BaseException] = []
    newer = perturbed_state(original, seed=11, swap=(state["first"] + 2, state["first"] + 3))
    # The workers stall before answering the first bucket: the update is surely in flight when killed.
    sampler.engine._debug_stall_next_sync(TIMEOUT_S * 4)

    def update() -> None:
        try:
            sampler.update_weights(newer)
        except BaseException as exc:
            errors.append(exc)

    from twinkle_vllm._files import driver_files, session_root

    root = session_root()
    thread = threading.Thread(target=update)
    thread.start()
    wait_for(
        lambda: any(p.startswith(root) and os.path.isdir(p) for p in driver_files(os.getpid())), "the sync session"
    )
    for proc in engine_processes(os.getpid()):
        proc.send_signal(signal.SIGKILL)
    thread.join(TIMEOUT_S * 10)
    assert not thread.is_alive(), "update_weights() hung after its engine died"
    assert len(errors) == 1 and isinstance(errors[0], EngineDeadError), errors
    assert "update_weights()" in str(errors[0]) and "restarted" in str(errors[0])
    # Not applied: same version, same outputs as before the call.
    assert sampler.weights_version == version
    assert {name: greedy(sampler, name) for name in ("", "a", "m")} == state["expected"]
    # And the engine takes the update when it is pushed again.
    sampler.update_weights(newer)
    assert greedy(sampler) != state["expected"][""]
    sampler.update_weights(state["weights"])
    assert greedy(sampler) == state["expected"][""]


def test_sync_works_under_a_long_tmpdir(
    sampler: Any, state: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    long_dir = tmp_path / ("d" * 60) / ("e" * 60)
    long_dir.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(long_dir))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile caches the folder it chose
    assert tempfile.gettempdir() == str(long_dir)
    sampler.update_weights(state["weights"])  # a raw ZMQError (file name too long) before the fix
    assert greedy(sampler) == state["expected"][""]


DRIVER = """
import json, os, sys, time

def main():
    import psutil
    from twinkle_vllm.sampler import vLLMSampler
    from safetensors.torch import load_file

    model, engine_args = sys.argv[1], json.loads(sys.argv[2])
    sampler = vLLMSampler(model, engine_args=engine_args)
    sampler.update_weights(load_file(os.path.join(model, "model.safetensors")))
    me = psutil.Process()
    procs = me.children(recursive=True)
    paths = set()
    for p in [me, *procs]:
        paths |= {c.laddr for c in p.net_connections(kind="unix") if isinstance(c.laddr, str) and c.laddr}
        paths |= {m.path for m in p.memory_maps() if m.path.startswith("/dev/shm/")}
    process = sampler.engine._process
    report = {"pids": [[p.pid, p.create_time()] for p in procs if p.pid != process.reaper.pid],
              "paths": sorted(paths), "reaper": process.reaper.pid, "files": process.engine_files}
    print("REPORT", json.dumps(report), flush=True)
    time.sleep(3600)

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("reaper", ["alive", "killed too"])
def test_killed_driver_leaves_no_process_and_no_file(tiny_model: Path, tmp_path: Path, reaper: str) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    driver = subprocess.Popen(
        [sys.executable, str(script), str(tiny_model), json.dumps(TEST_ENGINE_ARGS)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )
    try:
        assert driver.stdout is not None
        line = "-"
        while line and not line.startswith("REPORT "):  # vLLM logs on stdout too
            line = driver.stdout.readline()
        assert line, "the driver died before its engine started"
        report = json.loads(line.removeprefix("REPORT "))
        procs = [psutil.Process(pid) for pid, _ in report["pids"]]
        paths = report["paths"]
        assert any("EngineCore" in p.name() for p in procs) and any("Worker" in p.name() for p in procs)
        assert any(os.path.basename(p).startswith(f"twinkle-vllm-{driver.pid}-") for p in paths)  # the staging file
        assert any(os.path.basename(p).startswith("psm_") for p in paths)  # vLLM's own segments
        ours = f"/twinkle-vllm-{driver.pid}-"
        # vLLM's rendezvous file, which only a clean shutdown removes: the reaper's to remove.
        assert report["files"] and all(os.path.isfile(f) for f in report["files"])
        paths += report["files"]
        # vLLM's sockets too are in the driver's folders: a sweep finds them by the dead pid.
        assert all(ours in p for p in paths if is_vllm_socket(p)) and any(is_vllm_socket(p) for p in paths)
        if reaper == "killed too":
            # Then the engine's own watch on the driver must still stop it.
            watcher = psutil.Process(report["reaper"])
            watcher.kill()
            # Not psutil's wait(): the reaper is the driver's child, a zombie nobody reaps until the driver dies.
            wait_for(lambda: not alive(watcher), "the reaper to die")
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        wait_for(lambda: not any(alive(p) for p in procs), "the engine's processes to exit")
        if reaper == "killed too":
            # No reaper removed the files; the next sampler's sweep finds twinkle's by their dead pid.
            from twinkle_vllm._files import sweep_stale

            sweep_stale()
            paths = [p for p in paths if ours in p]
        left = lambda: [p for p in paths if os.path.exists(p)]  # noqa: E731
        wait_for(lambda: not left(), "the engine's files to be removed", detail=left)
        assert not [p for p in os.listdir("/dev/shm") if p.startswith(f"twinkle-vllm-{driver.pid}-")]
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        # Whatever is left after a failure: ours to stop.
        for pid, created in report["pids"] if "report" in locals() else []:
            try:
                p = psutil.Process(pid)
                if abs(p.create_time() - created) < 0.01:
                    p.kill()
            except psutil.Error:
                pass


def test_restart_options_are_checked(tiny_model: Path) -> None:
    from twinkle_core.errors import ConfigError
    from twinkle_vllm import ReplayStore
    from twinkle_vllm.sampler import vLLMSampler

    # Checked before any engine starts.
    with pytest.raises(ConfigError, match="auto_restart=1"):
        vLLMSampler(tiny_model, engine_args=TEST_ENGINE_ARGS, auto_restart=1)
    with pytest.raises(ConfigError, match="replay_weights='no'"):
        vLLMSampler(tiny_model, engine_args=TEST_ENGINE_ARGS, replay_weights="no")
    with pytest.raises(ConfigError, match="replay_store='mine' is invalid"):
        vLLMSampler(tiny_model, engine_args=TEST_ENGINE_ARGS, replay_store="mine")
    with pytest.raises(ConfigError, match="keeps weights=False but replay_weights=True"):
        vLLMSampler(tiny_model, engine_args=TEST_ENGINE_ARGS, replay_store=ReplayStore(keep_weights=False))
    with pytest.raises(ConfigError, match="overlap='yes'"):
        ReplayStore(overlap="yes")


@pytest.fixture(scope="module")
def no_replay(tiny_model: Path) -> Iterator[Any]:
    """An engine built with ``auto_restart=False, replay_weights=False``: the sampler keeps no weights copy."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(IPC_TIMEOUT_ENV, str(NO_REPLAY_TIMEOUT_S))
        options = {"auto_restart": False, "replay_weights": False, "sync_bucket_bytes": 96 << 10}
        s = make_sampler(tiny_model, options)
    with s:
        yield s


def test_a_partial_sync_that_cannot_be_undone_refuses_sampling(
    no_replay: Any, original: dict[str, torch.Tensor]
) -> None:
    from twinkle_core.errors import WeightSyncTimeoutError

    sampler = no_replay
    before = greedy(sampler)
    sampler.update_weights(original)  # the engine's values are now ones the sampler keeps no copy of
    sampler.engine._debug_stall_next_sync(60, at_bucket=-1)
    first = before[0][0]
    with pytest.raises(WeightSyncTimeoutError):
        sampler.update_weights(perturbed_state(original, seed=6, swap=(first, first + 1)))
    with pytest.raises(EngineDeadError, match="failed part-way") as info:
        sampler.sample(PROMPTS[0], GREEDY)
    assert "update_weights" in str(info.value)
    # A part of the tensors is not enough; all of them bring sampling back.
    sampler.update_weights({k: v for k, v in original.items() if k.startswith("model.layers.1.mlp.")})
    with pytest.raises(EngineDeadError, match="failed part-way"):
        sampler.sample(PROMPTS[0], GREEDY)
    sampler.update_weights(original)
    assert greedy(sampler) == before


def test_a_merge_over_pushed_weights_without_their_copies_is_refused(
    no_replay: Any, original: dict[str, torch.Tensor], adapters: dict[str, Path]
) -> None:
    from twinkle_core.errors import AdapterError

    sampler = no_replay
    layer = "model.layers.0.self_attn."
    names = [f"{layer}{m}_proj.weight" for m in ("q", "k", "v")]  # one fused layer: sent together
    sampler.update_weights({n: original[n] * 1.05 for n in names})
    base = greedy(sampler)
    version = sampler.weights_version
    # The merge needs the base values update_weights replaced; nothing keeps them: refused, nothing changed.
    with pytest.raises(AdapterError, match="update_weights replaced"):
        sampler.add_adapter_to_model("a", adapters["a"], merge=True)
    assert dict(sampler.adapters) == {} and sampler.weights_version == version and greedy(sampler) == base
    sampler.update_weights({n: original[n] for n in names})


def test_without_auto_restart_or_weight_replay_the_user_restarts_and_repushes(
    no_replay: Any, original: dict[str, torch.Tensor]
) -> None:
    s = no_replay
    before = greedy(s)
    new = perturbed_state(original, seed=3, swap=(before[0][0], before[0][0] + 1))
    s.update_weights(new)
    updated = greedy(s)
    assert updated != before
    sockets = engine_sockets(s)
    assert sockets and all(in_a_session_folder(p) for p in sockets), sockets
    rendezvous = list(s.engine._process.engine_files)
    assert rendezvous and all(os.path.isfile(f) for f in rendezvous)
    for proc in engine_processes(os.getpid()):
        if proc.pid in s.engine._process.reaper.pids:
            proc.send_signal(signal.SIGKILL)
    wait_for(lambda: s.engine._process.engine.errored, "vLLM to notice its worker died")
    with pytest.raises(EngineDeadError, match=r"sampler\.restart\(\)"):
        s.sample(PROMPTS, GREEDY)
    assert s.restarts == 0  # auto_restart=False: nothing restarted behind the user's back
    s.restart()
    assert s.restarts == 1
    # The dead engine's socket files and rendezvous file went with it; the new engine's are in a folder of their own.
    folders = {os.path.dirname(p) for p in sockets}
    assert not [p for p in [*sockets, *folders, *rendezvous] if os.path.exists(p)]
    renewed = engine_sockets(s)
    assert renewed and all(in_a_session_folder(p) and os.path.dirname(p) not in folders for p in renewed)
    # The new engine runs the checkpoint's weights: no sample may carry the version until they are pushed again.
    with pytest.raises(EngineDeadError, match="update_weights"):
        s.sample(PROMPTS, GREEDY)
    s.update_weights(new)
    assert greedy(s) == updated


def test_files_of_dead_drivers_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    from twinkle_vllm._files import PREFIX, driver_files, session_root, shm_dir, sweep_stale

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process now
    dead = [
        os.path.join(shm_dir(), f"{PREFIX}{gone.pid}-stage"),
        os.path.join(session_root(), f"{PREFIX}{gone.pid}-sess"),
    ]
    live = [os.path.join(shm_dir(), f"{PREFIX}{os.getpid()}-stage-test")]
    Path(dead[0]).write_bytes(b"x")
    os.mkdir(dead[1], 0o700)
    Path(dead[1], "w0.sock").write_bytes(b"")
    Path(live[0]).write_bytes(b"x")
    try:
        removed = sweep_stale()
        assert set(dead) <= set(removed)
        assert not any(os.path.exists(p) for p in dead)
        assert os.path.exists(live[0]) and live[0] in driver_files(os.getpid())
    finally:
        for p in live:
            os.unlink(p)
