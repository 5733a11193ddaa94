"""What a ``Sampler`` serves, and the one path that changes it.

The adapter table, the weights version, the readers-writer lock that keeps
runs and changes apart, and the calls in flight (which the ``in_flight``
policies of a change act on). Runs hold the lock shared; adapter, weight and
template changes hold it exclusively, so every sequence is produced by one
state: the ``weights_version`` and adapter stamped on it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs

from twinkle_core.errors import (
    IncompleteUpdateError,
    InvalidInputError,
    SamplerClosedError,
    UnknownAdapterError,
    WeightUpdateError,
    did_you_mean,
)
from twinkle_core.locks import ReadWriteLock
from twinkle_core.names import trainer_spelling
from twinkle_core.requests import IN_FLIGHT_POLICIES, CallFeed

__all__ = ["AdapterInfo", "AppliedWithError", "Lifecycle", "PolicyState"]


@attrs.frozen
class AdapterInfo:
    """A loaded LoRA adapter, as ``Sampler.adapters`` shows it.

    Attributes:
        name: the name ``sample(..., adapter_name=...)`` selects it by.
        adapter_id: a stable integer id for the name (engines key caches on it).
        version: the sampler's ``weights_version`` when it was (re)loaded.
        source: the folder it came from, or ``"<memory>"``.
    """

    name: str
    adapter_id: int
    version: int
    source: str


class AppliedWithError(Exception):
    """Raised by an engine's state change that applied the change, but not cleanly.

    The sampler records the change (adapter table, version) as applied, then
    raises ``error``. The Ray engine uses it when some replicas took an
    update and the others had to be rebuilt with it.
    """

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class Lifecycle:
    """Whether a sampler is closed; every call checks it first."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.closed = False

    def check_open(self) -> None:
        """Raises ``SamplerClosedError`` once closed."""
        if self.closed:
            raise SamplerClosedError(f"This {self.label} is closed; create a new sampler.")


