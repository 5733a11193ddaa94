"""What runs inside each Ray actor: the host of one replica (an engine, or a ``@remote_class`` object).

One generic actor class serves every engine: the driver sends the class and
its constructor arguments, and the host builds the object in the actor
process. Ray is imported lazily, so importing this module costs nothing.
"""

from __future__ import annotations

import copyreg
import functools
import os
import pickle
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import attrs

from twinkle_core import placement
from twinkle_core.data_format import SampledSequence, SampleResponse, SamplingParams
from twinkle_core.placement import ReplicaContext, current_replica
from twinkle_core.remote._media import shed_prompt_media

__all__ = ["ReplayCopies", "ReplicaContext", "ReplicaHost", "current_replica"]


class ReplayCopies:
    """Copies of one value held by different replicas (object refs): a rebuilt replica reads the first still held.

    A collective weight update leaves no copy with the driver; each replica
    that applied it keeps one in its own node's object store, owned by that
    replica, so it is lost with that replica but not with the others.
    """

    def __init__(self, refs: list[Any]) -> None:
        self.refs = list(refs)
        self.key = uuid.uuid4().hex  # names it across pickling: a rebuilt replica's own copy joins the list

    @staticmethod
    def unpack(buckets: Any) -> list[tuple[str, Any]]:
        """The tensors of a resolved copy (it holds the received buckets, each pickled once)."""
        from twinkle_core.transport.collective import unpack

        return unpack(buckets)

    def resolve(self) -> Any:
        """The first copy still held (the received buckets)."""
        import ray

        last: BaseException | None = None
        for ref in list(self.refs):
            try:
                return ray.get(ref)
            except (ray.exceptions.ObjectLostError, ray.exceptions.OwnerDiedError, ray.exceptions.RayActorError) as exc:
                last = exc
        raise RuntimeError(f"every replica holding this update's copy is gone: {last}") from last


#: Calls that bring a model's worth of tensors in and drop them: the freed memory goes back to the OS after.
_BULKY_CALLS = frozenset({"update_weights", "add_adapter_to_model"})


