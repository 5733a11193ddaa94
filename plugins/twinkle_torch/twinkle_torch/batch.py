"""The running batch's layout: its rows, their cache (KV and recurrent state), mask, positions and logits.

Rows of the batch are right-aligned in the cache: column ``length - 1`` is
every row's last token, and a shorter row's leading columns are masked. Rows
that joined later were prefilled apart and are **joined** here (the shorter
side padded on the left); finished rows are **pruned** (their cache rows
dropped, and the leading columns no remaining row attends to trimmed). A hybrid
model's per-row recurrent state is selected and joined with the keys and
values (:mod:`twinkle_torch.cache`, :mod:`twinkle_torch.state`).
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle_torch.cache import PreallocatedLayer, join_caches, joinable, select_rows
from twinkle_torch.rows import Row

__all__ = ["Batch", "seen_of"]


def seen_of(rows: list[Row], vocab: int, device: torch.device) -> torch.Tensor:
    """Per row, the tokens it has seen (prompt and completion), for the repetition penalty."""
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for i, row in enumerate(rows):
        seen[i, torch.tensor(row.ids, dtype=torch.long, device=device)] = True
    return seen


class Batch:
    """The running batch: rows, their KV cache, mask, positions and the logits of their next token."""

    def __init__(
        self,
        rows: list[Row],
        cache: Any,
        length: int,
        mask: torch.Tensor,
        next_pos: torch.Tensor,
        logits: torch.Tensor,
        seen: torch.Tensor | None,
    ) -> None:
        self.rows = rows
        self.cache = cache
        self.length = length  # cache columns filled
        self.mask = mask  # [rows, capacity]: the first `length` columns are meaningful
        self.next_pos = next_pos  # per row, the position id of its next input token
        # Between a forward and the next draw: the logits of each row's next token. Between the
        # draw and the next forward: `inputs`, the tokens drawn.
        self.logits: torch.Tensor | None = logits
        self.inputs: torch.Tensor | None = None
        self.seen = seen

    def live(self) -> list[Row]:
        return [r for r in self.rows if not r.done]

    def join(self, new: Batch) -> None:
        """Merge ``new`` (just prefilled) into this batch: rows appended, caches right-aligned."""
        self.prune()
        assert self.logits is not None and new.logits is not None
        device = self.mask.device
        old_len, new_len = self.length, new.length
        length = max(old_len, new_len)
        rows = self.rows + new.rows
        capacity = length + max(r.limit - len(r.tokens) for r in rows)
        join_caches(self.cache, new.cache, capacity)
        mask = torch.zeros(len(rows), capacity, dtype=torch.bool, device=device)
        mask[: len(self.rows), length - old_len : length] = self.mask[:, :old_len].bool()
        mask[len(self.rows) :, length - new_len : length] = new.mask[:, :new_len].bool()
        vocab = int(self.logits.shape[-1])
        seen = self.seen
        if seen is not None or new.seen is not None:
            top = seen if seen is not None else seen_of(self.rows, vocab, device)
            bottom = new.seen if new.seen is not None else seen_of(new.rows, vocab, device)
            seen = torch.cat([top, bottom])
        self.rows = rows
        self.length = length
        self.mask = mask
        self.next_pos = torch.cat([self.next_pos, new.next_pos])
        self.logits = torch.cat([self.logits, new.logits])
        self.seen = seen

    def prune(self) -> None:
        """Drop finished rows, and the leading columns none of the others attends to."""
        keep_list = [i for i, r in enumerate(self.rows) if not r.done]
        if len(keep_list) == len(self.rows):
            return
        keep = torch.tensor(keep_list, dtype=torch.long, device=self.mask.device)
        length = self.length
        mask = self.mask[keep]
        start = 0
        if keep_list and joinable(self.cache):
            used = mask[:, :length].any(dim=0).nonzero()
            start = int(used[0]) if used.numel() else 0
        select_rows(self.cache, keep, start=start)
        self.length -= start
        if start:
            trimmed = torch.zeros_like(mask)
            trimmed[:, : mask.shape[1] - start] = mask[:, start:]
            mask = trimmed
        self.mask = mask
        self.rows = [self.rows[i] for i in keep_list]
        self.next_pos = self.next_pos[keep]
        if self.logits is not None:
            self.logits = self.logits[keep]
        if self.inputs is not None:
            self.inputs = self.inputs[keep]
        if self.seen is not None:
            self.seen = self.seen[keep]

    def cut_back(self, length: int) -> None:
        """Cut every preallocated layer back to ``length`` columns (what a failed forward wrote past it goes)."""
        for layer in self.cache.layers:
            if isinstance(layer, PreallocatedLayer) and layer.length > length:
                layer.crop(length - layer.length)
