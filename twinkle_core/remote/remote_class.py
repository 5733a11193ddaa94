"""``@remote_class``: run instances of your own class as Ray replicas, like a remote sampler.

::

    @remote_class
    class RewardModel:
        def __init__(self, path): ...

        @dispatch("split")
        def score(self, texts): ...          # each replica scores its share; results joined in order

        def reload(self, path): ...          # default "all": every replica, a list of their results

    rm = RewardModel("/models/rm", remote_group="sampler", device_mesh=DeviceMesh.from_sizes(dp_size=2))
    rm.score(texts)                          # runs in the actors

Without ``remote_group`` (or in ``"local"`` mode) the class is built in
process, exactly as if undecorated.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from twinkle_core.errors import InvalidInputError, InvalidMeshError
from twinkle_core.mesh import DeviceGroup, DeviceMesh
from twinkle_core.remote._runtime import PlacedGroup, current_session, get_group, register_owner

if TYPE_CHECKING:  # pragma: no cover
    from twinkle_core.engine import Engine
    from twinkle_core.remote._pool import ReplicaInfo, ReplicaPool

__all__ = ["DISPATCH_MODES", "RemoteObject", "dispatch", "remote_class"]

DispatchMode = Literal["all", "split", "one"]
#: ``"all"``: every replica runs the call, the result is the list of their results (by replica).
#: ``"split"``: the first argument (a sequence) is cut into contiguous, near-equal parts, one per
#: replica; each part's result must be a sequence; the results are joined in input order.
#: ``"one"``: one replica (round-robin) runs the call; the result is its result.
DISPATCH_MODES: tuple[str, ...] = ("all", "split", "one")
_ATTR = "__twinkle_dispatch__"

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)


def _coerce_mesh(value: Any) -> DeviceMesh:
    if value is None:
        return DeviceMesh()
    if isinstance(value, DeviceMesh):
        return value
    if isinstance(value, Mapping):
        return DeviceMesh(**value)
    raise InvalidMeshError(
        f"device_mesh={value!r} is invalid: expected a DeviceMesh, e.g. DeviceMesh.from_sizes(dp_size=2)."
    )


def held_engine(cls: type, args: tuple[Any, ...]) -> type[Engine] | None:
    """The ``Engine`` class a sampler class builds, or ``None`` (any other class or call).

    It is the first argument of ``Sampler(SomeEngine, ...)``, or the
    ``engine_class`` of a named sampler (``TorchSampler``, a
    ``twinkle_core.factory.NamedSampler``).
    """
    from twinkle_core.engine import Engine
    from twinkle_core.sampler import Sampler

    if not (isinstance(cls, type) and issubclass(cls, Sampler)):
        return None
    for candidate in (getattr(cls, "engine_class", None), args[0] if args else None):
        if isinstance(candidate, type) and issubclass(candidate, Engine):
            return candidate
    return None


def split_mesh(
    cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[DeviceMesh, tuple[Any, ...], dict[str, Any]]:
    """Take the layout out of a constructor call; return it with the arguments each replica gets.

    The constructor arguments are checked against the signature here, in the
    driver, so a typo fails before any actor starts. If the class takes a
    ``device_mesh`` parameter, each replica gets
    ``DeviceMesh(dp_size=1, tp_size=mesh.tp_size)`` in its place; otherwise
    ``device_mesh`` is only the layout and is not passed on.
    """
    engine = held_engine(cls, args)
    if engine is not None and args and args[0] is engine:
        # ``Sampler(SomeEngine, ...)``: the arguments are the engine's, after its context
        mesh, engine_args, engine_kwargs = _split_by(engine.__init__, 2, args[1:], kwargs)
        return mesh, (engine, *engine_args), engine_kwargs
    if engine is not None:  # a named sampler: its arguments are its engine's
        return _split_by(engine.__init__, 2, args, kwargs)
    return _split_by(cls.__init__, 1, args, kwargs)  # type: ignore[misc]


def _split_by(
    init: Any, skip: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[DeviceMesh, tuple[Any, ...], dict[str, Any]]:
    try:
        sig = inspect.signature(init)
        params = list(sig.parameters.values())[skip:]  # drop self (and an engine's context)
        sig = sig.replace(parameters=params)
    except (TypeError, ValueError):  # no introspectable signature: pass arguments through
        kwargs = dict(kwargs)
        mesh = _coerce_mesh(kwargs.pop("device_mesh", None))
        return mesh, args, kwargs
    param = sig.parameters.get("device_mesh")
    takes_mesh = param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
    if not takes_mesh:
        kwargs = dict(kwargs)
        raw = kwargs.pop("device_mesh", None)
        sig.bind(*args, **kwargs)
        return _coerce_mesh(raw), args, kwargs
    bound = sig.bind(*args, **kwargs)
    mesh = _coerce_mesh(bound.arguments.get("device_mesh"))
    bound.arguments["device_mesh"] = DeviceMesh.from_sizes(dp_size=1, tp_size=mesh.tp_size)
    return mesh, tuple(bound.args), dict(bound.kwargs)


def build_object(
    cls: type,
    remote_group: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    remote_type: Callable[..., Any] | None = None,
) -> Any:
    """What ``cls(*args, remote_group=..., **kwargs)`` returns.

    Replicas in ``"ray"`` mode (a ``remote_type``, :class:`RemoteObject` by
    default; ``RemoteSampler`` for a sampler); else the object itself, built here.

    Raises:
        UnknownGroupError: the group was never initialised.
        InvalidMeshError: the mesh does not fit the group.
        TypeError: the arguments do not fit the constructor.
    """
    placed = get_group(remote_group)
    session = current_session()
    mesh, actor_args, actor_kwargs = split_mesh(cls, args, kwargs)
    if session is None or session.mode == "local":
        placed.group.check_mesh(mesh)
        return cls(*args, **kwargs)
    return (remote_type or RemoteObject)(cls, actor_args, actor_kwargs, placed=placed, mesh=mesh)


def dispatch(mode: DispatchMode) -> Callable[[F], F]:
    """Mark how a method of a ``@remote_class`` runs on the replicas (default ``"all"``).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in DISPATCH_MODES:
        raise ValueError(f"dispatch({mode!r}) is invalid: expected one of {', '.join(DISPATCH_MODES)}.")

    def mark(fn: F) -> F:
        setattr(fn, _ATTR, mode)
        return fn

    return mark


