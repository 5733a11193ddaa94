"""Remote execution on Ray: device groups, data-parallel sampler replicas, ``@remote_class``.

::

    import twinkle_core as tw

    tw.initialize("ray", groups=[tw.DeviceGroup(name="sampler", ranks=4, device_type="cuda")])
    sampler = tw.create_sampler("vllm", model_id=..., device_mesh=tw.DeviceMesh.from_sizes(dp_size=4),
                                remote_group="sampler")
    responses = sampler.sample(trajectories, params)     # split across 4 replicas, gathered in order
    sampler.update_weights(state_dict.items())           # every replica, one version
    tw.shutdown()

Ray is imported only when ``initialize("ray")`` runs: importing this package
costs nothing. See ``docs/remote.md``.
"""

from typing import Any

from twinkle_core.remote._runtime import (
    PlacedGroup,
    RemoteSession,
    current_session,
    get_group,
    initialize,
    list_groups,
    shutdown,
)
from twinkle_core.remote.errors import RemoteError, RemoteTraceback, ReplicaLostError, UnknownGroupError
from twinkle_core.remote.remote_class import DISPATCH_MODES, RemoteObject, dispatch, remote_class

__all__ = [
    "DISPATCH_MODES",
    "PlacedGroup",
    "RemoteError",
    "RemoteObject",
    "RemoteSampler",
    "RemoteSession",
    "RemoteTraceback",
    "ReplicaContext",
    "ReplicaInfo",
    "ReplicaLostError",
    "UnknownGroupError",
    "current_replica",
    "current_session",
    "dispatch",
    "get_group",
    "initialize",
    "list_groups",
    "remote_class",
    "shutdown",
]


_LAZY = {
    "RemoteSampler": "twinkle_core.remote.sampler",
    "ReplicaContext": "twinkle_core.remote._host",
    "current_replica": "twinkle_core.remote._host",
    "ReplicaInfo": "twinkle_core.remote._pool",
}


def __getattr__(name: str) -> Any:
    # Loaded on first use: keeps ``import twinkle_core`` cheap (Ray is imported only when replicas are built).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
