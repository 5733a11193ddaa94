"""Weights by collective: one sender, a chain of receivers, a ``torch.distributed`` group of their own.

The sender (rank 0: the trainer) and the receivers (ranks 1..n: one per
replica) meet at a TCP store the sender serves, then form a process group
built directly on that store, never the default group, so a trainer's own
``init_process_group`` is left alone. The backend is ``gloo`` (CPU tensors)
or ``nccl`` (CUDA tensors).

The update moves down a chain: rank 0 sends each bucket to rank 1, rank r
forwards what it receives to rank r+1 while it receives the next piece.
Every link carries the model's bytes once, so the sender's egress is one
model whatever the number of receivers, and pieces of ``chunk_bytes``
pipeline the chain: its time grows by one piece per extra receiver, not by
one model.

Per bucket: a header (the tensors' names, dtypes, shapes and byte offsets),
then the payload in pieces. The last header says ``end`` (or ``abort``,
when the sender's stream failed: the receivers then keep nothing). Each
side checksums every bucket (:func:`~twinkle_core.weights.block_checksum`);
the receivers return theirs, and the sender's caller compares them. Any
wait longer than ``timeout_s`` (a receiver that never joins, a peer that
died) raises :class:`~twinkle_core.errors.WeightSyncTimeoutError`.

Torch is imported only when a group is formed.
"""

from __future__ import annotations

import pickle
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

import attrs

from twinkle_core.errors import ConfigError, WeightSyncTimeoutError, WeightUpdateError
from twinkle_core.weights import block_checksum, check_pair, check_tensor, find_non_finite

__all__ = [
    "BACKENDS",
    "GroupSpec",
    "SendReport",
    "Sender",
    "open_group",
    "receive",
    "unpack",
]

#: The process-group backends a group can use.
BACKENDS = ("gloo", "nccl")
#: Byte alignment of each tensor inside a bucket (so every tensor views its bytes as its dtype).
_ALIGN = 64
_HEADER_LEN_DTYPE = "int64"


class TransferAborted(Exception):
    """The sender gave up before any byte moved (or its stream failed): the receiver keeps nothing."""


@attrs.frozen
class GroupSpec:
    """What a receiver needs to join one update's group.

    Attributes:
        host, port: the TCP store, served by the sender.
        group_id: names this update's keys in the store.
        world_size: the sender plus every receiver.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: the longest any step waits.
        chunk_bytes: the piece a payload moves in.
    """

    host: str
    port: int
    group_id: str
    world_size: int
    backend: str
    timeout_s: float
    chunk_bytes: int


@attrs.frozen
class SendReport:
    """What one update moved.

    Attributes:
        checksums: one per bucket, in order.
        nbytes: the tensors' bytes (what the sender sent, once).
        tensors: how many tensors.
        buckets: how many buckets.
        peak_bucket_bytes: the largest bucket the sender held.
        seconds: from the go signal to the last byte sent.
    """

    checksums: tuple[int, ...]
    nbytes: int
    tensors: int
    buckets: int
    peak_bucket_bytes: int
    seconds: float


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"Weight transport backend {backend!r} is invalid: expected one of {', '.join(BACKENDS)}.")
    return backend


