"""Hand back a caller thread's idle OpenMP workers, which would slow the decode loop.

PyTorch's CPU kernels (and oneDNN's matmuls) run their parallel loops on GNU
OpenMP (``libgomp``) on Linux, which keeps a pool of worker threads for every
thread that has run a parallel loop, for as long as that thread lives. When
those pools together hold more threads than the machine has CPUs, ``libgomp``
stops letting workers spin between parallel loops: they sleep, and every loop
pays to wake them up. The decode loop runs on a thread of its own, so the
thread that loaded the model or last pushed weights (the caller's, usually
the main thread) holds a second pool, idle while it waits for ``sample()``,
and on a small machine that alone tips the count. A decode step runs
hundreds of parallel loops (every matmul, and the norms, rotary embeddings
and activations once the batch is large enough), each paying the wake-up:
on a 2-core machine an elementwise op on ``[64, 576]`` after a matmul took
60-90 us on a second thread while the first thread's pool was alive, and
6-9 us once it was released.

:func:`release_idle_workers` ends the calling thread's idle pool (OpenMP
5.0's ``omp_pause_resource_all``, which ``libgomp`` implements for the
calling thread's pool only). The thread gets a new pool the next time it
runs a parallel loop, at the cost of starting its workers again (tens of
microseconds). The engine calls it on the caller's thread wherever that
thread has just run its own parallel work or is about to wait: at the end
of the engine's construction (loading the model) and of every weight or
adapter change (:func:`releasing`), and in ``Decoder.run`` before the
caller waits for its rows. A call handed to a background thread
(``submit()``, ``asample()``, the server's requests) waits on a thread of
its own, so the thread that loaded the model must not keep its pool. It
does nothing where the runtime is not ``libgomp`` (LLVM's ``libomp``
pauses the whole runtime, so it is left alone) or where no OpenMP runtime
is loaded.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["release_idle_workers", "releasing", "rescan"]

_F = TypeVar("_F", bound=Callable[..., Any])

_OMP_PAUSE_SOFT = 1
_lock = threading.Lock()
_runtimes: list[Any] | None = None


def _loaded_libgomp() -> list[Any]:
    """Every GNU OpenMP runtime loaded in this process (a wheel may bundle its own copy)."""
    paths: set[str] = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("libgomp"):
                    paths.add(fields[5].strip())
    except OSError:  # not Linux
        return []
    found = []
    for path in sorted(paths):
        try:  # RTLD_NOLOAD: a handle to the copy already loaded, never a new one
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
        gnu = hasattr(lib, "GOMP_parallel") and not hasattr(lib, "__kmpc_fork_call")  # not LLVM's libomp renamed
        if gnu and hasattr(lib, "omp_pause_resource_all"):
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            found.append(lib)
    return found


def rescan() -> None:
    """Look for the loaded runtimes again at the next call (a library loaded since may bring one)."""
    global _runtimes
    with _lock:
        _runtimes = None


def release_idle_workers() -> int:
    """End the calling thread's idle OpenMP worker pool, in every GNU runtime loaded; returns how many accepted.

    A runtime accepts when the thread is not inside a parallel loop, whether
    or not it held a pool there. Safe from any thread: inside a parallel loop
    the runtime refuses (and nothing changes), and other threads' pools are
    never touched.
    """
    global _runtimes
    with _lock:
        if _runtimes is None:
            _runtimes = _loaded_libgomp()
        runtimes = _runtimes
    return sum(1 for lib in runtimes if lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0)


def releasing(method: _F) -> _F:
    """Wrap ``method`` to release the calling thread's idle workers when it returns or raises."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        finally:
            release_idle_workers()

    return wrapper  # type: ignore[return-value]
