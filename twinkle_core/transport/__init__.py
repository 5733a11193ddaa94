"""Weight transports: how an update reaches many replicas.

* ``"object_store"``: the update is put into Ray's object store once and
  every replica reads that copy (simple; on several nodes each node pulls
  its own copy, up to one model per replica out of the trainer's node).
* ``"collective"``: the trainer streams the update down a chain of the
  replicas over a ``torch.distributed`` group of their own
  (:mod:`twinkle_core.transport.collective`): the trainer sends one model's
  bytes whatever the number of replicas, and a sharded trainer's stream is
  never gathered whole.
"""

from __future__ import annotations

import math
import os

import attrs

from twinkle_core.errors import ConfigError
from twinkle_core.net import check_timeout

__all__ = ["TIMEOUT_ENV", "TRANSPORTS", "TRANSPORT_ENV", "CollectiveOptions", "TransportSetting", "resolve_transport"]

#: The weight transports a remote sampler can use.
TRANSPORTS = ("object_store", "collective")
#: Chooses the transport when a sampler is built without ``weight_transport=``.
TRANSPORT_ENV = "TWINKLE_WEIGHT_TRANSPORT"
#: The collective's longest wait for any step, in seconds (default 300).
TIMEOUT_ENV = "TWINKLE_TRANSPORT_TIMEOUT_S"


def _positive_int(_inst: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"CollectiveOptions.{attribute.name}={value!r} is invalid: expected an integer >= 1 (bytes).")


def _timeout(_inst: object, _attribute: object, value: float | None) -> None:
    if value is not None:
        check_timeout(value, "CollectiveOptions.timeout_s")


def _backend(_inst: object, _attribute: object, value: str) -> None:
    from twinkle_core.transport.collective import BACKENDS

    if value not in BACKENDS:
        raise ConfigError(f"CollectiveOptions.backend={value!r} is invalid: expected one of {', '.join(BACKENDS)}.")


@attrs.frozen
class CollectiveOptions:
    """The collective transport and its knobs (``weight_transport=CollectiveOptions(...)``).

    Attributes:
        backend: ``"gloo"`` (CPU tensors; what runs anywhere) or ``"nccl"``
            (CUDA tensors on the trainer and GPUs on every replica).
        timeout_s: the longest any step waits (joining, a bucket); ``None``:
            ``$TWINKLE_TRANSPORT_TIMEOUT_S``, else 300.
        bucket_bytes: tensors are packed into buckets of about this size; the
            trainer holds two at most.
        chunk_bytes: the piece a bucket moves in along the chain (smaller:
            less added time per replica, more messages).
        host: the address the replicas reach this process at; ``None``: this
            node's address as Ray sees it.
    """

    backend: str = attrs.field(default="gloo", validator=_backend)
    timeout_s: float | None = attrs.field(default=None, validator=_timeout)
    bucket_bytes: int = attrs.field(default=64 << 20, validator=_positive_int)
    chunk_bytes: int = attrs.field(default=4 << 20, validator=_positive_int)
    host: str | None = None

    def timeout(self) -> float:
        """The timeout in force (the option, else the environment's, else 300 s)."""
        if self.timeout_s is not None:
            return float(self.timeout_s)
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return 300.0
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{TIMEOUT_ENV}={raw!r} is invalid: expected a number of seconds > 0.")
        return value

    def address(self) -> str:
        """Where the replicas reach the sender."""
        if self.host is not None:
            return self.host
        from twinkle_core.transport.collective import local_address

        return local_address()


#: What ``weight_transport=`` accepts: a transport's name, its options, or ``None`` (the environment's choice).
TransportSetting = str | CollectiveOptions | None


def resolve_transport(setting: TransportSetting) -> str | CollectiveOptions:
    """``"object_store"`` or the collective's options, from a setting (``None``: ``$TWINKLE_WEIGHT_TRANSPORT``).

    Raises:
        ConfigError: an unknown name, naming the choices.
    """
    source = "weight_transport"
    if setting is None:
        setting = os.environ.get(TRANSPORT_ENV, "").strip() or "object_store"
        source = TRANSPORT_ENV
    if isinstance(setting, CollectiveOptions):
        return setting
    if setting == "collective":
        return CollectiveOptions()
    if setting == "object_store":
        return "object_store"
    raise ConfigError(
        f"{source}={setting!r} is invalid: expected one of {', '.join(map(repr, TRANSPORTS))}"
        " or a twinkle_core.transport.CollectiveOptions."
    )
