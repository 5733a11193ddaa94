"""What the decode loop needs from the process around it: its thread's name, the heap, exit, CUDA memory.

The loop runs in a daemon thread of its own (:class:`twinkle_torch.decoding.Decoder`).
These are the pieces that tie that thread to the process: closing every loop
at interpreter exit (before daemon threads are stopped), giving the memory a
finished batch freed back to the OS, naming the thread for ``top -H``, and
telling a CUDA out-of-memory error from any other.
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any, Protocol

import torch

__all__ = [
    "OutOfMemoryError",
    "close_at_exit",
    "empty_cuda_cache",
    "give_back_freed_memory",
    "is_cuda_oom",
    "name_this_thread",
]


class _Closable(Protocol):
    def close(self) -> None: ...


#: Decode loops alive in this process: closed at exit, before the interpreter stops daemon threads.
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def close_at_exit(loop: _Closable) -> None:
    """Have ``loop.close()`` called at interpreter exit (while ``loop`` is alive)."""
    _LIVE.add(loop)


@atexit.register
def _close_at_exit() -> None:
    # The loop thread is a daemon: at interpreter exit it would be stopped wherever it is, and
    # when that is inside a tensor's destructor (the loop frees the batch's KV cache after its
    # last run is reported, with the GIL released), the unwind through C++ aborts the whole
    # process ("terminate called without an active exception", exit 134). Atexit handlers run
    # before daemon threads are stopped, so every loop is ended and joined here.
    for loop in list(_LIVE):
        loop.close()


def _load_libc() -> Any:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc()


def give_back_freed_memory() -> None:
    """Return the heap memory a batch freed to the OS (glibc's ``malloc_trim``; nothing elsewhere).

    The loop's thread has a malloc arena of its own; what a prefill's chunks
    and a finished batch's cache free stays resident there (a process that had
    run 256 rows kept 1.2 GB of it), so the next, smaller batch would start
    from the last one's high-water mark.
    """
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def name_this_thread(name: bytes) -> None:
    """Give the calling thread a kernel name (Linux), which ``top -H`` shows and its OpenMP workers inherit."""
    if _LIBC is not None and hasattr(_LIBC, "prctl"):
        _LIBC.prctl(15, name, 0, 0, 0)  # PR_SET_NAME; at most 15 bytes


OutOfMemoryError: type[BaseException] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def is_cuda_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA out-of-memory error (which the loop recovers from by shrinking its batch)."""
    return isinstance(exc, OutOfMemoryError)


def empty_cuda_cache() -> None:
    """Hand CUDA's cached blocks back after an out-of-memory error (nothing without CUDA)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
