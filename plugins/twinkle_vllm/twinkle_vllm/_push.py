"""Base weights into every vLLM worker: validated, pushed in checksummed buckets, undone when a push fails part-way.

The engine holds one :class:`WeightPush` for its life (a restart keeps it:
the channel and the replay store outlive the vLLM processes). It owns the
bucket channel's weight traffic and what it must know to put the previous
values back; the engine decides when to push (updates, merges, replays) and
turns a failure on a dead engine into ``EngineDeadError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from twinkle_vllm._recovery import ReplayStore
from twinkle_vllm._sync import SyncChannel
from twinkle_vllm._weights import WeightSpec

__all__ = ["WeightPush"]


class WeightPush:
    """Pushes of base weights through ``channel``, recorded in ``replay``.

    Args:
        channel: the workers' bucket channel.
        replay: what a restart replays; a successful push is recorded there.
        read_spec: reads the model's :class:`WeightSpec` (once, on first use).
        on_cuda: whether the workers run on CUDA (tensors there go by CUDA IPC).
        engine_dead: whether vLLM marked the engine dead (no undo, no cache reset then).
        reset_cache: drop every prefix-cache entry.
    """

    def __init__(
        self,
        channel: SyncChannel,
        replay: ReplayStore,
        read_spec: Callable[[], WeightSpec],
        *,
        on_cuda: Callable[[], bool],
        engine_dead: Callable[[], bool],
        reset_cache: Callable[[], None],
    ) -> None:
        self.channel = channel
        self._replay = replay
        self._read_spec = read_spec
        self._spec: WeightSpec | None = None
        self._on_cuda = on_cuda
        self._engine_dead = engine_dead
        self._reset_cache = reset_cache
        #: Names update_weights has changed: their base values are no longer the checkpoint's.
        self.updated: set[str] = set()

    @property
    def spec(self) -> WeightSpec:
        """The model's tensors as the engine loads them (names, shapes, dtype, fused layers)."""
        if self._spec is None:
            self._spec = self._read_spec()
        return self._spec

    def push(self, tensors: list[tuple[str, Any]]) -> None:
        """Push validated tensors into every worker; on failure put back what a partial push changed.

        Raises:
            WeightUpdateError: a worker rejected a bucket (the previous values are back).
            WeightSyncTimeoutError: a worker did not answer in time.
        """
        # Trainer tensors already on the GPU go through CUDA IPC (no host round trip).
        cuda_ipc = self._on_cuda() and all(t.is_cuda for _, t in tensors)
        copies: dict[str, torch.Tensor] = {}
        try:
            copier = self._replay.copier(tensors, copies)
            self.channel.push("weights", tensors, cuda_ipc=cuda_ipc, while_applying=copier)
        except BaseException as exc:
            if isinstance(exc, Exception) and self.channel.buckets_sent and not self._engine_dead():
                # The workers may have applied some layers: put the previous values back.
                self._undo([name for name, _ in tensors], exc)
            # Some layers may have changed while the version (and so the cache salt) did not: never serve
            # KV cached before this sync. (A dead engine cannot reset; its restart starts clean.)
            try:
                self._reset_cache()
            except Exception:
                if not self._engine_dead():
                    raise
            raise
        self._replay.record_weights(tensors, copies)

    def replay(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Push the replay store's copies into a restarted engine."""
        self.channel.push("weights", tensors)
        self._reset_cache()

    def held_values(self, names: list[str], *, replaced: set[str]) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
        """The values the engine holds for ``names`` (replay copies, else the checkpoint's), and the unknown names.

        A name in ``replaced`` without a replay copy (``replay_weights=False``)
        is unknown: the checkpoint no longer holds its value. If any is, no
        value is read and the first list is empty.
        """
        kept = self._replay.tensors
        rest = [name for name in names if name not in kept]
        unknown = [name for name in rest if name in replaced]
        if unknown:
            return [], unknown
        spec = self.spec
        read = spec.read_checkpoint(rest, getattr(torch, spec.engine_dtype)) if rest else {}
        return [(name, kept[name] if name in kept else read[name]) for name in names], []

    def _undo(self, names: list[str], cause: BaseException) -> None:
        """After a push failed part-way, push the values the engine held before it.

        They come from the replay copies (``replay_weights``), or from the
        checkpoint for tensors no push has replaced yet. Where neither is known,
        or the undo fails too, sampling is refused until those tensors are
        pushed again: the engine may run a mix that no weights version names.
        """
        try:
            # Replaced by any push (an update or a merge): the checkpoint is not what the engine held.
            old, unknown = self.held_values(names, replaced=self._replay.pushed_names)
            if unknown:
                raise LookupError(f"no copy of the values before it (replay_weights=False) for {unknown[:3]}")
            self.channel.push("weights", old)
        except Exception as exc:
            self._replay.mark_lost(
                names,
                f"update_weights() failed part-way ({type(cause).__name__}: {cause}) and its partial changes could"
                f" not be undone ({type(exc).__name__}: {exc}): the engine may hold a mix of old and new values of"
                f" {len(names)} tensors ({names[:3]}...). Sampling is refused until they are pushed again with"
                " update_weights(...).",
            )
