"""The driver side of weight sync: buckets, the ZMQ REQ/REP channel, timeouts.

See :mod:`twinkle_vllm._wire` for the protocol. This module plans buckets
(tensors packed in order, each aligned, tensors larger than a slot split into
chunks), fills the two slots of the staging buffer alternately, and drives
every worker through ``hello`` / ``bucket`` ... / ``commit``, each answered
within the per-message timeout. Any failure cancels the session (the workers
see the cancel marker and return) and closes its sockets; the next sync
starts a fresh session. The staging buffer outlives sessions (see
:meth:`SyncChannel._staging`) and is freed by :meth:`SyncChannel.close`.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import shutil
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import zmq

from twinkle_core.errors import WeightSyncTimeoutError, WeightUpdateError
from twinkle_vllm import IPC_TIMEOUT_ENV
from twinkle_vllm._files import session_folder, staging_name
from twinkle_vllm._wire import (
    ALIGN,
    CANCEL_FILE,
    CudaIpcBuffer,
    Item,
    ShmBuffer,
    StagingBuffer,
    dtype_to_str,
    socket_address,
)

__all__ = ["DEFAULT_BUCKET_BYTES", "SyncChannel", "plan_buckets"]

#: Size of one staging slot (the buffer holds two).
DEFAULT_BUCKET_BYTES = 256 << 20

#: Starts a ``collective_rpc`` on the engine; returns a future of the per-worker results.
RpcStarter = Callable[[str, tuple[Any, ...]], "concurrent.futures.Future[list[Any]]"]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_buckets(tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[Item]]:
    """Pack tensors, in order, into buckets of at most ``bucket_bytes`` bytes.

    A tensor that does not fit in what is left of the current bucket starts a
    new one; a tensor larger than a whole bucket is split into chunks that fill
    buckets. Order is kept so that a layer's tensors stay together, which lets
    the workers finish each layer early. (Smaller first buckets, to start the
    workers sooner, made the whole push slower on CPU workers: see
    ``docs/performance.md``.)
    """
    buckets: list[list[Item]] = []
    current: list[Item] = []
    used = 0

    def flush() -> None:
        nonlocal current, used
        if current:
            buckets.append(current)
        current, used = [], 0

    for name, tensor in tensors:
        total = tensor.numel() * tensor.element_size()
        dtype, shape = dtype_to_str(tensor.dtype), tuple(tensor.shape)
        if total <= bucket_bytes:
            if used + total > bucket_bytes:
                flush()
            current.append(Item(name, dtype, shape, used, total, 0, total))
            used = _align(used + total)
            continue
        start = 0
        while start < total:
            room = bucket_bytes - used
            if room <= 0:
                flush()
                continue
            piece = min(total - start, room)
            current.append(Item(name, dtype, shape, used, piece, start, total))
            used = _align(used + piece)
            start += piece
    flush()
    return buckets


class SyncChannel:
    """Pushes tensors to every worker of one engine.

    Args:
        start_rpc: starts ``collective_rpc(method, args)`` on the engine.
        world_size: number of workers (tensor x pipeline parallel ranks).
        timeout_s: per-message timeout (``TWINKLE_VLLM_IPC_TIMEOUT_S``).
        bucket_bytes: slot size.
    """

    def __init__(
        self,
        start_rpc: RpcStarter,
        world_size: int,
        timeout_s: float,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self._start_rpc = start_rpc
        self._world_size = world_size
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self._ctx = zmq.Context()
        # The RPC of a cancelled session may still be running in a worker;
        # the next session waits (bounded) for it, as the workers run one RPC at a time.
        self._pending: concurrent.futures.Future[list[Any]] | None = None
        #: Statistics of the last successful push: bytes, seconds, buckets and
        #: the seconds of each phase (driver_* here, worker_* in worker 0).
        self.last_stats: dict[str, float] = {}
        self._timings: dict[str, float] = {}
        self._buffer: StagingBuffer | None = None
        #: Bucket messages the current (or last) push sent: 0 means the workers applied nothing.
        self.buckets_sent = 0

    # -- public ---------------------------------------------------------------------------
    def push(
        self,
        kind: str,
        tensors: list[tuple[str, torch.Tensor]],
        extra: dict[str, Any] | None = None,
        *,
        cuda_ipc: bool = False,
        while_applying: Callable[[list[str]], None] | None = None,
    ) -> list[Any]:
        """Send ``tensors`` to every worker as one session of ``kind``.

        Args:
            kind: ``"weights"`` (base weights) or ``"lora"`` (an adapter; ``extra`` says which).
            tensors: (name, tensor) pairs, sent in this order.
            extra: session data for the workers.
            cuda_ipc: stage through a CUDA IPC buffer on the tensors' GPU instead
                of shared memory (the tensors and the workers are on GPUs).
            while_applying: called with the names of each bucket once the
                workers have it and the next bucket is staged, while the driver
                would otherwise wait for them (the caller's own per-tensor work,
                such as keeping host copies, costs no time there).

        Returns:
            Each worker's result of the session.

        Raises:
            WeightSyncTimeoutError: a worker did not answer a message in time
                (``stage`` names the step); the channel is reset.
            WeightUpdateError: a worker refused a bucket (bad checksum) or failed to apply it.
        """
        self.buckets_sent = 0
        self._wait_previous()
        started = time.perf_counter()
        self._timings = {"driver_fill": 0.0, "driver_checksum": 0.0, "driver_side_work": 0.0, "driver_wait": 0.0}
        buckets = plan_buckets(tensors, self.bucket_bytes)
        slot = max((it.offset + it.nbytes for b in buckets for it in b), default=ALIGN)
        slot = -(-slot // ALIGN) * ALIGN
        # 0700: nobody else can talk to our sockets; a short root: socket paths are limited (see _files).
        folder = session_folder()
        session_id = uuid.uuid4().hex
        sockets: list[zmq.Socket[bytes]] = []
        rpc: concurrent.futures.Future[list[Any]] | None = None
        try:
            buffer = self._staging(2 * slot, tensors[0][1].device if cuda_ipc and tensors else None)
            session = {
                "id": session_id,
                "kind": kind,
                "folder": folder,
                "buffer": buffer.describe(),
                "timeout_s": self.timeout_s,
                "extra": extra or {},
            }
            rpc = self._start_rpc("twinkle_sync", (session,))
            self._connect(sockets, folder)
            # Stage (fill and checksum) the first slot while the workers' RPC starts up, then shake hands.
            by_name = dict(tensors)
            checksum = self._stage(buffer, buckets[0], by_name, 0) if buckets else 0
            self._round(sockets, {"op": "hello", "session": session_id}, "handshake", rpc)
            self._send_buckets(sockets, buffer, buckets, by_name, slot, checksum, rpc, while_applying)
            self._round(sockets, {"op": "commit", "count": len(buckets)}, "commit", rpc)
            results = self._wait_rpc(rpc, "finish")
        except BaseException:
            self._cancel(folder)
            self._pending = rpc
            raise
        finally:
            for sock in sockets:
                sock.close(linger=0)
            # Removing the folder also removes the socket files; the cancel
            # marker (if any) goes with it, which a late worker reads as "gone".
            shutil.rmtree(folder, ignore_errors=True)
        seconds = time.perf_counter() - started
        total = float(sum(t.numel() * t.element_size() for _, t in tensors))
        self.last_stats = {"bytes": total, "seconds": seconds, "buckets": float(len(buckets)), **self._timings}
        for key, value in (results[0].get("timings") or {}).items():
            self.last_stats[f"worker_{key}"] = float(value)
        return results

    def _connect(self, sockets: list[zmq.Socket[bytes]], folder: str) -> None:
        """Connect one socket per worker into ``sockets`` (the caller closes them, those of a failed connect too)."""
        for rank in range(self._world_size):
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            # The worker binds its socket only once its RPC runs, usually after this connect; ZMQ then
            # retries after RECONNECT_IVL, 100 ms by default, which every sync paid as dead time.
            sock.setsockopt(zmq.RECONNECT_IVL, 2)
            sock.connect(socket_address(folder, rank))
            sockets.append(sock)

    def _send_buckets(
        self,
        sockets: list[zmq.Socket[bytes]],
        buffer: StagingBuffer,
        buckets: list[list[Item]],
        by_name: dict[str, torch.Tensor],
        slot: int,
        checksum: int,
        rpc: concurrent.futures.Future[list[Any]],
        while_applying: Callable[[list[str]], None] | None,
    ) -> None:
        """Send every bucket (the first already staged in slot 0, ``checksum`` its checksum), staging the next."""
        for i, bucket in enumerate(buckets):
            message = {
                "op": "bucket",
                "index": i,
                "count": len(buckets),
                "offset": (i % 2) * slot,
                "nbytes": bucket[-1].offset + bucket[-1].nbytes,
                "checksum": checksum,
                "items": bucket,
            }
            for sock in sockets:
                sock.send_pyobj(message)
            self.buckets_sent += 1
            # Stage the next bucket in the other slot while the workers consume this one, checksum
            # included: its message then goes out the moment they answer, so a worker never waits
            # for a bucket the driver could already have ready.
            if i + 1 < len(buckets):
                checksum = self._stage(buffer, buckets[i + 1], by_name, ((i + 1) % 2) * slot)
            if while_applying is not None:
                clock = time.perf_counter()
                while_applying(list(dict.fromkeys(item.name for item in bucket)))
                self._timings["driver_side_work"] += time.perf_counter() - clock
            clock = time.perf_counter()
            self._collect(sockets, f"bucket {i + 1}/{len(buckets)}", rpc)
            self._timings["driver_wait"] += time.perf_counter() - clock

    def reset(self) -> None:
        """Forget the RPC of a cancelled session: its engine was replaced (the staging buffer is kept)."""
        self._pending = None

    def close(self) -> None:
        """Free the staging buffer and close the ZMQ context."""
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None
        if not self._ctx.closed:
            self._ctx.term()

    # -- helpers --------------------------------------------------------------------------
    def _staging(self, size: int, cuda_device: torch.device | None) -> StagingBuffer:
        """The staging buffer, kept from one sync to the next.

        Reusing it matters: the first write to each page of a fresh buffer is a
        page fault (and, in /dev/shm, an allocation), which would cost more than
        the copy itself. The workers keep their mapping of it too.
        """
        kind = CudaIpcBuffer.kind if cuda_device is not None else ShmBuffer.kind
        current = self._buffer
        if (
            current is not None
            and current.kind == kind
            and current.size >= size
            and (cuda_device is None or current.tensor.device == cuda_device)
        ):
            return current
        if current is not None:
            current.close()
            self._buffer = None
        if cuda_device is not None:  # pragma: no cover - needs CUDA
            buffer: StagingBuffer = CudaIpcBuffer(size, cuda_device)
        else:
            # The driver's pid in the name: its reaper, or a later sampler, can clean up after it (see _files).
            buffer = ShmBuffer(staging_name(os.getpid(), uuid.uuid4().hex[:12]), size, create=True)
        self._buffer = buffer
        return buffer

    def _stage(self, buffer: StagingBuffer, bucket: list[Item], by_name: dict[str, torch.Tensor], base: int) -> int:
        """Fill one slot with ``bucket`` and return its checksum."""
        self._fill(buffer, bucket, by_name, base)
        clock = time.perf_counter()
        checksum = buffer.checksum(base, bucket[-1].offset + bucket[-1].nbytes)
        self._timings["driver_checksum"] += time.perf_counter() - clock
        return checksum

    def _fill(self, buffer: StagingBuffer, bucket: list[Item], by_name: dict[str, torch.Tensor], base: int) -> None:
        clock = time.perf_counter()
        for item in bucket:
            source = by_name[item.name]
            flat = source.detach().reshape(-1).view(torch.uint8)[item.start : item.start + item.nbytes]
            target = buffer.view(base + item.offset, item.nbytes)
            if flat.device.type == "cpu" and target.device.type == "cpu":
                # numpy's copy is a plain memcpy, about twice torch's copy_ on CPU
                np.copyto(target.numpy(), flat.numpy())
            else:
                target.copy_(flat)
        if buffer.tensor.is_cuda:  # pragma: no cover - needs CUDA
            torch.cuda.synchronize(buffer.tensor.device)
        self._timings["driver_fill"] += time.perf_counter() - clock

    def _round(self, sockets: list[zmq.Socket[bytes]], message: dict[str, Any], stage: str, rpc: Any) -> None:
        for sock in sockets:
            sock.send_pyobj(message)
        self._collect(sockets, stage, rpc)

    def _collect(self, sockets: list[zmq.Socket[bytes]], stage: str, rpc: concurrent.futures.Future[list[Any]]) -> None:
        """Wait for one reply per worker, each within the timeout."""
        poller = zmq.Poller()
        waiting = {}
        for rank, sock in enumerate(sockets):
            poller.register(sock, zmq.POLLIN)
            waiting[sock] = rank
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(waiting.values())
                raise WeightSyncTimeoutError(
                    f"Weight sync timed out at stage '{stage}': worker(s) {ranks} did not answer within"
                    f" {self.timeout_s:g} s ({IPC_TIMEOUT_ENV}). The channel was reset; the next sync starts afresh.",
                    stage=stage,
                )
            # poll takes whole milliseconds; round up so the last sliver of the deadline is not a busy loop
            events = dict(poller.poll(math.ceil(min(left, 0.2) * 1000)))
            for sock in list(waiting):
                if events.get(sock):
                    reply = sock.recv_pyobj()
                    rank = waiting.pop(sock)
                    if not reply.get("ok"):
                        raise WeightUpdateError(
                            f"Weight sync failed at stage '{stage}' on worker {rank}: {reply.get('error')}"
                        )
            if waiting and rpc.done():
                # The worker's RPC ended without answering: it failed before listening.
                self._wait_rpc(rpc, stage)
                raise WeightUpdateError(f"Weight sync failed at stage '{stage}': the workers left the session early.")

    def _wait_rpc(self, rpc: concurrent.futures.Future[list[Any]], stage: str) -> list[Any]:
        try:
            results = rpc.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise WeightSyncTimeoutError(
                f"Weight sync timed out at stage '{stage}': the workers did not finish within {self.timeout_s:g} s"
                f" ({IPC_TIMEOUT_ENV}).",
                stage=stage,
            ) from None
        except Exception as exc:
            raise WeightUpdateError(f"Weight sync failed at stage '{stage}' inside a worker: {exc}") from exc
        for rank, result in enumerate(results):
            if not (isinstance(result, dict) and result.get("ok")):
                error = result.get("error") if isinstance(result, dict) else result
                raise WeightUpdateError(f"Weight sync failed at stage '{stage}' on worker {rank}: {error}")
        return list(results)

    def _wait_previous(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None or pending.done():
            return
        try:
            pending.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            self._pending = pending
            raise WeightSyncTimeoutError(
                "Weight sync timed out at stage 'previous sync': the workers are still busy with a cancelled"
                f" sync after {self.timeout_s:g} s ({IPC_TIMEOUT_ENV}).",
                stage="previous sync",
            ) from None
        except Exception:
            pass  # it failed, as expected of a cancelled session

    @staticmethod
    def _cancel(folder: str) -> None:
        try:
            with open(os.path.join(folder, CANCEL_FILE), "w"):
                pass
        except OSError:
            pass
