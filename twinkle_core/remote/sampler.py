"""``RemoteSampler``: the ``Sampler`` around a :class:`~twinkle_core.remote.engine.RemoteEngine`.

It is what ``TorchSampler(..., remote_group="sampler")`` (or
``create_sampler("vllm", ..., remote_group="sampler")``) returns in ``"ray"``
mode: an ordinary ``Sampler`` whose engine runs as Ray replicas. It adds only
the replicas' views (``replicas``, ``actors``, ``num_replicas``) and the
layout (``engine_class``, ``device_mesh``, ``group``).
"""

from __future__ import annotations

import functools
from typing import Any

from twinkle_core.mesh import DeviceGroup, DeviceMesh
from twinkle_core.remote._pool import ReplicaPool
from twinkle_core.remote._runtime import PlacedGroup, register_owner
from twinkle_core.remote.engine import RemoteEngine
from twinkle_core.remote.remote_class import ReplicaViews, build_object
from twinkle_core.sampler import Sampler, require_engine_class
from twinkle_core.transport import CollectiveOptions, TransportSetting, resolve_transport

__all__ = ["RemoteSampler", "build_remote"]


def build_remote(cls: type, remote_group: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ``cls(*args, remote_group=..., **kwargs)`` returns: replicas in ``"ray"`` mode, else a local object.

    A ``Sampler`` class becomes a :class:`RemoteSampler`; any other class is
    built by :func:`~twinkle_core.remote.remote_class.build_object`. A
    sampler also takes ``weight_transport=`` (see :mod:`twinkle_core.transport`):
    how its updates reach the replicas (nothing to choose in ``"local"`` mode).

    Raises:
        UnknownGroupError: the group was never initialised.
        InvalidMeshError: the mesh does not fit the group.
        TypeError: the arguments do not fit the constructor.
    """
    if cls is Sampler:  # Sampler(SomeEngine, ...): refuse anything else here, not in every replica
        if not args:
            raise TypeError("Sampler(engine, *args, **kwargs) needs an engine class first.")
        require_engine_class(args[0])
    if not (isinstance(cls, type) and issubclass(cls, Sampler)):
        return build_object(cls, remote_group, args, kwargs)
    kwargs = dict(kwargs)
    transport = resolve_transport(kwargs.pop("weight_transport", None))
    return build_object(
        cls, remote_group, args, kwargs, remote_type=functools.partial(RemoteSampler, weight_transport=transport)
    )


class RemoteSampler(ReplicaViews, Sampler):
    """A sampler whose engine runs as ``mesh.dp_size`` Ray actors of ``tp_size`` devices each.

    Built by passing ``remote_group=`` to any engine in ``"ray"`` mode; not
    meant to be constructed directly. It has the whole ``Sampler`` API, run
    by the one ``Sampler`` code: see :class:`~twinkle_core.remote.engine.RemoteEngine`
    for how calls and state changes reach the replicas. Prompts are encoded
    and checked here, with the replicas' template.

    Attributes:
        engine_class: the engine each replica runs.
        device_mesh: the layout.
        group: the device group the replicas run on.
    """

    # What is known before the replicas start; the engine's info says the rest.

    def __init__(
        self,
        engine_class: type[Sampler],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        placed: PlacedGroup,
        mesh: DeviceMesh,
        weight_transport: TransportSetting = None,
    ) -> None:
        super().__init__(
            RemoteEngine, engine_class, args, kwargs, placed=placed, mesh=mesh, weight_transport=weight_transport
        )
        self._pool: ReplicaPool = self.engine.pool  # what ReplicaViews reads
        register_owner(self)

    @property
    def engine(self) -> RemoteEngine:
        """The engine this sampler holds: the replicas."""
        engine = super().engine
        assert isinstance(engine, RemoteEngine)
        return engine

    @property
    def weight_transport(self) -> str | CollectiveOptions:
        """How updates reach the replicas: ``"object_store"`` or the collective's options (settable)."""
        return self.engine.weight_transport

    @weight_transport.setter
    def weight_transport(self, setting: TransportSetting) -> None:
        self.engine.set_weight_transport(setting)

    @property
    def engine_class(self) -> type:
        """The engine each replica runs."""
        return self.engine.engine_class

    @property
    def device_mesh(self) -> DeviceMesh:
        """The layout."""
        return self.engine.device_mesh

    @property
    def group(self) -> DeviceGroup:
        """The device group the replicas run on."""
        return self.engine.group

    def __repr__(self) -> str:
        return f"RemoteSampler({self.engine!r})"
