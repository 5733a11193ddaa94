"""A pool of Ray actors, one per data-parallel replica: start, call, unwrap errors, restart.

Used by ``RemoteSampler`` and by ``@remote_class`` objects alike. A replica
that dies is rebuilt from the same class and arguments on the same bundles,
its recorded state is replayed (the ``replay`` callback), and only then does
it take work again.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from twinkle_core.mesh import DeviceMesh
from twinkle_core.remote._host import ReplicaContext, ReplicaHost
from twinkle_core.remote._runtime import PlacedGroup, current_session, import_ray
from twinkle_core.remote.errors import RemoteError, RemoteTraceback, ReplicaLostError

__all__ = ["Op", "ReplicaInfo", "ReplicaPool"]

#: A recorded state change, replayed on a restarted replica: (method, args, kwargs).
Op = tuple[str, tuple[Any, ...], dict[str, Any]]

_START_TIMEOUT_ENV = "TWINKLE_REMOTE_START_TIMEOUT_S"
_CLOSE_TIMEOUT_S = 60.0

_remote_host_cls: Any = None
_remote_host_lock = threading.Lock()


def _host_actor_class() -> Any:
    global _remote_host_cls
    with _remote_host_lock:
        if _remote_host_cls is None:
            _remote_host_cls = import_ray().remote(ReplicaHost)
        return _remote_host_cls


def _start_timeout() -> float:
    raw = os.environ.get(_START_TIMEOUT_ENV, "1800")
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        from twinkle_core.errors import ConfigError

        raise ConfigError(f"{_START_TIMEOUT_ENV}={raw!r} is invalid: expected a number of seconds > 0.")
    return value


@attrs.frozen
class ReplicaInfo:
    """One replica as ``RemoteSampler.replicas`` shows it.

    Attributes:
        index: its index (0 .. dp_size - 1).
        actor_id: the Ray actor id (it changes when the replica is restarted).
        bundles: its bundles in the group's placement group.
        pid: the actor's process id.
        node_id: the Ray node it runs on.
        restarts: how many times it was restarted after dying.
        alive: ``False`` once it died and could not be restarted.
    """

    index: int
    actor_id: str
    bundles: tuple[int, ...]
    pid: int | None
    node_id: str | None
    restarts: int
    alive: bool


@attrs.define(eq=False)
class _Replica:
    index: int
    bundles: list[int]
    actor: Any = None
    info: dict[str, Any] = attrs.field(factory=dict)
    incarnation: int = 0
    restarts: int = 0
    lost: bool = False
    lock: threading.Lock = attrs.field(factory=threading.Lock)

    @property
    def actor_id(self) -> str:
        return self.actor._actor_id.hex() if self.actor is not None else "-"


class _Died(Exception):
    """Internal: the replica's actor died while serving a call."""

    def __init__(self, replica: int, incarnation: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.replica = replica
        self.incarnation = incarnation
        self.cause = cause


class ReplicaPool:
    """``mesh.dp_size`` actors on bundles of a placed group, each hosting ``target_cls(*args, **kwargs)``.

    Args:
        target_cls: the class each replica builds.
        args, kwargs: its constructor arguments (the same for every replica).
        placed: the group the replicas are placed on.
        mesh: the layout (``dp_size`` replicas of ``tp_size`` devices).
        label: how messages name the pool (``"TorchSampler on 'sampler'"``).
        max_concurrency: calls one actor serves at once (threads).
        replay: returns the state changes to re-apply on a restarted replica,
            and the weights version it must end up with.
        on_replayed: gets what the replica's replay returned (the copies it now holds).
    """

    def __init__(
        self,
        target_cls: type,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        placed: PlacedGroup,
        mesh: DeviceMesh,
        label: str,
        max_concurrency: int = 1,
        replay: Callable[[], tuple[list[Op], int | None]] | None = None,
        on_replayed: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.target_cls = target_cls
        self.args = args
        self.kwargs = kwargs
        self.placed = placed
        self.mesh = mesh
        self.label = label
        self.max_concurrency = max_concurrency
        self._replay = replay
        self._on_replayed = on_replayed
        self._replicas: list[_Replica] = []
        self._closed = False
        self._rr = 0
        self._lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Take bundles, start every actor, and wait until each has built its object.

        Raises:
            InvalidMeshError: the mesh does not fit the group's free devices.
            Exception: a replica's constructor error, as its own type, naming the replica.
        """
        import_ray()  # fails early, with the install hint, when Ray is missing
        sets = self.placed.take(self.mesh, owner=self.label)
        self._replicas = [_Replica(i, s) for i, s in enumerate(sets)]
        try:
            for r in self._replicas:
                r.actor = self._spawn(r)
            refs = [r.actor.ready.remote() for r in self._replicas]
            for r, ref in zip(self._replicas, refs):
                r.info = self._get(r, ref, what="start", timeout=_start_timeout())
        except BaseException:
            self._kill_all(graceful=True)
            raise

    def _spawn(self, r: _Replica) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = self.placed.group
        tp = self.mesh.tp_size
        context = ReplicaContext(
            index=r.index,
            num_replicas=len(self._replicas),
            group=group.name,
            device_type=group.device_type,
            tp_size=tp,
            bundle_indices=tuple(r.bundles),
            placement_group=self.placed.placement_group,
        )
        # With tp_size > 1 the engine starts its own workers, one per bundle, and they take the GPUs.
        num_gpus = 1 if group.device_type == "cuda" and tp == 1 else 0
        options: dict[str, Any] = dict(
            num_cpus=group.cpus_per_rank,
            num_gpus=num_gpus,
            max_concurrency=self.max_concurrency,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placed.placement_group,
                placement_group_bundle_index=r.bundles[0],
                placement_group_capture_child_tasks=True,
            ),
        )
        session = current_session()
        niceness = session.replica_niceness if session is not None else None
        if niceness is not None:
            # Ray lowers its workers' priority (niceness 15); a replica is the main work, not background work.
            options["runtime_env"] = {"env_vars": {"RAY_worker_niceness": str(niceness)}}
        return _host_actor_class().options(**options).remote(self.target_cls, self.args, self.kwargs, context)

    def close(self) -> None:
        """Close every replica's object, kill the actors and give the bundles back. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._kill_all(graceful=True)

    def _kill_all(self, graceful: bool) -> None:
        try:
            ray = import_ray()
            if not ray.is_initialized():
                return
            live = [r for r in self._replicas if r.actor is not None and not r.lost]
            if graceful and live:
                ray.wait([r.actor.close.remote() for r in live], num_returns=len(live), timeout=_CLOSE_TIMEOUT_S)
            for r in self._replicas:
                if r.actor is not None:
                    try:
                        ray.kill(r.actor)
                    except Exception:
                        pass
                    r.actor = None
        finally:
            self.placed.release(b for r in self._replicas for b in r.bundles)

    # -- state -----------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def size(self) -> int:
        """Number of replicas (``dp_size``), lost ones included."""
        return len(self._replicas)

    def alive(self) -> list[int]:
        """Indices of replicas in service."""
        return [r.index for r in self._replicas if not r.lost]

    def infos(self) -> list[ReplicaInfo]:
        return [
            ReplicaInfo(
                r.index, r.actor_id, tuple(r.bundles), r.info.get("pid"), r.info.get("node_id"), r.restarts, not r.lost
            )
            for r in self._replicas
        ]

    def actors(self) -> list[Any]:
        """The Ray actor handles, by replica index (``None`` for a lost replica)."""
        return [None if r.lost else r.actor for r in self._replicas]

    def first_info(self) -> dict[str, Any]:
        return self._replicas[self.alive()[0]].info if self.alive() else {}

    def where(self, index: int) -> str:
        r = self._replicas[index]
        return f"replica {index} (actor {r.actor_id}) of {self.label}"

    # -- calls -----------------------------------------------------------------------------
    def check_open(self) -> None:
        if self._closed:
            from twinkle_core.errors import SamplerClosedError

            raise SamplerClosedError(f"{self.label} is closed; create a new one.")
        if not self.alive():
            raise ReplicaLostError(
                f"Every replica of {self.label} died and could not be restarted; close it and create a new one.",
                replica=-1,
                survivors=0,
            )

    def submit(self, index: int, method: str, *args: Any, **kwargs: Any) -> tuple[int, Any]:
        """Start ``host.method(*args, **kwargs)`` on a replica; returns (incarnation, ref) for :meth:`result`."""
        self.check_open()
        r = self._replicas[index]
        if r.lost:
            raise ReplicaLostError(
                f"{self.where(index)} is out of service.", replica=index, survivors=len(self.alive())
            )
        return r.incarnation, getattr(r.actor, method).remote(*args, **kwargs)

    def stream(self, index: int, method: str, *args: Any) -> tuple[int, Any]:
        """Start a generator method of the host on a replica; returns (incarnation, Ray object-ref generator).

        Read each item with :meth:`result` (``next`` on the generator may itself raise what ``result`` does).
        """
        self.check_open()
        r = self._replicas[index]
        if r.lost:
            raise ReplicaLostError(
                f"{self.where(index)} is out of service.", replica=index, survivors=len(self.alive())
            )
        return r.incarnation, getattr(r.actor, method).options(num_returns="streaming").remote(*args)

    def call_nowait(self, index: int, method: str, *args: Any) -> None:
        """Send ``host.method(*args)`` to a replica without waiting (a lost or dead replica is skipped)."""
        r = self._replicas[index]
        if r.lost or r.actor is None:
            return
        try:
            getattr(r.actor, method).remote(*args)
        except Exception:  # the actor is gone: nothing to stop there
            pass

    def result(self, index: int, incarnation: int, ref: Any) -> Any:
        """The value of a submitted call.

        Raises:
            _Died: the actor died (callers recover and retry).
            Exception: what the replica raised, as its own type, naming the replica.
        """
        ray = import_ray()
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            raise _Died(index, incarnation, exc) from exc
        except ray.exceptions.RayTaskError as exc:
            raise _unwrap(exc, self.where(index))  # noqa: B904 - its cause is the remote traceback

    def finish(self, index: int, submitted: tuple[int, Any], method: str, *args: Any, **kwargs: Any) -> Any:
        """The value of a call made with :meth:`submit`; if the actor died, restart it and retry the call once.

        Raises:
            ReplicaLostError: the replica could not be restarted.
            RemoteError: it died again during the retry.
        """
        try:
            return self.result(index, *submitted)
        except _Died as died:
            self.recover(died)
        retry = self.submit(index, method, *args, **kwargs)
        try:
            return self.result(index, *retry)
        except _Died as again:
            raise self.died_twice(again) from again.cause

    def _get(self, r: _Replica, ref: Any, *, what: str, timeout: float | None = None) -> Any:
        ray = import_ray()
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError as exc:
            raise RemoteError(
                f"{self.where(r.index)} did not finish its {what} within {timeout:g}s (set {_START_TIMEOUT_ENV}"
                " to wait longer)."
            ) from exc
        except ray.exceptions.RayTaskError as exc:
            raise _unwrap(exc, self.where(r.index))  # noqa: B904
        except ray.exceptions.RayActorError as exc:
            raise RemoteError(f"{self.where(r.index)} died during its {what}: {exc}") from exc

    def run(self, index: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a host method on one replica and wait; a death restarts it and retries the call once."""
        return self.finish(index, self.submit(index, method, *args, **kwargs), method, *args, **kwargs)

    def broadcast_collect(
        self, method: str, *args: Any, **kwargs: Any
    ) -> tuple[dict[int, Any], dict[int, BaseException]]:
        """Call a host method on every replica in service, concurrently, and wait for all of them.

        Returns:
            The values and the errors, by replica index.
        """
        self.check_open()
        pending = {i: self.submit(i, method, *args, **kwargs) for i in self.alive()}
        values: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        for i, submitted in pending.items():
            try:
                values[i] = self.finish(i, submitted, method, *args, **kwargs)
            except Exception as exc:
                errors[i] = exc
        return values, errors

    def broadcast(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call a host method on every replica in service; their values by replica.

        Every replica is waited for before an error is raised (the lowest
        replica's), so none is left half-way when the call returns.
        """
        values, errors = self.broadcast_collect(method, *args, **kwargs)
        if errors:
            first = errors[min(errors)]
            if values:
                add_note(
                    first,
                    f"Replicas {sorted(values)} of {self.label} completed the call; replicas {sorted(errors)} failed.",
                )
            raise first
        return [values[i] for i in sorted(values)]

    def pick(self) -> int:
        """A replica in service, round-robin."""
        self.check_open()
        alive = self.alive()
        with self._lock:
            self._rr += 1
            return alive[self._rr % len(alive)]

    # -- recovery --------------------------------------------------------------------------
    def recover(self, died: _Died) -> None:
        """Restart a dead replica (unless another thread already did) and replay its state.

        Raises:
            ReplicaLostError: it could not be restarted; it is taken out of service.
        """
        ray = import_ray()
        r = self._replicas[died.replica]
        with r.lock:
            if r.lost:
                raise ReplicaLostError(
                    f"{self.where(r.index)} is out of service.", replica=r.index, survivors=len(self.alive())
                )
            if r.incarnation != died.incarnation or self._closed:
                return  # already restarted by another call
            old_id = r.actor_id
            try:
                ray.kill(r.actor)
            except Exception:
                pass
            new = None
            try:
                new = self._spawn(r)
                info = self._get(r, new.ready.remote(), what="restart", timeout=_start_timeout())
                ops, version = self._replay() if self._replay is not None else ([], None)
                if ops or version:
                    kept = self._get(r, new.replay.remote(ops, version), what="state replay", timeout=_start_timeout())
                    if self._on_replayed is not None and kept:
                        self._on_replayed(kept)
            except BaseException as exc:
                if new is not None:
                    try:
                        ray.kill(new)
                    except Exception:
                        pass
                r.lost = True
                r.actor = None
                self.placed.release(r.bundles)
                survivors = len(self.alive())
                tail = (
                    f"It is out of service; the {survivors} surviving replica(s) keep serving, so calling again works."
                    if survivors
                    else "No replica is left: close this object and create a new one."
                )
                how = "died" if isinstance(died.cause, ray.exceptions.RayActorError) else "was out of step"
                raise ReplicaLostError(
                    f"Replica {r.index} (actor {old_id}) of {self.label} {how} ({type(died.cause).__name__}) and could"
                    f" not be restarted: {type(exc).__name__}: {exc}. {tail}",
                    replica=r.index,
                    survivors=survivors,
                ) from exc
            r.actor = new
            r.info = info
            r.incarnation += 1
            r.restarts += 1

    def restart(self, index: int, reason: BaseException) -> None:
        """Rebuild a replica that is alive but out of step (e.g. it failed an update the others applied).

        Raises:
            ReplicaLostError: it could not be restarted.
        """
        self.recover(_Died(index, self._replicas[index].incarnation, reason))

    def died_twice(self, died: _Died) -> RemoteError:
        """The error for a call whose replica died again on its retry (the replica is restarted once more)."""
        try:
            self.recover(died)  # leave the pool healthy for the next call
        except ReplicaLostError as lost:
            return lost
        return RemoteError(
            f"Replica {died.replica} of {self.label} died again while retrying the interrupted call"
            f" ({type(died.cause).__name__}); it was restarted, but this call failed. The work may be killing it."
        )


def _unwrap(exc: Any, where: str) -> BaseException:
    """The original exception of a ``RayTaskError``, with the replica named and the remote traceback chained."""
    from ray.exceptions import RayError

    cause = getattr(exc, "cause", None)
    tb = getattr(exc, "traceback_str", "") or str(exc)
    if isinstance(cause, BaseException) and not isinstance(cause, RayError):
        cause.__cause__ = RemoteTraceback(tb)
        cause.__suppress_context__ = True
        add_note(cause, f"Raised in {where}; its traceback is above.")
        return cause
    return RemoteError(f"{where} raised {type(cause).__name__ if cause else 'an error'}:\n{tb}")


def split_evenly(items: Sequence[Any], parts: int) -> list[list[int]]:
    """Contiguous index ranges of near-equal size (the first ones one longer)."""
    n = len(items)
    base, extra = divmod(n, parts)
    out, start = [], 0
    for p in range(parts):
        size = base + (1 if p < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, which Python 3.10 lacks (there the note is kept in ``__notes__``, not shown)."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]  # 3.11 declares it
