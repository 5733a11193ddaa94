"""The session: ``initialize()``, ``shutdown()`` and the registry of placed device groups.

Nothing here imports Ray at module import time: ``import twinkle_core`` must
stay slim, and ``mode="local"`` never needs Ray at all.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal, Protocol

import attrs

from twinkle_core.errors import ConfigError, InvalidMeshError
from twinkle_core.mesh import DeviceGroup, DeviceMesh
from twinkle_core.remote.errors import RemoteError, UnknownGroupError

__all__ = [
    "PlacedGroup",
    "RemoteSession",
    "current_session",
    "get_group",
    "import_ray",
    "initialize",
    "list_groups",
    "shutdown",
]

Mode = Literal["local", "ray"]
MODES = ("local", "ray")

_lock = threading.RLock()
_session: RemoteSession | None = None
_atexit_registered = False


def import_ray() -> Any:
    """Import Ray, or explain how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise RemoteError(
            'Remote execution needs Ray, which is not installed: pip install "twinkle-core[ray]".'
        ) from exc
    return ray


class _Closable(Protocol):
    def close(self) -> None: ...


@attrs.define(eq=False)
class PlacedGroup:
    """A ``DeviceGroup`` as this session placed it.

    In ``"ray"`` mode it owns a Ray placement group with one bundle per rank
    (``{"GPU": 1, "CPU": cpus_per_rank}`` for CUDA, ``{"CPU": cpus_per_rank}``
    for CPU); samplers built with ``remote_group=`` take bundles from it and
    give them back on ``close()``. In ``"local"`` mode nothing is reserved.

    Attributes:
        group: the group as given to ``initialize``.
        placement_group: the Ray placement group (``None`` in local mode).
        bundle_nodes: the Ray node id of each bundle (``None`` in local mode).
    """

    group: DeviceGroup
    placement_group: Any = None
    bundle_nodes: list[str] | None = None
    _in_use: dict[int, str] = attrs.field(factory=dict)
    _lock: threading.Lock = attrs.field(factory=threading.Lock)

    @property
    def name(self) -> str:
        """The group's name."""
        return self.group.name

    def bundle_resources(self) -> dict[str, float]:
        """The resources of one rank's bundle."""
        resources = {"CPU": float(self.group.cpus_per_rank)}
        if self.group.device_type == "cuda":
            resources["GPU"] = 1.0
        return resources

    @property
    def free(self) -> list[int]:
        """Bundle indices not held by any sampler."""
        with self._lock:
            return [i for i in range(self.group.size) if i not in self._in_use]

    def take(self, mesh: DeviceMesh, owner: str) -> list[list[int]]:
        """Reserve ``mesh.dp_size`` sets of ``mesh.tp_size`` bundles, each set on one node.

        Raises:
            InvalidMeshError: the mesh does not fit the group, or not enough of it is free.
        """
        self.group.check_mesh(mesh)
        if self.placement_group is None:  # local mode: validation only
            return [[] for _ in range(mesh.dp_size)]
        with self._lock:
            free = [i for i in range(self.group.size) if i not in self._in_use]
            if len(free) < mesh.world_size:
                holders = sorted(set(self._in_use.values()))
                raise InvalidMeshError(
                    f"DeviceMesh(dp_size={mesh.dp_size}, tp_size={mesh.tp_size}) needs {mesh.world_size} devices"
                    f" of group {self.name!r}, but only {len(free)} of its {self.group.size} are free (the others"
                    f" are held by {', '.join(holders)}). Close those samplers, or lower dp_size or tp_size."
                )
            by_node: dict[str, list[int]] = {}
            for i in free:
                by_node.setdefault(self.bundle_nodes[i] if self.bundle_nodes else "", []).append(i)
            sets: list[list[int]] = []
            for _ in range(mesh.dp_size):
                # the fullest node that still fits a replica: keeps nodes whole for later samplers
                fits = [n for n, b in by_node.items() if len(b) >= mesh.tp_size]
                if not fits:
                    spread = {n[:8] or "?": len(b) for n, b in by_node.items() if b}
                    raise InvalidMeshError(
                        f"tp_size={mesh.tp_size} needs each replica's devices on one node, but the free devices"
                        f" of group {self.name!r} are spread as {spread} (node: free devices). Lower tp_size, or"
                        " place the group on fewer, larger nodes."
                    )
                node = min(fits, key=lambda n: (len(by_node[n]), n))
                sets.append(by_node[node][: mesh.tp_size])
                del by_node[node][: mesh.tp_size]
            for s in sets:
                for i in s:
                    self._in_use[i] = owner
            return sets

    def release(self, bundles: Iterable[int]) -> None:
        """Give bundles back to the group."""
        with self._lock:
            for i in bundles:
                self._in_use.pop(i, None)


