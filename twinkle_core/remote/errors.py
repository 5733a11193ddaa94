"""Errors of remote execution.

Errors raised *inside* a replica (an ``InvalidSamplingParams``, a
``WeightUpdateError``...) reach the driver as their own type, with the
replica named in a note and the remote traceback chained; the classes here
are for what only remote execution can go wrong with.
"""

from __future__ import annotations

from twinkle_core.errors import TwinkleError

__all__ = ["RemoteError", "RemoteTraceback", "ReplicaLostError", "UnknownGroupError"]


class RemoteError(TwinkleError, RuntimeError):
    """Remote execution failed: Ray is missing, a replica could not start, or a call failed in transit."""


class ReplicaLostError(RemoteError):
    """A replica died and could not be brought back; the surviving replicas keep serving.

    Attributes:
        replica: index of the lost replica.
        survivors: how many replicas are still serving.
    """

    def __init__(self, message: str, *, replica: int, survivors: int) -> None:
        super().__init__(message)
        self.replica = replica
        self.survivors = survivors


class UnknownGroupError(TwinkleError, LookupError):
    """``remote_group=`` names a device group that ``initialize()`` never placed."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a replica, chained as its ``__cause__``."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text