def _make_group(store: Any, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def _timed_out(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text


class _Link:
    """Send and receive whole messages to and from one neighbour, on the group's device."""

    def __init__(self, group: Any, backend: str, timeout_s: float) -> None:
        import torch

        self.group = group
        self.timeout_s = timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def send(self, tensor: Any, peer: int) -> tuple[Any, Any]:
        """Start sending ``tensor``; the pair keeps it alive until its work is waited for."""
        try:
            return self.group.send([tensor], peer, 0), tensor
        except RuntimeError as exc:
            raise WeightUpdateError(f"Weight transfer: sending to rank {peer} failed: {exc}") from exc

    def drain(self, pending: list[tuple[Any, Any]], what: str, *, keep_running: bool = False) -> None:
        """Wait for the sends in ``pending`` (or, with ``keep_running``, only drop those already done)."""
        if keep_running:
            pending[:] = [p for p in pending if not p[0].is_completed()]
            return
        for work, _tensor in pending:
            self.wait(work, what)
        pending.clear()

    def recv(self, tensor: Any, peer: int, what: str) -> None:
        try:
            work = self.group.recv([tensor], peer, 0)
        except RuntimeError as exc:
            raise WeightUpdateError(f"Weight transfer: {what} failed: {exc}") from exc
        self.wait(work, what)

    def wait(self, work: Any, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            if _timed_out(exc):
                raise WeightSyncTimeoutError(
                    f"Weight transfer: {what} did not complete within {self.timeout_s:g}s ({exc}).", stage=what
                ) from exc
            raise WeightUpdateError(f"Weight transfer: {what} failed: {exc}") from exc


def _pack_header(header: dict[str, Any], device: Any) -> tuple[Any, Any]:
    import torch

    raw = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    body = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    return torch.tensor([len(raw)], dtype=torch.int64, device=device), body


def _pieces(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, nbytes)) for a in range(0, nbytes, chunk)]


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _tensor_bytes(tensor: Any) -> int:
    return int(tensor.numel()) * int(tensor.element_size())


class Sender:
    """Rank 0 of one update: serves the store, waits for every receiver, then streams the buckets.

    Args:
        world_size: 1 + the number of receivers.
        host: the address receivers reach this process at.
        backend: ``"gloo"`` or ``"nccl"``.
        timeout_s: the longest any step waits.
        bucket_bytes: tensors are packed into buckets of about this size (a
            larger tensor is a bucket of its own).
        chunk_bytes: the piece a payload moves in along the chain.
    """

    def __init__(
        self,
        world_size: int,
        *,
        host: str,
        backend: str = "gloo",
        timeout_s: float = 300.0,
        bucket_bytes: int = 64 << 20,
        chunk_bytes: int = 4 << 20,
    ) -> None:
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        if world_size < 2:
            raise ConfigError(f"A weight transfer group needs at least one receiver; world_size={world_size}.")
        self.backend = check_backend(backend)
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = int(bucket_bytes)
        self._store: Any = TCPStore(
            "0.0.0.0",
            0,
            world_size,
            True,
            timedelta(seconds=self.timeout_s),
            wait_for_workers=False,
        )
        self.spec = GroupSpec(
            host=host,
            port=int(self._store.port),
            group_id=uuid.uuid4().hex,
            world_size=world_size,
            backend=self.backend,
            timeout_s=self.timeout_s,
            chunk_bytes=int(chunk_bytes),
        )
        self._group: Any = None

    def _key(self, name: str) -> str:
        return f"{self.spec.group_id}/{name}"

    def wait_joined(self, watch: Callable[[], None] | None = None) -> None:
        """Wait until every receiver has joined; ``watch`` raises if a receiver is known to have failed.

        Raises:
            WeightSyncTimeoutError: some receivers did not join within the timeout
                (``stage="join"``); they are told to give up.
        """
        keys = [self._key(f"joined/{r}") for r in range(1, self.spec.world_size)]
        deadline = time.monotonic() + self.timeout_s
        try:
            while not self._store.check(keys):
                if watch is not None:
                    watch()
                if time.monotonic() > deadline:
                    missing = [r for r, k in enumerate(keys, 1) if not self._store.check([k])]
                    raise WeightSyncTimeoutError(
                        f"Weight transfer: receivers {missing} of {len(keys)} did not join within"
                        f" {self.timeout_s:g}s; nothing was sent.",
                        stage="join",
                    )
                time.sleep(0.01)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Tell receivers waiting for the go signal to give up (they keep nothing)."""
        try:
            self._store.set(self._key("start"), "abort")
        except Exception:  # the store is already gone: nobody is waiting on it
            pass

    def send(self, named_tensors: Iterable[tuple[str, Any]], *, check_finite: bool = False) -> SendReport:
        """Give the go signal and stream ``named_tensors`` down the chain, bucket by bucket.

        The stream is read once, one bucket ahead of what is on the wire, so
        at most two buckets are held here. If reading it fails (a bad pair, a
        non-finite value with ``check_finite``, the trainer's own error), the
        receivers are told to drop what they got and the error is raised.

        Raises:
            WeightUpdateError: a bad item, or no tensors at all.
            WeightSyncTimeoutError: a receiver stopped reading.
        """
        import torch

        self._store.set(self._key("start"), "go")
        prefix = torch.distributed.PrefixStore(self.spec.group_id, self._store)  # type: ignore[attr-defined]
        self._group = _make_group(prefix, 0, self.spec.world_size, self.backend, self.timeout_s)
        link = _Link(self._group, self.backend, self.timeout_s)
        started = time.perf_counter()
        checksums: list[int] = []
        pending: list[tuple[Any, Any]] = []  # the bucket on the wire
        what = "sending to receiver 1"
        total = count = peak = 0
        stream = _buckets(named_tensors, self.bucket_bytes, check_finite)
        while True:
            try:
                bucket = next(stream, None)
            except Exception as exc:
                link.drain(pending, what)
                self._send_header(link, {"abort": f"{type(exc).__name__}: {exc}"}, pending)
                link.drain(pending, what)
                raise
            if bucket is None:
                break
            items, flat = bucket
            flat = flat.to(link.device)
            checksums.append(block_checksum(flat))
            link.drain(pending, what)  # the previous bucket is off: two at most are held
            self._send_header(link, {"items": items, "nbytes": int(flat.numel()), "checksum": checksums[-1]}, pending)
            pending += [link.send(flat[a:b], 1) for a, b in _pieces(int(flat.numel()), self.spec.chunk_bytes)]
            total += sum(item[4] for item in items)
            count += len(items)
            peak = max(peak, int(flat.numel()))
        link.drain(pending, what)
        if not count:
            self._send_header(link, {"abort": "no tensors"}, pending)
            link.drain(pending, what)
            raise WeightUpdateError("update_weights got no tensors.")
        self._send_header(link, {"end": True}, pending)
        link.drain(pending, what)
        return SendReport(
            checksums=tuple(checksums),
            nbytes=total,
            tensors=count,
            buckets=len(checksums),
            peak_bucket_bytes=peak,
            seconds=time.perf_counter() - started,
        )

    @staticmethod
    def _send_header(link: _Link, header: dict[str, Any], pending: list[tuple[Any, Any]]) -> None:
        size, body = _pack_header(header, link.device)
        pending += [link.send(size, 1), link.send(body, 1)]

    def close(self) -> None:
        """Drop the group and the store."""
        self._group = None
        self._store = None


def _buckets(
    named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int, check_finite: bool
) -> Iterator[tuple[list[tuple[str, str, tuple[int, ...], int, int]], Any]]:
    """Pack the stream into ``(items, flat uint8 tensor)`` buckets; an item: (name, dtype, shape, offset, nbytes)."""
    import torch

    def flush(group: list[tuple[str, Any]]) -> tuple[list[tuple[str, str, tuple[int, ...], int, int]], Any]:
        items: list[tuple[str, str, tuple[int, ...], int, int]] = []
        offset = 0
        for name, tensor in group:
            nbytes = _tensor_bytes(tensor)
            items.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
            offset = _aligned(offset + nbytes)
        flat = torch.empty(max(offset, 1), dtype=torch.uint8, device=group[0][1].device)
        for (_name, tensor), (_, _, _, start, nbytes) in zip(group, items):
            if nbytes:
                flat[start : start + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        return items, flat

    group: list[tuple[str, Any]] = []
    size = 0
    for i, item in enumerate(named_tensors):
        name, tensor = check_pair(i, item)
        check_tensor(name, tensor)
        if check_finite:
            bad = find_non_finite([(name, tensor)])
            if bad is not None:
                raise WeightUpdateError(f"update_weights: {bad}; nothing was updated.")
        nbytes = _tensor_bytes(tensor)
        if group and size + nbytes > bucket_bytes:
            yield flush(group)
            group, size = [], 0
        group.append((name, tensor))
        size += _aligned(nbytes)
    if group:
        yield flush(group)


def receive(spec: GroupSpec, rank: int, *, device: Any = None) -> tuple[list[Bucket], tuple[int, ...], bool]:
    """Join ``spec``'s group as ``rank`` and receive the whole update, forwarding it down the chain.

    A bucket whose checksum differs from the sender's is reported once the
    stream ends (it is still forwarded: the next receiver checks its own).
    If the next receiver stops reading, forwarding stops and this one still
    receives everything.

    Returns:
        The buckets (on ``device``; :func:`unpack` gives their tensors), each
        bucket's checksum, and whether the whole stream was forwarded (always
        True for the last rank).

    Raises:
        TransferAborted: the sender gave up before sending, or its stream
            failed; nothing is kept.
        WeightUpdateError: a bucket arrived corrupted, or the link to the sender broke.
        WeightSyncTimeoutError: a step waited longer than the spec's timeout.
    """
    import torch
    import torch.distributed as dist

    if not 1 <= rank < spec.world_size:
        raise ConfigError(f"Receiver rank {rank} is invalid for a group of {spec.world_size}.")
    timeout = timedelta(seconds=spec.timeout_s)
    try:
        store = dist.TCPStore(spec.host, spec.port, spec.world_size, False, timeout)  # type: ignore[attr-defined]
        store.set(f"{spec.group_id}/joined/{rank}", "1")
        store.wait([f"{spec.group_id}/start"], timeout)
        signal = store.get(f"{spec.group_id}/start")
    except RuntimeError as exc:  # DistStoreError and friends
        if _timed_out(exc):
            raise WeightSyncTimeoutError(
                f"Weight transfer: receiver {rank} got no go signal within {spec.timeout_s:g}s ({exc}).", stage="join"
            ) from exc
        raise WeightUpdateError(f"Weight transfer: receiver {rank} could not reach the sender: {exc}") from exc
    if signal != b"go":
        raise TransferAborted("the sender gave up before sending")
    prefix = dist.PrefixStore(spec.group_id, store)  # type: ignore[attr-defined]
    group = _make_group(prefix, rank, spec.world_size, spec.backend, spec.timeout_s)
    link = _Link(group, spec.backend, spec.timeout_s)
    target = device if device is not None else link.device
    chain = _Forward(link, rank, spec.world_size)
    buckets: list[Bucket] = []
    checksums: list[int] = []
    corrupted: list[int] = []
    what = f"receiver {rank} reading from rank {rank - 1}"
    while True:
        size = torch.empty(1, dtype=torch.int64, device=link.device)
        link.recv(size, rank - 1, what)
        body = torch.empty(int(size.item()), dtype=torch.uint8, device=link.device)
        link.recv(body, rank - 1, what)
        chain.send(size, body)
        header = pickle.loads(bytes(body.cpu().numpy()))
        if "abort" in header:
            chain.finish()
            raise TransferAborted(f"the sender's stream failed: {header['abort']}")
        if header.get("end"):
            break
        flat = torch.empty(max(int(header["nbytes"]), 1), dtype=torch.uint8, device=link.device)
        for a, b in _pieces(int(header["nbytes"]), spec.chunk_bytes):
            link.recv(flat[a:b], rank - 1, what)
            chain.send(flat[a:b])
        checksum = block_checksum(flat)
        if checksum != header["checksum"]:
            corrupted.append(len(checksums))
        checksums.append(checksum)
        buckets.append((header["items"], flat if target == link.device else flat.to(target)))
        chain.prune()
    forwarded = chain.finish()
    if corrupted:
        raise WeightUpdateError(
            f"Weight transfer: buckets {corrupted} of {len(checksums)} arrived at receiver {rank} with a wrong"
            " checksum; nothing was applied."
        )
    return buckets, tuple(checksums), forwarded


#: One received bucket: its items ``(name, dtype, shape, offset, nbytes)`` and its bytes (a flat uint8 tensor).
Bucket = tuple[list[tuple[str, str, tuple[int, ...], int, int]], Any]


def unpack(buckets: list[Bucket]) -> list[tuple[str, Any]]:
    """The ``(name, tensor)`` pairs of received buckets, in the order sent (views into the buckets' bytes).

    Keep (or pickle) the buckets, not the views: each view of a bucket would
    carry the whole bucket with it.
    """
    import torch

    out: list[tuple[str, Any]] = []
    for items, flat in buckets:
        for name, dtype, shape, offset, nbytes in items:
            dt = getattr(torch, dtype)
            piece = flat[offset : offset + nbytes].view(dt) if nbytes else torch.empty(0, dtype=dt, device=flat.device)
            out.append((name, piece.view(shape)))
    return out


class _Forward:
    """A receiver's sends to the next rank; a failed send stops forwarding, never the receiving."""

    def __init__(self, link: _Link, rank: int, world_size: int) -> None:
        self.link = link
        self.peer = rank + 1
        self.last = self.peer >= world_size
        self.active = not self.last
        self.pending: list[tuple[Any, Any]] = []

    def send(self, *tensors: Any) -> None:
        if not self.active:
            return
        try:
            self.pending += [self.link.send(t, self.peer) for t in tensors]
        except WeightUpdateError:
            self.active = False
            self.pending.clear()

    def prune(self) -> None:
        """Drop the sends already done (one that failed stops forwarding)."""
        if not self.active:
            return
        try:
            self.link.drain(self.pending, "forwarding", keep_running=True)
        except Exception:
            self.active = False
            self.pending.clear()

    def finish(self) -> bool:
        """Wait for every send; True if the whole stream went on (or there is no next rank)."""
        if not self.active:
            return self.last
        try:
            self.link.drain(self.pending, f"forwarding to rank {self.peer}")
        except Exception:
            self.active = False
        return self.active


def local_address() -> str:
    """This machine's address as other nodes see it (Ray's view when Ray runs here)."""
    try:
        import ray.util

        return str(ray.util.get_node_ip_address())
    except Exception:
        return socket.gethostbyname(socket.gethostname())


def open_group(
    host: str, port: int, *, rank: int, world_size: int, backend: str = "gloo", timeout_s: float = 300.0
) -> tuple[Any, Any]:
    """Join (``rank`` > 0) or host (``rank`` 0, at ``port`` on every interface) a standing group of its own.

    For a group that outlives one update (a server a trainer pushes into
    again and again). Returns ``(store, group)``; keep both alive.

    Raises:
        WeightSyncTimeoutError: the others did not arrive within ``timeout_s``.
        WeightUpdateError: the store could not be reached.
    """
    import torch.distributed as dist

    check_backend(backend)
    timeout = timedelta(seconds=timeout_s)
    try:
        if rank == 0:
            store = dist.TCPStore("0.0.0.0", port, world_size, True, timeout, wait_for_workers=False)  # type: ignore[attr-defined]
        else:
            store = dist.TCPStore(host, port, world_size, False, timeout)  # type: ignore[attr-defined]
        group = _make_group(store, rank, world_size, backend, timeout_s)
    except RuntimeError as exc:
        if _timed_out(exc):
            raise WeightSyncTimeoutError(
                f"Weight transfer: the group at {host}:{port} did not form within {timeout_s:g}s ({exc}).",
                stage="join",
            ) from exc
        raise WeightUpdateError(f"Weight transfer: could not form the group at {host}:{port}: {exc}") from exc
    return store, group