class PolicyState:
    """The adapters and weights version a sampler serves, its lock, and its calls in flight."""

    def __init__(self) -> None:
        #: Runs hold it shared; adapter, weight and template changes exclusively.
        self.lock = ReadWriteLock()
        self._adapters: dict[str, AdapterInfo] = {}
        self._next_adapter_id = 1
        self._version = 0
        self._live: set[CallFeed] = set()
        self._live_lock = threading.Lock()
        #: Tensors a weight update that failed part-way may have changed, and what happened (replaced
        #: whole, never mutated: calls read it without the lock).
        self._in_doubt: frozenset[str] = frozenset()
        self._doubt_cause = ""

    # -- adapters ---------------------------------------------------------------------------
    @property
    def adapters(self) -> Mapping[str, AdapterInfo]:
        """The loaded adapters by name (a read-only copy)."""
        return MappingProxyType(dict(self._adapters))

    def has_adapter(self, name: str) -> bool:
        return name in self._adapters

    def require_adapter(self, name: str) -> AdapterInfo:
        """The adapter ``name``, or a typed error listing the loaded ones (with a did-you-mean)."""
        if not isinstance(name, str):
            raise UnknownAdapterError(f"adapter_name={name!r} is invalid: expected a string ('' = base model).")
        info = self._adapters.get(name)
        if info is None:
            loaded = ", ".join(sorted(self._adapters)) or "(none)"
            raise UnknownAdapterError(
                f"Unknown adapter {name!r}.{did_you_mean(name, list(self._adapters))} Loaded adapters: {loaded};"
                " use '' for the base model, or add it with add_adapter_to_model()."
            )
        return info

    def record_adapter(self, name: str, version: int, source: str) -> None:
        """``name`` is loaded (or replaced) at ``version``; a replaced adapter keeps its id."""
        old = self._adapters.get(name)
        adapter_id = old.adapter_id if old is not None else self._next_adapter_id
        if old is None:
            self._next_adapter_id += 1
        self._adapters[name] = AdapterInfo(name, adapter_id, version, str(source))

    def drop_adapter(self, name: str) -> None:
        del self._adapters[name]

    # -- versions ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The weights version: bumped by every weight update and adapter (re)load; 0 at start."""
        return self._version

    def next_version(self, version: int | None) -> int:
        """The version a change takes: ``version``, which must be above the current one, or current + 1."""
        if version is None:
            return self._version + 1
        if isinstance(version, bool) or not isinstance(version, int) or version <= self._version:
            raise WeightUpdateError(
                f"version={version!r} is invalid: expected an integer greater than the current"
                f" weights_version {self._version} (or None to increment it)."
            )
        return version

    def restore_version(self, version: int) -> None:
        """Raise the version to ``version`` (a rebuilt engine that replayed its state); never lowers it."""
        if isinstance(version, bool) or not isinstance(version, int):
            raise WeightUpdateError(f"version={version!r} is invalid: expected an integer.")
        with self.lock.write():
            self._version = max(self._version, version)

    # -- a weight update that failed part-way -------------------------------------------------
    def doubt(self, version: int, names: list[str], error: BaseException, *, change: str = "update_weights") -> None:
        """A ``change`` to ``version`` of ``names`` failed while the engine applied it: they are in doubt."""
        self._in_doubt = self._in_doubt | set(names)
        detail = f"{type(error).__name__}: {error}"[:300] if str(error) else type(error).__name__
        self._doubt_cause = f"{change} to version {version} failed part-way ({detail})"

    def settle(self, names: list[str]) -> None:
        """``names`` were pushed whole, in either spelling (:mod:`twinkle_core.names`): no longer in doubt."""
        pushed = {trainer_spelling(name) for name in names}
        self._in_doubt = frozenset(name for name in self._in_doubt if trainer_spelling(name) not in pushed)

    def require_settled(self) -> None:
        """Refuse to run while tensors are in doubt: the engine may run a mix no weights version names."""
        in_doubt, cause = self._in_doubt, self._doubt_cause
        if in_doubt:
            doubtful = sorted(in_doubt)
            more = f" and {len(doubtful) - 3} more" if len(doubtful) > 3 else ""
            raise IncompleteUpdateError(
                f"{cause}: the engine may hold some of its tensors' new values and not others, under"
                f" weights_version {self._version}. Sampling is refused until update_weights(...) pushes them"
                f" again: {', '.join(map(repr, doubtful[:3]))}{more}."
            )

    # -- calls in flight --------------------------------------------------------------------
    def track(self, feed: CallFeed) -> None:
        with self._live_lock:
            self._live.add(feed)

    def untrack(self, feed: CallFeed) -> None:
        with self._live_lock:
            self._live.discard(feed)

    def live_calls(self) -> list[CallFeed]:
        with self._live_lock:
            return list(self._live)

    def make_room(self, in_flight: str) -> None:
        """Apply an ``in_flight`` policy before a change takes the lock exclusively."""
        if in_flight not in IN_FLIGHT_POLICIES:
            raise InvalidInputError(
                f"in_flight={in_flight!r} is invalid: expected one of {', '.join(map(repr, IN_FLIGHT_POLICIES))}."
            )
        if in_flight == "wait":
            return
        for feed in self.live_calls():
            if in_flight == "abort":
                feed.handle.abort()
            else:
                feed.suspend()

    # -- the one path of a change -----------------------------------------------------------
    def change(
        self,
        in_flight: str,
        version: int | None,
        apply: Callable[[int], Any],
        record: Callable[[int, Any], object],
        *,
        bump: bool = True,
    ) -> int:
        """Make a change: the ``in_flight`` policy, the lock held exclusively, the new version; returns it.

        ``apply(new_version)`` asks the engine to make the change; if it raises,
        nothing is recorded and the error propagates. If it raises
        ``AppliedWithError`` (applied, not cleanly), the change is recorded
        (``record(new_version, None)``) and that error raised; otherwise
        ``record(new_version, what apply returned)``. ``bump``: the change
        takes ``version`` (default: current + 1) as the new weights version.
        """
        self.make_room(in_flight)
        with self.lock.write():
            new_version = self.next_version(version) if bump else self._version
            error: BaseException | None = None
            try:
                result = apply(new_version)
            except AppliedWithError as applied:
                result, error = None, applied.error
            record(new_version, result)
            self._version = new_version
        if error is not None:
            raise error
        return new_version