def _release_freed_memory() -> None:
    """Give freed heap memory back to the OS (glibc's ``malloc_trim``; nothing elsewhere).

    A replica's calls run on a pool of threads, each with its own malloc
    arena; the tensors an update deserialises are freed into that arena and
    stay resident, so without this a replica's memory grew by about one model
    per update (0.8 GB per SmolLM2 update, bench/bench_transport.py's set-up).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


#: How many aborts of shares not started yet a replica remembers (an abort can overtake its share).
_EARLY_ABORTS_KEPT = 4096
F = TypeVar("F", bound=Callable[..., Any])


def _rebuild_exception(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


def _reduce_exception(exc: BaseException) -> tuple[Any, ...]:
    return _rebuild_exception, (type(exc), exc.args, dict(exc.__dict__))


def _make_picklable(exc: BaseException) -> None:
    """Make ``exc`` survive the trip to the driver.

    Exceptions whose ``__init__`` takes keyword-only arguments (such as
    ``PromptTooLongError``) pickle but cannot be unpickled; for those, a
    reducer that restores ``args`` and attributes without calling
    ``__init__`` is registered, so the driver still gets the original type.
    """
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        copyreg.pickle(type(exc), _reduce_exception)


def _portable_errors(method: F) -> F:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except BaseException as exc:
            _make_picklable(exc)
            raise

    return wrapper  # type: ignore[return-value]


class ReplicaHost:
    """Builds one object from its class and arguments, and serves the driver's calls on it.

    A constructor error is kept and re-raised by :meth:`ready`, so it reaches
    the driver as its own type (Ray would otherwise turn it into a bare
    ``ActorDiedError``).
    """

    def __init__(
        self, target_cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], context: ReplicaContext
    ) -> None:
        placement.enter_replica(context)
        os.environ["TWINKLE_REPLICA_INDEX"] = str(context.index)
        if context.tp_size > 1:
            # vLLM's Ray executor places its tensor-parallel workers on these bundles.
            os.environ.setdefault("VLLM_RAY_BUNDLE_INDICES", ",".join(map(str, context.bundle_indices)))
        self._error: BaseException | None = None
        self._target: Any = None
        # shares of calls in flight (stream_shard), by the driver's id, so abort_shard can stop them
        self._shards: dict[str, Any] = {}
        self._early_aborts: dict[str, None] = {}
        self._shards_lock = threading.Lock()
        try:
            self._target = target_cls(*args, **kwargs)
        except BaseException as exc:  # re-raised by ready()
            self._error = exc

    @_portable_errors
    def ready(self) -> dict[str, Any]:
        """Where this replica runs, and what the driver caches about its engine."""
        if self._error is not None:
            raise self._error
        import socket

        import ray

        info: dict[str, Any] = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "node_id": ray.get_runtime_context().get_node_id(),
        }
        from twinkle_core.sampler import Sampler

        if isinstance(self._target, Sampler):
            engine = self._target.engine
            info.update(
                max_model_len=self._target.max_model_len,
                vocab_size=self._target.vocab_size,
                engine_name=self._target.engine_name,
                supported_params=sorted(self._target.supported_params),
                weights_dtype=engine.info.weights_dtype,
                weights_version=self._target.weights_version,
                media=sorted(engine.info.media),
                # the engine's own limits, so the driver checks prompts as the replica would
                max_prompt_len={
                    "score": engine.max_prompt_len(SamplingParams(max_tokens=0)),
                    "generate": engine.max_prompt_len(SamplingParams(max_tokens=1)),
                },
            )
        return info

    @_portable_errors
    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``target.method(*args, **kwargs)`` (object refs among the top-level args arrive resolved)."""
        try:
            return getattr(self._target, method)(*args, **kwargs)
        finally:
            if method in _BULKY_CALLS:
                _release_freed_memory()

    @_portable_errors
    def get(self, name: str) -> Any:
        """Read an attribute of the target."""
        return getattr(self._target, name)

    @_portable_errors
    def replay(
        self, ops: list[tuple[str, tuple[Any, ...], dict[str, Any]]], weights_version: int | None = None
    ) -> dict[str, Any]:
        """Re-apply recorded state changes in order (refs inside them are fetched here).

        ``weights_version``: the version the other replicas carry; a rebuilt
        engine takes it even when the change that set it (say, an adapter
        added then removed) left nothing to replay.

        Returns:
            For each :class:`ReplayCopies` replayed, by its key, a copy this
            replica now holds too (so the update outlives the replicas that
            first applied it).
        """
        import ray

        kept: dict[str, Any] = {}

        def resolve(value: Any) -> Any:
            if isinstance(value, ReplayCopies):
                buckets = value.resolve()
                kept[value.key] = ray.put(buckets)
                return value.unpack(buckets)
            return ray.get(value) if isinstance(value, ray.ObjectRef) else value

        for method, args, kwargs in ops:
            getattr(self._target, method)(*map(resolve, args), **{k: resolve(v) for k, v in kwargs.items()})
        from twinkle_core.sampler import Sampler

        if weights_version is not None and isinstance(self._target, Sampler):
            self._target._restore_version(weights_version)
        _release_freed_memory()
        return kept

    @_portable_errors
    def receive_weights(self, spec: Any, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Receive a collective update as ``rank`` of its chain, check it, apply it, keep a copy.

        ``method`` is ``"update_weights"`` (the tensors go first) or
        ``"add_adapter_to_model"`` (they go as ``weights=``).

        Returns:
            ``{"aborted": why}`` when the sender gave up (nothing changed),
            else ``{"copy": [ref]}``: the copy, in this node's object store,
            is what a rebuilt replica replays.

        Raises:
            WeightUpdateError: a bucket arrived corrupted, or the engine
                refused the update; nothing was applied.
            WeightSyncTimeoutError: the stream stalled.
        """
        import ray

        from twinkle_core.transport.collective import TransferAborted, receive, unpack

        try:
            buckets, _checksums, _forwarded = receive(spec, rank)
        except TransferAborted as exc:
            return {"aborted": str(exc)}
        try:
            self._apply_tensors(unpack(buckets), method, args, kwargs)
            return {"copy": [ray.put(buckets)]}
        finally:
            del buckets
            _release_freed_memory()

    def _apply_tensors(self, named: Any, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if method == "update_weights":
            self._target.update_weights(named, *args, **kwargs)
        elif method == "add_adapter_to_model":
            self._target.add_adapter_to_model(*args, weights=named, **kwargs)
        else:
            raise ValueError(f"receive_weights: {method!r} takes no tensors")

    @_portable_errors
    def apply_copy(self, copies: ReplayCopies, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Apply a collective update from a copy other replicas hold; keep a copy here too (its ref, in a list)."""
        import ray

        buckets = copies.resolve()
        try:
            self._apply_tensors(copies.unpack(buckets), method, args, kwargs)
            return [ray.put(buckets)]
        finally:
            del buckets
            _release_freed_memory()

    @_portable_errors
    def abort_shard(self, shard_id: str) -> None:
        """Stop a share started by :meth:`stream_shard` (harmless if it finished, or has not started yet)."""
        with self._shards_lock:
            handle = self._shards.get(shard_id)
            if handle is None:
                # it has not started here yet (calls on a threaded actor run in any order): abort it when it does
                self._early_aborts[shard_id] = None
                while len(self._early_aborts) > _EARLY_ABORTS_KEPT:
                    del self._early_aborts[next(iter(self._early_aborts))]
                return
        handle.abort()

    def stream_shard(
        self,
        shard_id: str,
        items: list[Any],
        indices: list[int],
        params: SamplingParams,
        adapter_name: str,
        on_invalid: str,
        cont: tuple[list[int], list[int], list[int]] | None,
    ) -> Iterator[tuple[int, int, SampledSequence, bool] | list[SampleResponse]]:
        """Run this replica's share of a call, yielding each sequence as it finishes, then the prompts' scores.

        A Ray streaming generator: the driver reads ``(input, sample,
        sequence, shed)`` items (``input`` counts within ``items``) while the engine
        runs, and then the list of responses without their sequences (each
        sequence crosses once, as it finishes: the driver assembles). ``shed``:
        the sequence comes without its prompt's media, which the driver holds
        (:mod:`twinkle_core.remote._media`). ``cont``: the share is a
        continuation; per item, its sample index, the tokens it generated
        before, and its token budget (the driver merges each with its first
        part). :meth:`abort_shard` stops it.
        """
        from twinkle_core.requests import CallFeed
        from twinkle_core.sampler.continuation import RunSpec

        feed = CallFeed(len(items), params.num_samples)
        handle = feed.handle
        with self._shards_lock:
            self._shards[shard_id] = handle
            if shard_id in self._early_aborts:
                del self._early_aborts[shard_id]
                handle.abort()
        target = self._target
        spec = None if cont is None else RunSpec(feed, cont[0], cont[1], cont[2], [], None)

        def work() -> None:
            try:
                responses = target._sample(items, params, adapter_name, on_invalid, indices, feed, spec)
            except BaseException as exc:
                feed.settle(None, exc)
            else:
                feed.settle(responses, None)

        threading.Thread(target=work, name=f"twinkle-shard-{shard_id}", daemon=True).start()
        try:
            for item in handle.as_completed():
                sequence, shed = shed_prompt_media(item.sequence, items[item.input_index])
                yield item.input_index, item.sample_index, sequence, shed
            yield [attrs.evolve(response, sequences=[]) for response in handle.result()]
        except BaseException as exc:
            _make_picklable(exc)
            raise
        finally:
            with self._shards_lock:
                self._shards.pop(shard_id, None)

    def close(self) -> None:
        """Close the target (if it has ``close()``) and drop it; errors are printed, not raised: the actor dies next."""
        close = getattr(self._target, "close", None)
        if callable(close):
            try:
                close()
            except Exception:
                traceback.print_exc()
        # Free it now rather than when Ray stops the process (its SIGTERM handler would interrupt finalizers).
        self._target = None
        import gc

        gc.collect()