def remote_class(cls: C) -> C:
    """Let ``cls(..., remote_group="name", device_mesh=...)`` build ``dp_size`` Ray replicas of it.

    The class is returned itself (still picklable, still subclassable): its
    constructor learns the ``remote_group`` keyword, and with it returns a
    :class:`RemoteObject` whose public methods run in the replicas, as
    :func:`dispatch` marks them. Samplers need no decorator: a named sampler
    takes ``remote_group`` already, and ``create_sampler(..., remote_group=)``
    builds any other.
    """
    from twinkle_core.sampler import Sampler

    if not isinstance(cls, type):
        raise TypeError(f"@remote_class decorates a class, not {cls!r}.")
    if issubclass(cls, Sampler):
        if held_engine(cls, ()) is None:
            raise TypeError(
                f"@remote_class on {cls.__name__}: a sampler runs as replicas through its engine. Build it with"
                " twinkle_core.create_sampler(YourEngine, ..., remote_group=...), or name it as a"
                " twinkle_core.NamedSampler (engine_class = YourEngine), which takes remote_group= itself."
            )
        return cls
    if getattr(cls, "__twinkle_remote__", False) is cls:
        return cls
    original_new = cls.__new__
    original_init = cls.__init__

    def __new__(klass: type, *args: Any, remote_group: str | None = None, **kwargs: Any) -> Any:
        if remote_group is not None:
            return build_object(klass, remote_group, args, kwargs)
        if original_new is object.__new__:
            return object.__new__(klass)
        return original_new(klass, *args, **kwargs)

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, remote_group: str | None = None, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)

    cls.__new__ = __new__  # type: ignore[method-assign,assignment]
    cls.__init__ = __init__  # type: ignore[method-assign]
    cls.__twinkle_remote__ = cls  # type: ignore[attr-defined]
    return cls


