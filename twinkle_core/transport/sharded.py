"""Weights from a sharded trainer, streamed: a full state dict never exists anywhere.

An FSDP2 (``fully_shard``) model holds each parameter as a ``DTensor`` split
across the ranks. :func:`gathered_tensors` yields ``(name, full tensor)`` one
parameter at a time (``DTensor.full_tensor()`` is an all-gather, so every
rank must iterate it, in the same order); plain tensors (a DDP or single-rank
model) pass through. :func:`push_from_ranks` runs the one push every rank
agrees on: rank ``src`` streams the gathered tensors into its sampler (with
the collective transport each bucket leaves as soon as it is full, so the
trainer holds one or two buckets plus the parameter being gathered); the
other ranks take part in the gathers only, and every rank gets the new
version, or the same error.

Torch is imported when these run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from twinkle_core.errors import WeightUpdateError

__all__ = ["gathered_tensors", "push_from_ranks"]


def gathered_tensors(model: Any, *, dtype: Any = None) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` for each entry of ``model.state_dict()``, a ``DTensor`` gathered whole.

    Every rank of the model's mesh must iterate it to the end (each
    ``full_tensor()`` is a collective); only one tensor is gathered at a time.

    Args:
        model: an ``nn.Module`` (FSDP2-sharded, DDP-wrapped or plain). The
            ``module.`` prefix DDP adds is dropped, so names are the Hugging
            Face model's.
        dtype: cast floating-point tensors to it (``torch.bfloat16`` to send
            half the bytes to an engine that runs in it).
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise WeightUpdateError(f"gathered_tensors needs an nn.Module, got {type(model).__name__}.")
    inner = getattr(model, "module", model)  # DDP wraps the model
    for name, value in inner.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        full = full.detach()
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        yield name, full
        del full


def push_from_ranks(
    sampler: Any,
    model: Any,
    *,
    src: int = 0,
    group: Any = None,
    dtype: Any = None,
    version: int | None = None,
    **update_kwargs: Any,
) -> int:
    """Push ``model``'s weights into ``sampler`` from rank ``src``; call it on every rank of ``group``.

    Rank ``src`` calls ``sampler.update_weights`` with :func:`gathered_tensors`
    (pass ``sampler=None`` on the other ranks); the others iterate the same
    gathers. If the push fails part-way, ``src`` still finishes the gathers,
    so no rank is left waiting, and every rank raises the error.

    Args:
        sampler: the sampler on rank ``src`` (``None`` elsewhere).
        model: the (sharded) model, the same object on every rank.
        src: the rank that holds the sampler.
        group: the trainer's process group (default: the default group).
        dtype: see :func:`gathered_tensors`.
        version, update_kwargs: passed to ``update_weights``.

    Returns:
        The new weights version, on every rank.

    Raises:
        WeightUpdateError: the push failed (on every rank; ``src`` raises the original error).
    """
    import torch.distributed as dist

    rank = dist.get_rank(group)
    stream = gathered_tensors(model, dtype=dtype)
    outcome: list[Any] = [None, None]
    error: BaseException | None = None
    if rank == src:
        if sampler is None:
            raise WeightUpdateError(f"push_from_ranks: rank {src} must pass its sampler.")
        try:
            outcome[0] = sampler.update_weights(stream, version=version, **update_kwargs)
        except BaseException as exc:
            error = exc
            outcome[1] = f"{type(exc).__name__}: {exc}"
    for _ in stream:  # the gathers the push did not read (all of them on the other ranks)
        pass
    dist.broadcast_object_list(outcome, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
    if error is not None:
        raise error
    if outcome[1] is not None:
        raise WeightUpdateError(f"push_from_ranks: the push from rank {src} failed: {outcome[1]}")
    return int(outcome[0])
