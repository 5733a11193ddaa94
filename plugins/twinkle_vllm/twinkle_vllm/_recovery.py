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

A restart happens on :meth:`EngineRecovery.restart`, or by itself when a call
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
from typing import Any

import torch

from twinkle_core.errors import EngineDeadError, SamplerClosedError
from twinkle_core.sampler import Sampler

__all__ = ["EngineRecovery"]


class EngineRecovery(Sampler):
    """What :class:`~twinkle_vllm.sampler.vLLMSampler` adds for engine death.

    An abstract part of the engine (so it keeps to the engine API like the
    rest): the sampler provides ``_engine``, ``_boot()``, ``_stop_engine()``
    and ``_replay_adapter()``; restarts hold the base's ``_exclusive()``.
    """

    _engine: Any
    _boot: Callable[[], None]
    _stop_engine: Callable[[], None]
    _replay_adapter: Callable[[str, tuple[Any, ...]], None]

    def _init_recovery(self, *, auto_restart: bool, replay_weights: bool) -> None:
        self._auto_restart = bool(auto_restart)
        self._replay_weights = bool(replay_weights)
        #: The latest tensor of every name a successful update_weights pushed (host copies).
        self._replay_tensors: dict[str, torch.Tensor] = {}
        #: How to load each adapter again: ("folder", path) or ("memory", config, tensors).
        self._replay_adapters: dict[str, tuple[Any, ...]] = {}
        #: Copy for replay while the workers apply each bucket. Right where they run on GPUs; on CPU
        #: workers the copy takes the memory bandwidth and cores they apply with, and the push got
        #: slower in bench/bench_sync.py (set by the sampler).
        self._overlap_replay = False
        self._weights_pushed = False
        #: Names of every tensor a successful push sent.
        self._pushed_names: set[str] = set()
        #: Set when the engine may not hold the weights its version names (a restart with
        #: replay_weights=False, a failed push that could not be undone): sampling is refused
        #: until every name in ``_lost_names`` is pushed again.
        self._weights_lost = ""
        self._lost_names: set[str] = set()
        self._generation = 0
        self._restarts = 0

    @property
    def restarts(self) -> int:
        """How many times the engine was restarted (after dying, or by :meth:`restart`)."""
        return self._restarts

    # -- recording ----------------------------------------------------------------------
    def _replay_copier(
        self, tensors: list[tuple[str, torch.Tensor]], copies: dict[str, torch.Tensor]
    ) -> Callable[[list[str]], None] | None:
        """What copies the tensors of a weight push into ``copies``, bucket by bucket, while the workers apply them.

        ``copies`` goes to :meth:`_record_weights` once the push succeeded. ``None``
        without ``replay_weights``, or unless :attr:`_overlap_replay`: then
        :meth:`_record_weights` copies after the push.
        """
        if not (self._replay_weights and self._overlap_replay):
            return None
        by_name = dict(tensors)

        def copy(names: list[str]) -> None:
            for name in names:
                if name not in copies:
                    # A copy: trainers update their tensors in place.
                    copies[name] = by_name[name].detach().to("cpu", copy=True)

        return copy

    def _record_weights(
        self, tensors: list[tuple[str, torch.Tensor]], copies: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Called after a successful weight push, with what :meth:`_replay_copier` copied during it."""
        self._weights_pushed = True
        self._pushed_names.update(name for name, _ in tensors)
        self._lost_names.difference_update(name for name, _ in tensors)
        if not self._lost_names:
            self._weights_lost = ""
        if self._replay_weights:
            for name, tensor in tensors:
                copied = (copies or {}).get(name)
                self._replay_tensors[name] = copied if copied is not None else self._replay_copy(name, tensor)

    def _replay_copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor``, written over the previous copy of ``name`` where it fits.

        The push has succeeded, so the previous copy is no longer needed for an
        undo. Reusing its memory matters: a fresh allocation of a large tensor
        is a fresh mapping, and faulting its pages in cost several times the
        copy itself (0.22 s against 0.03 s for SmolLM2's 538 MB here).
        """
        source = tensor.detach()
        previous = self._replay_tensors.get(name)
        if previous is None or previous.shape != source.shape or previous.dtype != source.dtype:
            return source.to("cpu", copy=True)
        previous.copy_(source)
        return previous

    def _record_adapter(self, name: str, how: tuple[Any, ...] | None) -> None:
        """Called after an adapter was loaded (``how``) or removed (``None``)."""
        if how is None:
            self._replay_adapters.pop(name, None)
        else:
            self._replay_adapters[name] = how

    # -- detection ------------------------------------------------------------------------
    def _engine_dead(self) -> bool:
        """Whether vLLM marked the engine dead, or a restart failed and left none."""
        if self.closed:
            return False
        engine = self._engine
        return engine is None or bool(getattr(engine, "errored", False))

    def _dead_while(self, during: str, cause: BaseException, generation: int, *, locked: bool) -> EngineDeadError:
        """The error for a call that found the engine dead, after restarting it if that is on.

        Args:
            during: the call, for the message (``"sample()"``).
            cause: what vLLM raised.
            generation: the engine generation the call started on (another call may
                have restarted it since: then it is not restarted again).
            locked: the caller holds the exclusive lock already.
        """
        what = f"The vLLM engine died during {during} ({type(cause).__name__}: {cause})."
        if self.closed:
            return SamplerClosedError(f"{what} The sampler is closed.")  # type: ignore[return-value]
        if not self._auto_restart:
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
            f"{what} The engine {who} with the sampler's state (weights version {self.weights_version},"
            f" adapters {sorted(self._replay_adapters) or 'none'}); this call was not retried and changed nothing:"
            " call it again."
        )

    # -- restart --------------------------------------------------------------------------
    def restart(self) -> None:
        """Stop the engine (dead or not), start a new one and replay the sampler's state into it.

        Waits for the calls in flight. The weights version is kept; see the
        module docstring of :mod:`twinkle_vllm._recovery` for what is replayed.

        Raises:
            SamplerClosedError: the sampler is closed.
            EngineDeadError: the new engine could not be started or brought back to the
                sampler's state (call ``restart()`` again, or close the sampler).
        """
        if self.closed:
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
        with self._exclusive():
            return self._restart_if(generation)

    def _restart_if(self, generation: int | None) -> bool:
        if generation is not None and generation != self._generation:
            return False
        self._restart_now()
        return True

    def _restart_now(self) -> None:
        if self.closed:
            raise SamplerClosedError("The sampler was closed during the restart.")
        self._generation += 1
        self._stop_engine()
        self._boot()
        self._restarts += 1
        if self._replay_weights:
            # Replayed copies (and the checkpoint for the rest) are exactly the state the version names.
            self._lost_names.clear()
            self._weights_lost = ""
        if self._replay_tensors:
            self._replay_weight_tensors(list(self._replay_tensors.items()))
        elif self._weights_pushed:
            self._mark_weights_lost(
                self._pushed_names,
                f"The vLLM engine was restarted without its updated weights (replay_weights=False): it runs the"
                f" checkpoint's weights, not weights version {self.weights_version}. Push the full weights again"
                " with update_weights(...) before sampling.",
            )
        for name, how in list(self._replay_adapters.items()):
            self._replay_adapter(name, how)

    def _replay_weight_tensors(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        raise NotImplementedError  # provided by the sampler

    def _mark_weights_lost(self, names: Iterable[str], message: str) -> None:
        """Refuse sampling with ``message`` until every one of ``names`` is pushed again."""
        self._lost_names.update(names)
        self._weights_lost = message

    def _check_weights_present(self) -> None:
        """Refuse to sample on weights that do not match the version (see ``replay_weights``)."""
        if self._weights_lost:
            raise EngineDeadError(self._weights_lost)