@attrs.define(eq=False)
class RemoteSession:
    """What ``initialize()`` set up; ``shutdown()`` (or leaving a ``with`` block) releases it.

    Attributes:
        mode: ``"local"`` or ``"ray"``.
        address: the Ray address connected to (``None``: a local cluster, or local mode).
        namespace: the Ray namespace.
        owns_ray: whether ``initialize`` started Ray (then ``shutdown`` stops it).
    """

    mode: str
    address: str | None = None
    namespace: str | None = None
    owns_ray: bool = False
    _init_options: dict[str, Any] = attrs.field(factory=dict)
    _groups: dict[str, PlacedGroup] = attrs.field(factory=dict)
    _owners: weakref.WeakSet[Any] = attrs.field(factory=weakref.WeakSet)
    _strategy: str = "PACK"
    replica_niceness: int | None = 0

    @property
    def groups(self) -> Mapping[str, DeviceGroup]:
        """The initialised groups by name."""
        return {name: placed.group for name, placed in self._groups.items()}

    def shutdown(self) -> None:
        """Same as :func:`twinkle_core.shutdown`."""
        if _session is self:
            shutdown()

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def current_session() -> RemoteSession | None:
    """The active session, or ``None`` before ``initialize()`` (and after ``shutdown()``)."""
    return _session


def list_groups() -> list[DeviceGroup]:
    """The device groups initialised in this session."""
    with _lock:
        return [p.group for p in _session._groups.values()] if _session is not None else []


def get_group(name: str) -> PlacedGroup:
    """The placed group ``name``.

    Raises:
        UnknownGroupError: no such group was initialised (names the ones that were).
    """
    with _lock:
        session = _session
        placed = session._groups.get(name) if session is not None and isinstance(name, str) else None
    if placed is not None:
        return placed
    known = ", ".join(repr(n) for n in session._groups) if session is not None and session._groups else "none"
    hint = "" if session is not None else " (initialize() was never called)"
    raise UnknownGroupError(
        f"remote_group={name!r} names a device group that was never initialised{hint}; initialised groups:"
        f" {known}. Call twinkle_core.initialize('ray', groups=[DeviceGroup(name={name!r}, ranks=...,"
        " device_type='cuda' or 'cpu')]) first, or pick one of those names."
    )


def register_owner(owner: _Closable) -> None:
    """Have ``shutdown()`` close ``owner`` (a remote sampler or object) if it is still open."""
    with _lock:
        if _session is not None:
            _session._owners.add(owner)


