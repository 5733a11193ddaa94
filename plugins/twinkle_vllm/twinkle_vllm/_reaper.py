"""The reaper: a small watcher process that stops a vLLM engine whose driver died.

vLLM runs its engine in child processes of the sampler's process (the
*driver*): ``EngineCore``, which starts one ``Worker`` per device. When the
driver exits normally, ``close()`` (or vLLM's own finalizers) stop them. When
it is killed (``kill -9``, the OOM killer), nothing does: ``EngineCore`` and
its workers keep running, reparented to PID 1, holding their memory, their
shared-memory segments (``/dev/shm/psm_*``), their ZMQ socket files and ours.

So each engine gets a reaper, started right after the engine:

* it runs in its own session (a signal to the driver's process group does
  not reach it) and imports nothing heavy (about 20 MB);
* it waits on a pidfd of the driver (exact, immune to pid reuse) and on a
  pipe from it; ``close()`` writes ``stop`` on the pipe and the reaper exits
  doing nothing;
* it records the sockets and shared-memory files the engine's processes hold
  when it starts, from time to time while the driver lives, and again when the
  driver dies (the engine's own watch, below, may have stopped them by then);
  it then sends ``SIGTERM`` to ``EngineCore`` (vLLM's own
  handler then shuts the workers down and unlinks its segments), waits up to
  ``grace_s`` for every engine process to exit, kills what is left, and
  removes the files: the socket files vLLM's processes bound (ZMQ leaves them
  behind), segments that are left, the rendezvous file of vLLM's workers
  (which only a clean shutdown removes), and twinkle's own staging buffer and
  session folders of that driver (see :mod:`twinkle_vllm._files`).

A second, independent line: every worker also watches the driver
(:func:`watch_driver`, started through the worker extension) and sends
``SIGTERM`` to its ``EngineCore`` when the driver dies, so the engine stops
even if the reaper was killed too (its files are then swept by the next
sampler, see :mod:`twinkle_vllm._files`).

The driver tells the reaper which processes are the engine's by comparing its
children before and after the engine starts (:func:`snapshot`, then
:meth:`Reaper.start`); the processes are identified by pid *and* start time,
so a reused pid is never signalled.

This module imports only the standard library, ``psutil`` (a vLLM
dependency) and :mod:`twinkle_vllm._files`.
"""

from __future__ import annotations

import json
import os
import select
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Reaper", "Snapshot", "snapshot", "watch_driver"]

#: How long the engine may take to exit after SIGTERM before it is killed.
DEFAULT_GRACE_S = 10.0
#: vLLM's and Python multiprocessing's shared-memory names; only these are removed.
_SHM_NAMES = ("psm_", "sem.mp-")


@dataclass
class Snapshot:
    """The driver's child processes and bound Unix sockets before an engine starts."""

    children: set[int] = field(default_factory=set)
    sockets: set[str] = field(default_factory=set)


def _bound_sockets(proc: Any) -> set[str]:
    try:
        return {
            c.laddr for c in proc.net_connections(kind="unix") if isinstance(c.laddr, str) and c.laddr.startswith("/")
        }
    except Exception:
        return set()


def snapshot() -> Snapshot:
    """Record this process's children and bound sockets (call before starting an engine)."""
    import psutil

    me = psutil.Process()
    return Snapshot({p.pid for p in me.children(recursive=True)}, _bound_sockets(me))


