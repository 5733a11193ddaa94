"""Where this process runs as a replica: the ``ReplicaContext`` a Ray replica's host sets, for the engine to read.

It sits below the sampler and the engine contract (``EngineContext.placement``
reads it) and the remote package sets it, so neither imports upward.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["ReplicaContext", "current_replica", "enter_replica"]


@attrs.frozen(kw_only=True)
class ReplicaContext:
    """Where a replica runs; :func:`current_replica` returns it inside the actor.

    Attributes:
        index: the replica's index among its sampler's replicas.
        num_replicas: how many replicas the sampler has (its ``dp_size``).
        group: the device group's name.
        device_type: ``"cuda"`` or ``"cpu"``.
        tp_size: devices per replica.
        bundle_indices: the replica's bundles in the group's placement group
            (``tp_size`` of them); the actor itself sits in the first one.
        placement_group: the group's Ray placement group; an engine with
            ``tp_size > 1`` starts its tensor-parallel workers on
            ``bundle_indices`` of it.
    """

    index: int
    num_replicas: int
    group: str
    device_type: str
    tp_size: int
    bundle_indices: tuple[int, ...]
    placement_group: Any = None


_current: ReplicaContext | None = None


def current_replica() -> ReplicaContext | None:
    """Inside a replica's actor, where it runs; ``None`` anywhere else (the driver, local mode)."""
    return _current


def enter_replica(context: ReplicaContext) -> None:
    """State where this process runs (the replica host does, once, before it builds the engine)."""
    global _current
    _current = context
