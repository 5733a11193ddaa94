"""A KV cache that writes into preallocated buffers instead of growing by concatenation.

``transformers``' ``DynamicLayer`` appends each step's keys and values with
``torch.cat``, which copies the whole cache on every decode step. For small
models on CPU that copy costs as much as the matmuls. :class:`PreallocatedLayer`
allocates room for the whole generation once and writes each step in place;
attention reads a view of the filled part.

Rows are selected (finished sequences dropped) or repeated (one prefilled
prompt shared by its samples) with :meth:`PreallocatedLayer.select`, which
also resizes the buffers.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["PreallocatedLayer", "make_cache", "select_rows"]


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values, ``[batch, heads, capacity, head_dim]``, filled left to right.

    Args:
        capacity: tokens the buffers hold before they must grow (they grow if
            a forward writes past it, so an underestimate costs a copy, never an error).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = max(1, int(capacity))
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, k_dim = key_states.shape
        self._k = key_states.new_empty(batch, heads, self.capacity, k_dim)
        self._v = value_states.new_empty(batch, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _set_views(self) -> None:
        assert self._k is not None and self._v is not None
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self._k is not None and self._v is not None
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            self._resize(torch.arange(self._k.shape[0], device=self._k.device), max(end, 2 * self.capacity))
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._set_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def _resize(self, rows: torch.Tensor, capacity: int) -> None:
        assert self._k is not None and self._v is not None
        old_k, old_v = self._k, self._v
        self._k = old_k.new_empty(rows.numel(), old_k.shape[1], capacity, old_k.shape[-1])
        self._v = old_v.new_empty(rows.numel(), old_v.shape[1], capacity, old_v.shape[-1])
        self._k[:, :, : self.length] = old_k[rows, :, : self.length]
        self._v[:, :, : self.length] = old_v[rows, :, : self.length]
        self.capacity = capacity
        self._set_views()

    def select(self, rows: torch.Tensor, capacity: int | None = None) -> None:
        """Keep (or repeat) the batch rows ``rows``, in that order, with room for ``capacity`` tokens."""
        if not self.is_initialized:
            return
        self._resize(rows, max(self.length, capacity or self.capacity))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._k is not None:
            self.select(torch.arange(self._k.shape[0], device=self._k.device).repeat_interleave(repeats))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.select(beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0:
            self.length = max(0, self.length + tokens_to_remove)
        elif tokens_to_remove < self.length:  # legacy meaning: the length to keep
            self.length = tokens_to_remove
        if self.is_initialized:
            self._set_views()

    def reset(self) -> None:
        self.length = 0
        self._k = self._v = None
        self.keys = self.values = None  # type: ignore[assignment]  # transformers' "not initialized"; see is_initialized
        self.is_initialized = False


def make_cache(config: Any, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose plain full-attention layers are preallocated.

    Layers of other kinds (sliding windows, linear attention) keep the type
    ``transformers`` chose for them.
    """
    cache = DynamicCache(config=config)
    if cache.layers:
        cache.layers = [PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    else:  # a config transformers could not read: every layer is plain attention
        cache.layer_class_to_replicate = None
        decoder = config.get_text_config(decoder=True)
        cache.layers = [PreallocatedLayer(capacity) for _ in range(decoder.num_hidden_layers)]
    return cache


def select_rows(cache: DynamicCache, rows: torch.Tensor, capacity: int | None = None) -> None:
    """Keep (or repeat) ``rows`` of every layer of ``cache``, in that order."""
    for layer in cache.layers:
        if isinstance(layer, PreallocatedLayer):
            layer.select(rows, capacity)
        else:
            layer.batch_select_indices(rows)