class ReplicaViews:
    """What a remote front end (a ``RemoteObject``, a ``RemoteSampler``) tells about its replicas.

    Mixed into a class that keeps its replicas in a ``ReplicaPool`` as ``self._pool``.
    """

    _pool: ReplicaPool

    @property
    def replicas(self) -> list[ReplicaInfo]:
        """Each replica: actor id, bundles, process, node, restarts, whether in service."""
        return self._pool.infos()

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles by replica index (``None`` for a lost replica)."""
        return self._pool.actors()

    @property
    def num_replicas(self) -> int:
        """Replicas in service."""
        return len(self._pool.alive())


class RemoteObject(ReplicaViews):
    """The driver's handle on the replicas of a ``@remote_class`` object.

    Public methods of the class are called on the replicas, as
    :func:`dispatch` marks them; exceptions come back as their own type with
    the replica named. A replica that dies is rebuilt with the constructor
    arguments (state set by earlier calls is not replayed) and the
    interrupted call is retried once. ``close()`` calls the object's own
    ``close()`` on every replica if it has one, then stops the actors.

    Attributes:
        target_class: the decorated class.
        device_mesh: the layout.
        group: the device group.
    """

    def __init__(
        self,
        target_class: type,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        placed: PlacedGroup,
        mesh: DeviceMesh,
    ) -> None:
        from twinkle_core.remote._pool import ReplicaPool

        self.target_class = target_class
        self.device_mesh = mesh
        self.group: DeviceGroup = placed.group
        self._pool = ReplicaPool(
            target_class,
            args,
            kwargs,
            placed=placed,
            mesh=mesh,
            label=f"{target_class.__name__} on group {placed.name!r}",
            max_concurrency=int(getattr(target_class, "remote_max_concurrency", 1)),
        )
        self._pool.start()
        register_owner(self)

    def __repr__(self) -> str:
        return (
            f"RemoteObject({self.target_class.__name__}, group={self.group.name!r},"
            f" dp_size={self.device_mesh.dp_size}, tp_size={self.device_mesh.tp_size})"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        member = getattr(self.target_class, name, None)
        if not callable(member) or isinstance(member, type):
            raise AttributeError(
                f"{self.target_class.__name__}.{name} is not a method; a remote object exposes its public methods"
                " only (add a method that returns the value)."
            )
        mode = getattr(member, _ATTR, "all")

        @functools.wraps(member)
        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(name, mode, args, kwargs)

        return call

    def _call(self, name: str, mode: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        pool = self._pool
        if mode == "one":
            return pool.run(pool.pick(), "call", name, *args, **kwargs)
        if mode == "all":
            return pool.broadcast("call", name, *args, **kwargs)
        if not args or not isinstance(args[0], Sequence) or isinstance(args[0], (str, bytes)):
            raise InvalidInputError(
                f"{self.target_class.__name__}.{name} is dispatched 'split': its first argument must be a list"
                f" (or another sequence) to share out, got {type(args[0]).__name__ if args else 'nothing'}."
            )
        from twinkle_core.remote._pool import split_evenly

        data, rest = args[0], args[1:]
        pool.check_open()
        alive = pool.alive()
        parts = split_evenly(data, len(alive))
        jobs = []
        for replica, indices in zip(alive, parts):
            if indices:
                call_args = ("call", name, [data[i] for i in indices], *rest)
                jobs.append((call_args, replica, pool.submit(replica, *call_args, **kwargs)))
        results = [pool.finish(replica, submitted, *call_args, **kwargs) for call_args, replica, submitted in jobs]
        return list(itertools.chain.from_iterable(results))

    def close(self) -> None:
        """Close the object on every replica (if it has ``close()``), stop the actors, free the devices."""
        self._pool.close()

    def __enter__(self) -> RemoteObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self._pool.close()
        except Exception:
            pass
