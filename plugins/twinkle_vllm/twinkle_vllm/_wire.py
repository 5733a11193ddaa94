"""The weight-sync wire format, shared by the sampler (driver) and vLLM's workers.

One sync is a *session*: the driver creates a private folder (mode 0700) for
its ZMQ ``ipc://`` sockets and (once, reused by later sessions) a staging
buffer of two equal slots, then calls
the workers' ``twinkle_sync`` through ``collective_rpc``. Over a REQ/REP pair
per worker it sends ``hello``, one ``bucket`` message per filled slot (the
items in it, their byte ranges, a checksum of the slot) and ``commit``; each
worker answers every message after it has verified and consumed it. While a
worker consumes one slot the driver fills the other.

Buffers:

* :class:`ShmBuffer`, a file in ``/dev/shm`` that both processes ``mmap``
  (CPU engines, or whenever the trainer's tensors are on the host).
* :class:`CudaIpcBuffer`, a CUDA allocation of the driver opened by the
  workers through CUDA IPC (GPU engines with the trainer's tensors on the
  GPU). This path cannot run on the CPU-only machines twinkle is tested on;
  it is kept small on purpose.

Both checksum a bucket with :func:`block_checksum`, where the bytes live.

A session is cancelled by creating ``CANCEL_FILE`` in its folder: a worker
polling for the next message sees it and gives up at once, so a reset
channel never blocks the next sync.
"""

from __future__ import annotations

import mmap
import os
import pickle
from dataclasses import dataclass
from typing import Any

import torch

from twinkle_core.weights import block_checksum

__all__ = [
    "ALIGN",
    "CANCEL_FILE",
    "CudaIpcBuffer",
    "Item",
    "ShmBuffer",
    "StagingBuffer",
    "block_checksum",
    "dtype_from_str",
    "dtype_to_str",
    "open_buffer",
    "socket_address",
]

#: Byte alignment of every item in a slot (any dtype view stays aligned).
ALIGN = 64
CANCEL_FILE = "cancelled"
POLL_S = 0.05


def socket_address(folder: str, rank: int) -> str:
    """The ``ipc://`` endpoint of worker ``rank`` in a session folder."""
    return f"ipc://{os.path.join(folder, f'w{rank}.sock')}"


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_str(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class Item:
    """One tensor, or one chunk of a tensor larger than a slot, inside a bucket.

    Attributes:
        name: the weight's name.
        dtype: its dtype, as :func:`dtype_to_str` writes it.
        shape: the full tensor's shape.
        offset: where this piece starts in the slot, in bytes.
        nbytes: the piece's size in bytes.
        start: where this piece starts in the flattened tensor's bytes.
        total: the full tensor's size in bytes (``start + nbytes == total`` on the last piece).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    start: int
    total: int

    @property
    def whole(self) -> bool:
        """True when this piece is the whole tensor."""
        return self.start == 0 and self.nbytes == self.total


class StagingBuffer:
    """A byte buffer both sides can address as a uint8 tensor."""

    kind: str = ""
    size: int = 0
    tensor: torch.Tensor

    def describe(self) -> dict[str, Any]:
        """What a worker needs to open it (see :func:`open_buffer`)."""
        raise NotImplementedError

    def checksum(self, offset: int, nbytes: int) -> int:
        """Checksum of ``nbytes`` bytes at ``offset`` (:func:`block_checksum`)."""
        return block_checksum(self.view(offset, nbytes))

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``nbytes`` bytes at ``offset``."""
        return self.tensor[offset : offset + nbytes]

    def close(self) -> None:
        """Release this process's mapping (the creator also removes it)."""


class ShmBuffer(StagingBuffer):
    """A ``/dev/shm`` file mapped by the driver and every worker.

    Plain ``mmap`` rather than ``multiprocessing.shared_memory``: the latter
    registers segments with a resource tracker that vLLM's spawned workers
    share, which then warns about or unlinks segments it does not own.
    """

    kind = "shm"

    def __init__(self, path: str, size: int, *, create: bool) -> None:
        self.path = path
        self.size = size
        self._owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            # Fault every page in now, once, rather than one by one inside the copies.
            populate = getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)

    @staticmethod
    def default_dir() -> str:
        """``/dev/shm`` where it exists (RAM-backed), else the temp folder."""
        import tempfile

        return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "size": self.size}

    def close(self) -> None:
        # Views of the mapping must be gone before it can close; the workers
        # copy what they keep, so dropping our own view is enough.
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self._mm.close()
        except BufferError:  # pragma: no cover - a stray view; the GC closes it later
            pass
        if self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class CudaIpcBuffer(StagingBuffer):  # pragma: no cover - needs a CUDA device
    """A CUDA allocation of the driver, shared with the workers by CUDA IPC."""

    kind = "cuda_ipc"

    def __init__(self, size: int, device: torch.device | None = None, *, handle: bytes | None = None) -> None:
        if handle is None:
            from torch.multiprocessing.reductions import reduce_tensor

            self.tensor = torch.empty(size, dtype=torch.uint8, device=device or "cuda")
            # (rebuild function, its arguments): what torch itself sends to open the allocation elsewhere.
            self._handle = pickle.dumps(reduce_tensor(self.tensor))  # type: ignore[no-untyped-call]  # torch: unannotated
        else:
            rebuild, args = pickle.loads(handle)
            self.tensor = rebuild(*args)
            self._handle = handle
        self.size = size

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "handle": self._handle, "size": self.size}

    def close(self) -> None:
        torch.cuda.synchronize(self.tensor.device)
        self.tensor = torch.empty(0, dtype=torch.uint8)


def open_buffer(description: dict[str, Any]) -> StagingBuffer:
    """Open (in a worker) the buffer a driver described."""
    if description["kind"] == ShmBuffer.kind:
        return ShmBuffer(description["path"], description["size"], create=False)
    if description["kind"] == CudaIpcBuffer.kind:  # pragma: no cover - needs CUDA
        return CudaIpcBuffer(description["size"], handle=description["handle"])
    raise ValueError(f"unknown staging buffer kind {description['kind']!r}")