class Reaper:
    """The driver's handle on the reaper process of one engine.

    Args:
        process: the reaper process.
        pids: the engine's processes it watches.
    """

    def __init__(self, process: subprocess.Popen[bytes], pids: list[int]) -> None:
        self._process = process
        self.pids = pids

    @classmethod
    def start(cls, before: Snapshot, *, files: Sequence[str] = (), grace_s: float = DEFAULT_GRACE_S) -> Reaper | None:
        """Start a reaper for the processes and sockets that appeared since ``before``, and plain ``files``.

        Returns:
            The handle, or ``None`` where no reaper can run (no new process, or no psutil);
            a reaper is a safety net, so failing to start one never fails the sampler.
        """
        try:
            import psutil

            me = psutil.Process()
            new = [p for p in me.children(recursive=True) if p.pid not in before.children]
            if not new:
                return None
            processes = [[p.pid, p.create_time()] for p in new]
            # The direct children are the engine cores (and multiprocessing's resource
            # tracker, which exits by itself once the others have).
            leaders = [p.pid for p in new if p.ppid() == me.pid and "resource_tracker" not in " ".join(p.cmdline())]
            config = {
                "driver": me.pid,
                "processes": processes,
                "terminate": leaders,
                "paths": sorted(_bound_sockets(me) - before.sockets),
                "files": sorted(files),
                "grace_s": grace_s,
            }
            # Import the reaper from where this process found twinkle, whatever PYTHONPATH says.
            roots = sorted({_package_root("twinkle_vllm"), _package_root("twinkle_core")})
            code = f"import sys; sys.path[:0] = {roots!r}; from twinkle_vllm._reaper import main; main()"
            process = subprocess.Popen(
                [sys.executable, "-c", code],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
            assert process.stdin is not None
            process.stdin.write(json.dumps(config).encode() + b"\n")
            process.stdin.flush()
        except Exception:
            return None
        return cls(process, [int(pid) for pid, _ in processes])

    @property
    def pid(self) -> int:
        """The reaper's own pid."""
        return self._process.pid

    def stop(self, timeout: float = 10.0) -> None:
        """Tell the reaper the engine was closed properly, and wait for it to exit."""
        stdin = self._process.stdin
        try:
            if stdin is not None and not stdin.closed:
                stdin.write(b"stop\n")
                stdin.flush()
                stdin.close()
        except OSError:
            pass
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:  # pragma: no cover - it only reads a pipe
            self._process.kill()
            self._process.wait()


def _package_root(name: str) -> str:
    module = sys.modules[name]
    return os.path.dirname(os.path.dirname(os.path.abspath(module.__file__ or "")))


# -- the watch inside the engine's processes --------------------------------------------------
def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def watch_driver(driver: int) -> bool:
    """In an engine process: on the driver's death, send ``SIGTERM`` to the driver's child on our line.

    That child is ``EngineCore`` (this process itself when the worker runs inside
    it); its own handler then stops the workers. Nothing is watched when the
    driver is not an ancestor of this process (vLLM's Ray executor, a worker
    inside the driver), or without pidfds.

    Returns:
        Whether a watch was started.
    """
    me = os.getpid()
    chain = [me]
    while chain[-1] > 1 and len(chain) < 64:
        chain.append(_parent(chain[-1]))
    if driver == me or driver not in chain:
        return False
    core = chain[chain.index(driver) - 1]
    try:
        pidfd = os.pidfd_open(driver)
    except (AttributeError, OSError):
        return False

    def wait() -> None:
        select.select([pidfd], [], [])
        try:
            os.kill(core, signal.SIGTERM)
        except OSError:
            pass

    import threading

    threading.Thread(target=wait, name="twinkle-driver-watch", daemon=True).start()
    return True


# -- the reaper process ------------------------------------------------------------------------
def _alive(proc: Any) -> bool:
    import psutil

    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


#: While the driver lives, what the engine holds is recorded again after these many seconds
#: (then every last one): it binds and maps more after it starts, and a scan can miss what changes under it.
RECORD_AFTER_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


def _wait_for_driver(driver: int, record: Callable[[], None]) -> bool:
    """Block until the driver dies (True) or says stop (False), calling ``record`` on the way."""
    stdin = sys.stdin.buffer
    try:
        pidfd: int | None = os.pidfd_open(driver)
    except (AttributeError, OSError):
        pidfd = None  # no pidfd (old kernel): poll instead
    readers: list[Any] = [stdin] + ([pidfd] if pidfd is not None else [])
    waits = iter(RECORD_AFTER_S)
    wait = next(waits)
    due = time.monotonic() + wait
    while True:
        if pidfd is None:
            try:
                os.kill(driver, 0)
            except ProcessLookupError:
                return True
        timeout = max(0.0, due - time.monotonic())
        ready, _, _ = select.select(readers, [], [], timeout if pidfd is not None else min(timeout, 0.5))
        if pidfd is not None and pidfd in ready:
            return True
        if stdin in ready:
            line = stdin.readline()
            if line.strip() == b"stop":
                return False
            if not line:  # the pipe closed without a stop: only the pidfd decides now
                readers.remove(stdin)
        if time.monotonic() >= due:
            record()
            wait = next(waits, wait)
            due = time.monotonic() + wait


def _engine_processes(config: dict[str, Any]) -> list[Any]:
    import psutil

    procs = []
    for pid, created in config["processes"]:
        try:
            proc = psutil.Process(pid)
            if abs(proc.create_time() - created) < 0.01:
                procs.append(proc)
        except psutil.Error:
            pass
    return procs


def _held_paths(procs: list[Any]) -> set[str]:
    """The socket files the processes bound and the shared-memory files they map."""
    import psutil

    from twinkle_vllm._files import shm_dir

    paths: set[str] = set()
    shm = shm_dir()
    for proc in procs:
        paths |= _bound_sockets(proc)
        try:
            paths |= {m.path for m in proc.memory_maps() if os.path.dirname(m.path) == shm}
        except psutil.Error:
            pass
    return paths


def _reap(config: dict[str, Any], procs: list[Any], held: set[str]) -> None:
    """Stop the engine's processes, then remove the files they held (``held``: recorded while they ran)."""
    import psutil

    from twinkle_vllm._files import driver_files, remove, shm_dir

    # What they hold now too, asked while they are still there: the engine's watch on the driver
    # may already be stopping them, so what was recorded while they ran is the floor.
    paths = set(config["paths"]) | held | _held_paths(procs)
    shm = shm_dir()
    for proc in procs:
        if proc.pid in config["terminate"]:
            try:
                proc.send_signal(signal.SIGTERM)
            except psutil.Error:
                pass
    deadline = time.monotonic() + float(config["grace_s"])
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in procs:
        if _alive(proc):
            try:
                proc.kill()
            except psutil.Error:
                pass
    deadline = time.monotonic() + 5.0
    while any(_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for path in sorted(paths):
        name = os.path.basename(path)
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            continue
        if stat.S_ISSOCK(mode) or (os.path.dirname(path) == shm and name.startswith(_SHM_NAMES)):
            remove(path)
    for path in config.get("files", []):
        remove(path, plain_file=True)
    for path in driver_files(int(config["driver"])):
        remove(path)


def main() -> None:
    """The reaper process: read the config line, wait for the driver, reap if it died."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    line = sys.stdin.buffer.readline()
    if not line:
        return
    config = json.loads(line)
    # Everything the reaping needs is imported and recorded while the engine runs: on a busy
    # machine the engine's own watch may stop its processes before a late reaper could ask them.
    procs = _engine_processes(config)
    held = _held_paths(procs)
    if _wait_for_driver(int(config["driver"]), lambda: held.update(_held_paths(procs))):
        _reap(config, procs, held)