def _coerce_groups(groups: Iterable[DeviceGroup | Mapping[str, Any]] | DeviceGroup | None) -> list[DeviceGroup]:
    if groups is None:
        return []
    if isinstance(groups, (DeviceGroup, Mapping)):
        groups = [groups]
    out: list[DeviceGroup] = []
    for i, g in enumerate(groups):
        if isinstance(g, Mapping):
            g = DeviceGroup(**g)
        if not isinstance(g, DeviceGroup):
            raise InvalidMeshError(f"groups[{i}]={g!r} is invalid: expected a DeviceGroup (or its keyword dict).")
        out.append(g)
    names = [g.name for g in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise InvalidMeshError(f"Device group names must be unique; {', '.join(map(repr, dupes))} given twice.")
    return out


def _place(ray: Any, group: DeviceGroup, strategy: str, timeout_s: float) -> PlacedGroup:
    import uuid

    from ray.util import placement_group_table
    from ray.util.placement_group import placement_group, remove_placement_group

    placed = PlacedGroup(group)
    bundle = placed.bundle_resources()
    total = ray.cluster_resources()
    short = {k: v * group.size for k, v in bundle.items() if total.get(k, 0.0) < v * group.size}
    if short:
        raise RemoteError(
            f"Device group {group.name!r} needs {group.size} x {bundle} = {short} but the whole Ray cluster has"
            f" { {k: total.get(k, 0.0) for k in short} }. Lower ranks or cpus_per_rank"
            + (", use device_type='cpu'," if "GPU" in short else "")
            + " or connect to a larger cluster."
        )
    pg = placement_group(
        [dict(bundle) for _ in range(group.size)],
        strategy=strategy,
        name=f"twinkle:{group.name}:{uuid.uuid4().hex[:8]}",
    )
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RemoteError(
            f"Could not place device group {group.name!r} ({group.size} x {bundle}, strategy {strategy}) within"
            f" {timeout_s:g}s: available now {ray.available_resources()}. Other placement groups or actors may"
            " hold the resources; free them, lower ranks or cpus_per_rank, or raise placement_timeout_s."
        )
    table = placement_group_table(pg)
    nodes = table.get("bundles_to_node_id", {})
    placed.placement_group = pg
    placed.bundle_nodes = [str(nodes.get(i, "")) for i in range(group.size)]
    return placed


def initialize(
    mode: Mode = "local",
    groups: Iterable[DeviceGroup | Mapping[str, Any]] | DeviceGroup | None = None,
    *,
    address: str | None = None,
    namespace: str | None = None,
    num_cpus: int | None = None,
    placement_strategy: str = "PACK",
    placement_timeout_s: float = 120.0,
    replica_niceness: int | None = 0,
    **ray_init_kwargs: Any,
) -> RemoteSession:
    """Choose where samplers run, and place the device groups they run on.

    ``"local"`` (the default, and what happens without any call) runs every
    sampler in this process; groups given here are still validated and
    registered, so code passing ``remote_group=`` runs unchanged (as one
    in-process engine). ``"ray"`` connects to the Ray cluster at ``address``
    (or starts a local one, or joins the Ray already running in this process)
    and places each group with a Ray placement group.

    Calling it again is allowed: the same mode and options keep the session,
    new groups are placed and added, an identical group is kept. A group of
    the same name with a different spec, another mode or other cluster
    options raise; call :func:`shutdown` first to change them.

    Args:
        mode: ``"local"`` or ``"ray"``.
        groups: the device groups samplers may be placed on.
        address: a Ray cluster address (``"auto"``, ``"ray://host:10001"``);
            ``None`` starts a local cluster. A local cluster started here listens
            on loopback (127.0.0.1) only, so nothing outside this machine can reach
            it; to let other machines join it, pass ``_node_ip_address=<this
            machine's address>`` (a ``ray.init`` option).
        namespace: the Ray namespace.
        num_cpus: CPUs of a local cluster started here.
        placement_strategy: Ray placement strategy of each group
            (``"PACK"``, ``"SPREAD"``, ``"STRICT_PACK"``, ``"STRICT_SPREAD"``).
        placement_timeout_s: how long to wait for a group's resources.
        replica_niceness: the Unix niceness of the replicas' processes. Ray
            starts its workers at niceness 15 (below everything else on the
            node); replicas are the job's main work, so they run at 0 like the
            driver by default. ``None`` keeps Ray's setting.
        **ray_init_kwargs: passed to ``ray.init`` (e.g. ``runtime_env``).

    Returns:
        The session; also a context manager that shuts it down.

    Raises:
        ConfigError: a bad mode, or options conflicting with the active session.
        InvalidMeshError: a bad or conflicting group.
        RemoteError: Ray is missing, or a group cannot be placed.
    """
    global _session, _atexit_registered
    _check_options(mode, placement_strategy)
    wanted = _coerce_groups(groups)
    _check_niceness(replica_niceness)
    options = {
        "address": address,
        "namespace": namespace,
        "num_cpus": num_cpus,
        "strategy": placement_strategy,
        "replica_niceness": replica_niceness,
        **ray_init_kwargs,
    }
    with _lock:
        session = _session
        if session is not None:
            _check_same_session(session, mode, options, wanted)
        else:
            session = RemoteSession(
                mode,
                address=address,
                namespace=namespace,
                init_options=options,
                strategy=placement_strategy,
                replica_niceness=replica_niceness,
            )
            if mode == "ray":
                _start_ray(session, address, namespace, num_cpus, ray_init_kwargs)
            if not _atexit_registered:
                atexit.register(shutdown)
                _atexit_registered = True
        _place_new(session, wanted, placement_strategy, placement_timeout_s, new=_session is None)
        _session = session
        return session


def _check_options(mode: str, placement_strategy: str) -> None:
    """Refuse a bad mode or placement strategy."""
    if mode not in MODES:
        raise ConfigError(f"initialize(mode={mode!r}) is invalid: expected 'local' or 'ray'.")
    if placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
        raise ConfigError(
            f"placement_strategy={placement_strategy!r} is invalid:"
            " expected PACK, SPREAD, STRICT_PACK or STRICT_SPREAD."
        )


def _check_niceness(replica_niceness: int | None) -> None:
    """Refuse a niceness that is not an integer Unix allows."""
    if replica_niceness is not None and (
        isinstance(replica_niceness, bool) or not isinstance(replica_niceness, int) or not -20 <= replica_niceness <= 19
    ):
        raise ConfigError(
            f"replica_niceness={replica_niceness!r} is invalid: expected an integer in [-20, 19] or None."
        )


def _check_same_session(session: RemoteSession, mode: str, options: dict[str, Any], wanted: list[DeviceGroup]) -> None:
    """Refuse another mode, other options or a changed group while a session lives."""
    if session.mode != mode:
        raise ConfigError(
            f"twinkle is already initialised in mode {session.mode!r}; call twinkle_core.shutdown() before"
            f" initialize(mode={mode!r})."
        )
    if session._init_options != options:
        changed = sorted(
            k for k in set(options) | set(session._init_options) if options.get(k) != session._init_options.get(k)
        )
        raise ConfigError(
            f"twinkle is already initialised with other options ({', '.join(changed)} differ); call"
            " twinkle_core.shutdown() first to change them, or call initialize() with the same options."
        )
    for g in wanted:
        old = session._groups.get(g.name)
        if old is not None and old.group != g:
            raise InvalidMeshError(
                f"Device group {g.name!r} is already initialised as {old.group!r}; it cannot be changed to"
                f" {g!r} while the session lives. Use another name, or call twinkle_core.shutdown() first."
            )


def _start_ray(
    session: RemoteSession,
    address: str | None,
    namespace: str | None,
    num_cpus: int | None,
    ray_init_kwargs: dict[str, Any],
) -> None:
    """Join the Ray already running in this process, or start or connect to a cluster (the session then owns it)."""
    ray = import_ray()
    if ray.is_initialized():
        if address is not None or num_cpus is not None or ray_init_kwargs:
            raise ConfigError(
                "Ray is already running in this process, so address, num_cpus and ray.init options"
                " cannot apply; drop them to join it, or call ray.shutdown() first."
            )
        return
    kwargs = {"include_dashboard": False, "log_to_driver": True, **ray_init_kwargs}
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    if _starts_local_cluster(address) and "_node_ip_address" not in kwargs:
        with _loopback_only(ray):
            ray.init(address=address, namespace=namespace, _node_ip_address=LOOPBACK, **kwargs)
    elif _is_loopback(address):
        # Joining a loopback cluster (one started above, by another driver):
        # Ray would otherwise dial the machine's public address, where nothing listens.
        with _loopback_only(ray):
            ray.init(address=address, namespace=namespace, **kwargs)
    else:
        ray.init(address=address, namespace=namespace, **kwargs)
    session.owns_ray = True


def _place_new(
    session: RemoteSession, wanted: list[DeviceGroup], strategy: str, timeout_s: float, *, new: bool
) -> None:
    """Place the groups the session does not hold yet; on a failure, undo this call's placements (and the
    Ray it started, for a ``new`` session)."""
    placed_now: list[PlacedGroup] = []
    try:
        for g in wanted:
            if g.name in session._groups:
                continue
            placed = _place(import_ray(), g, strategy, timeout_s) if session.mode == "ray" else PlacedGroup(g)
            placed_now.append(placed)
            session._groups[g.name] = placed
    except BaseException:
        for p in placed_now:
            session._groups.pop(p.name, None)
            _remove_pg(p)
        if new and session.owns_ray:
            import_ray().shutdown()
        raise


#: Where a local cluster started by initialize() listens, unless the user says otherwise.
LOOPBACK = "127.0.0.1"
#: Ray reads it at import; false makes it keep a loopback node address instead of
#: swapping in the machine's public one (what it does on macOS and Windows).
_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _starts_local_cluster(address: str | None) -> bool:
    """Whether ``ray.init(address=address)`` starts a new cluster rather than joining one."""
    return address is None and not os.environ.get("RAY_ADDRESS")


def _is_loopback(address: str | None) -> bool:
    """Whether a ``host:port`` cluster address names this machine's loopback."""
    if not address or "://" in address:
        return False
    from twinkle_core.net import is_loopback  # the server's own bind check

    return is_loopback(address.rsplit(":", 1)[0].strip("[]"))


@contextlib.contextmanager
def _loopback_only(ray: Any) -> Iterator[None]:
    """Make the cluster ``ray.init`` starts listen on loopback only.

    Ray binds its servers (GCS, raylet, workers, agents) to the node's address,
    but replaces a loopback node address by the machine's public one unless
    multi-node clusters are off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``). The
    switch is read once at ``import ray``, so it is set on Ray's constants for
    this process and in the environment of the processes Ray starts, only while
    the cluster starts.
    """
    from ray._private import ray_constants

    old_flag = ray_constants.ENABLE_RAY_CLUSTER
    old_env = os.environ.get(_RAY_CLUSTER_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[_RAY_CLUSTER_ENV] = "0"
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = old_flag
        if old_env is None:
            os.environ.pop(_RAY_CLUSTER_ENV, None)
        else:
            os.environ[_RAY_CLUSTER_ENV] = old_env


def _remove_pg(placed: PlacedGroup) -> None:
    if placed.placement_group is None:
        return
    try:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(placed.placement_group)
    except Exception:  # the cluster may already be gone
        pass
    placed.placement_group = None


def shutdown() -> None:
    """Close the remote samplers still open, release every group's placement, and stop Ray if twinkle started it.

    Safe to call twice, or without ``initialize()``.
    """
    global _session
    with _lock:
        session, _session = _session, None
    if session is None:
        return
    for owner in list(session._owners):
        try:
            owner.close()
        except Exception:  # best effort: the rest must still be released
            pass
    for placed in session._groups.values():
        _remove_pg(placed)
    if session.owns_ray:
        try:
            import_ray().shutdown()
        except Exception:
            pass
