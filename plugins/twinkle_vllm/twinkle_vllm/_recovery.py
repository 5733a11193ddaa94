"""Engine death on vLLM: detect it, say so with a typed error, restart the engine and replay its state.

vLLM's engine runs in other processes (``EngineCore`` and its workers). If one
of them dies (killed, out of memory, a crash in a kernel), vLLM marks the
engine dead for good: every later request fails. A job that samples for days
must not have to rebuild its whole sampler for that, so the sampler can start
a new engine in place and bring it back to the state the old one had:

* the base weights: the latest tensor given for each name by a *successful*
  ``update_weights`` (kept as host copies, one per name, see ``replay_weights``);
* the adapters: folders are loaded again from their folder, in-memory adapters
  from host copies of their tensors; each keeps its name and adapter id;
* the template and the weights version live in the driver and are unchanged.

Two parts, both held by the sampler: a :class:`ReplayStore` (what a restart
replays, and whether the engine's weights still match the version; a test or
a benchmark may pass its own to the sampler) and :class:`EngineRecovery`
(detection, the typed error, the restart itself).

A restart happens on ``vLLMSampler.restart()``, or by itself when a call
finds the engine dead (``auto_restart=True``, the default). The call that met
the death is never retried: it raises :class:`~twinkle_core.errors.EngineDeadError`
saying what happened, whether the engine was restarted, and what to do. A
weight update or adapter load that the death interrupted is not applied: the
restarted engine carries the state from before that call, under the version
from before that call, so calling it again is always right.

With ``replay_weights=False`` the sampler keeps no copy of the weights (saving
one host copy of every tensor ever updated). A restart after an update then
leaves the engine on the checkpoint's weights, which no longer match the
sampler's ``weights_version``; rather than label their samples with it,
``sample()`` raises ``EngineDeadError`` until the weights are pushed again
with ``update_weights``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import attrs
import torch

from twinkle_core.errors import ConfigError, EngineDeadError, SamplerClosedError

__all__ = ["EngineRecovery", "ReplayStore", "RestartHooks"]


class ReplayStore:
    """What a restarted engine is brought back to, and whether the engine holds the weights its version names.

    Args:
        keep_weights: keep a host copy of the latest tensor of every name a
            successful ``update_weights`` pushed (``replay_weights``).
        overlap: copy for replay while the workers apply each bucket (right
            where they run on GPUs; on CPU workers the copy takes the memory
            bandwidth and cores they apply with: the push got slower in
            ``bench/bench_sync.py``). ``None``: the sampler decides by device.
    """

    def __init__(self, *, keep_weights: bool = True, overlap: bool | None = None) -> None:
        if not isinstance(keep_weights, bool) or not (overlap is None or isinstance(overlap, bool)):
            raise ConfigError(
                f"ReplayStore(keep_weights={keep_weights!r}, overlap={overlap!r}) is invalid: expected True or False"
                " (and None for overlap: decided by the device)."
            )
        self.keep_weights = keep_weights
        self.overlap = overlap
        #: The latest tensor of every name a successful update_weights pushed (host copies).
        self.tensors: dict[str, torch.Tensor] = {}
        #: How to load each adapter again: ("folder", path) or ("memory", config, tensors).
        self.adapters: dict[str, tuple[Any, ...]] = {}
        #: Names of every tensor a successful push sent.
        self.pushed_names: set[str] = set()
        #: Set when the engine may not hold the weights its version names (a restart without
        #: kept weights, a failed push that could not be undone): sampling is refused until
        #: every name in ``lost_names`` is pushed again.
        self.lost_message = ""
        self.lost_names: set[str] = set()

    # -- recording ----------------------------------------------------------------------
    def copier(
        self, tensors: list[tuple[str, torch.Tensor]], copies: dict[str, torch.Tensor]
    ) -> Callable[[list[str]], None] | None:
        """What copies the tensors of a weight push into ``copies``, bucket by bucket, while the workers apply them.

        ``copies`` goes to :meth:`record_weights` once the push succeeded.
        ``None`` unless weights are kept and :attr:`overlap` is on: then
        :meth:`record_weights` copies after the push.
        """
        if not (self.keep_weights and self.overlap):
            return None
        by_name = dict(tensors)

        def copy(names: list[str]) -> None:
            for name in names:
                if name not in copies:
                    # A copy: trainers update their tensors in place.
                    copies[name] = by_name[name].detach().to("cpu", copy=True)

        return copy

    def record_weights(
        self, tensors: list[tuple[str, torch.Tensor]], copies: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Called after a successful weight push, with what :meth:`copier` copied during it."""
        self.pushed_names.update(name for name, _ in tensors)
        self.lost_names.difference_update(name for name, _ in tensors)
        if not self.lost_names:
            self.lost_message = ""
        if self.keep_weights:
            for name, tensor in tensors:
                copied = (copies or {}).get(name)
                self.tensors[name] = copied if copied is not None else self._copy(name, tensor)

    def _copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor``, written over the previous copy of ``name`` where it fits.

        The push has succeeded, so the previous copy is no longer needed for an
        undo. Reusing its memory matters: a fresh allocation of a large tensor
        is a fresh mapping, and faulting its pages in cost several times the
        copy itself (0.22 s against 0.03 s for SmolLM2's 538 MB here).
        """
        source = tensor.detach()
        previous = self.tensors.get(name)
        if previous is None or previous.shape != source.shape or previous.dtype != source.dtype:
            return source.to("cpu", copy=True)
        previous.copy_(source)
        return previous

    def record_adapter(self, name: str, how: tuple[Any, ...] | None) -> None:
        """Called after an adapter was loaded (``how``) or removed (``None``)."""
        if how is None:
            self.adapters.pop(name, None)
        else:
            self.adapters[name] = how

    # -- the weights' state ---------------------------------------------------------------
    def mark_lost(self, names: Iterable[str], message: str) -> None:
        """Refuse sampling with ``message`` until every one of ``names`` is pushed again."""
        self.lost_names.update(names)
        self.lost_message = message

    def check_present(self) -> None:
        """Refuse to sample on weights that do not match the version (see ``keep_weights``)."""
        if self.lost_message:
            raise EngineDeadError(self.lost_message)


@attrs.frozen
class RestartHooks:
    """What :class:`EngineRecovery` needs from the sampler that holds it (its own methods stay private)."""

    #: whether the sampler is closed
    closed: Callable[[], bool]
    #: the sampler's weights version (for messages)
    weights_version: Callable[[], int]
    #: whether there is no engine, or vLLM marked it dead
    errored: Callable[[], bool]
    #: hold the sampler's lock exclusively (no call runs)
    exclusive: Callable[[], AbstractContextManager[Any]]
    #: stop the engine's processes (a dead engine included)
    stop: Callable[[], None]
    #: start a new engine
    boot: Callable[[], None]
    #: push replayed weights into the new engine
    replay_weights: Callable[[list[tuple[str, torch.Tensor]]], None]
    #: load one adapter again, as ``ReplayStore.adapters`` recorded it
    replay_adapter: Callable[[str, tuple[Any, ...]], None]


class EngineRecovery:
    """Engine death on vLLM: detection, the typed error, and restarts that replay ``store``.

    Args:
        hooks: the sampler's side.
        store: what a restart replays.
        auto_restart: restart by itself when a call finds the engine dead.
    """

    def __init__(self, hooks: RestartHooks, store: ReplayStore, *, auto_restart: bool) -> None:
        self._hooks = hooks
        self.store = store
        self.auto_restart = auto_restart
        #: Bumped by every restart: a call remembers the one it started on.
        self.generation = 0
        self.restarts = 0

    # -- detection ------------------------------------------------------------------------
    def engine_dead(self) -> bool:
        """Whether vLLM marked the engine dead, or a restart failed and left none."""
        return not self._hooks.closed() and self._hooks.errored()

    def dead_while(self, during: str, cause: BaseException, generation: int, *, locked: bool) -> EngineDeadError:
        """The error for a call that found the engine dead, after restarting it if that is on.

        Args:
            during: the call, for the message (``"sample()"``).
            cause: what vLLM raised.
            generation: the engine generation the call started on (another call may
                have restarted it since: then it is not restarted again).
            locked: the caller holds the exclusive lock already.
        """
        what = f"The vLLM engine died during {during} ({type(cause).__name__}: {cause})."
        if self._hooks.closed():
            return SamplerClosedError(f"{what} The sampler is closed.")  # type: ignore[return-value]
        if not self.auto_restart:
            return EngineDeadError(
                f"{what} Call sampler.restart() to start a new engine with the same weights and adapters, or close"
                " the sampler (auto_restart=True restarts it by itself)."
            )
        try:
            restarted_here = self._restart(generation, locked=locked)
        except Exception as exc:
            return EngineDeadError(
                f"{what} Restarting it failed ({type(exc).__name__}: {exc}); close the sampler and create a new one,"
                " or call sampler.restart() to try again."
            )
        who = "was restarted" if restarted_here else "was restarted by another call"
        return EngineDeadError(
            f"{what} The engine {who} with the sampler's state (weights version {self._hooks.weights_version()},"
            f" adapters {sorted(self.store.adapters) or 'none'}); this call was not retried and changed nothing:"
            " call it again."
        )

    # -- restart --------------------------------------------------------------------------
    def restart(self) -> None:
        """Stop the engine (dead or not), start a new one and replay the store into it; waits for calls in flight.

        Raises:
            SamplerClosedError: the sampler is closed.
            EngineDeadError: the new engine could not be started or brought back to the
                sampler's state (call ``restart()`` again, or close the sampler).
        """
        if self._hooks.closed():
            raise SamplerClosedError("restart() on a closed sampler: create a new one.")
        try:
            self._restart(None, locked=False)
        except (SamplerClosedError, EngineDeadError):
            raise
        except Exception as exc:
            raise EngineDeadError(f"Restarting the vLLM engine failed: {type(exc).__name__}: {exc}") from exc

    def _restart(self, generation: int | None, *, locked: bool) -> bool:
        """Restart unless ``generation`` is already over; returns whether this call restarted it."""
        # Every restart holds the exclusive lock, so the generation check and the restart are one step.
        if locked:
            return self._restart_if(generation)
        with self._hooks.exclusive():
            return self._restart_if(generation)

    def _restart_if(self, generation: int | None) -> bool:
        if generation is not None and generation != self.generation:
            return False
        self._restart_now()
        return True

    def _restart_now(self) -> None:
        hooks, store = self._hooks, self.store
        if hooks.closed():
            raise SamplerClosedError("The sampler was closed during the restart.")
        self.generation += 1
        hooks.stop()
        hooks.boot()
        self.restarts += 1
        if store.keep_weights:
            # Replayed copies (and the checkpoint for the rest) are exactly the state the version names.
            store.lost_names.clear()
            store.lost_message = ""
        if store.tensors:
            hooks.replay_weights(list(store.tensors.items()))
        elif store.pushed_names:
            store.mark_lost(
                store.pushed_names,
                f"The vLLM engine was restarted without its updated weights (replay_weights=False): it runs the"
                f" checkpoint's weights, not weights version {hooks.weights_version()}. Push the full weights again"
                " with update_weights(...) before sampling.",
            )
        for name, how in list(store.adapters.items()):
            hooks.replay_adapter(name, how)
