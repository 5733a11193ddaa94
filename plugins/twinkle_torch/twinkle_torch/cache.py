"""A KV cache that writes into preallocated buffers instead of growing by concatenation.

``transformers``' ``DynamicLayer`` appends each step's keys and values with
``torch.cat``, which copies the whole cache on every decode step. For small
models on CPU that copy costs as much as the matmuls. :class:`PreallocatedLayer`
allocates room for the whole generation once and writes each step in place;
attention reads a view of the filled part.

Rows are selected (finished sequences dropped) or repeated (one prefilled
prompt shared by its samples) with :meth:`PreallocatedLayer.select`, which
also resizes the buffers and can drop leading columns no row attends to any
more. :func:`join_caches` stacks the rows of two caches, right-aligned: the
continuous batch (:mod:`twinkle_torch.batch`) merges newly prefilled
requests into the running cache with it, and :func:`gather_prefills` builds
one batch's cache from prefills run in several chunks. A hybrid model's
linear-attention layers hold per-row states instead (:mod:`twinkle_torch.state`),
and these functions carry them along: selected and stacked like rows of keys
and values, never trimmed or cropped.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, LinearAttentionLayer

from twinkle_torch.state import StateLayer, StateTensors, gather_states

__all__ = [
    "PreallocatedLayer",
    "gather_prefills",
    "join_caches",
    "joinable",
    "make_cache",
    "rewindable",
    "select_rows",
]


def _buffers(capacity: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty key and value buffers of ``capacity`` columns for the rows and heads of these states."""
    batch, heads, _, k_dim = key_states.shape
    keys = key_states.new_empty(batch, heads, capacity, k_dim)
    values = value_states.new_empty(batch, value_states.shape[1], capacity, value_states.shape[-1])
    return keys, values


class _Reservation:
    """The buffers of a new cache's layers, allocated together when its first layer sees its states.

    A forward initialises a cache's layers one at a time, between its own
    activations. On CPU, each layer's buffers allocated there land among
    those activations in the thread's malloc arena, and the holes the freed
    activations leave cannot go back to the OS while the buffers around them
    live: a 16-row prefill of SmolLM2-135M peaked about 50 MiB higher than
    with every layer's buffers allocated up front, at the first layer.

    The first layer's shapes are a guess for the others' (true of the plain
    attention layers this cache holds in the models seen so far). A layer
    whose shapes, dtype or device differ gets buffers of its own, and the
    guess is dropped: a wrong guess costs an allocation, never a
    wrong result. What a layer that never writes would have taken is freed
    when the next forward begins.
    """

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.started = False
        self.spare: list[tuple[torch.Tensor, torch.Tensor]] = []

    def take(
        self, capacity: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.started:
            self.started = True
            self.spare = [_buffers(capacity, key_states, value_states) for _ in range(self.layers)]
        if self.spare:
            keys, values = self.spare[-1]
            if _fits(keys, key_states, capacity) and _fits(values, value_states, capacity):
                return self.spare.pop()
            self.spare.clear()
        return _buffers(capacity, key_states, value_states)


def _fits(buffer: torch.Tensor, states: torch.Tensor, capacity: int) -> bool:
    """Whether ``buffer`` is what :func:`_buffers` would allocate for ``states``."""
    batch, heads, _, dim = states.shape
    same_kind = buffer.dtype == states.dtype and buffer.device == states.device
    return same_kind and buffer.shape == (batch, heads, capacity, dim)


class PreallocatedLayer(DynamicLayer):
    """One layer's keys and values, ``[batch, heads, capacity, head_dim]``, filled left to right.

    Args:
        capacity: tokens the buffers hold before they must grow (they grow if
            a forward writes past it, so an underestimate costs a copy, never an error).
    """

    def __init__(self, capacity: int, reservation: _Reservation | None = None) -> None:
        super().__init__()
        self.capacity = max(1, int(capacity))
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._reservation = reservation

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        if self._reservation is not None:
            self._k, self._v = self._reservation.take(self.capacity, key_states, value_states)
        else:
            self._k, self._v = _buffers(self.capacity, key_states, value_states)
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
        elif self._reservation is not None and self._reservation.spare:
            # a second forward has begun: a layer that took no buffers in the first never writes
            self._reservation.spare.clear()
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

    def _resize(self, rows: torch.Tensor, capacity: int, start: int = 0) -> None:
        assert self._k is not None and self._v is not None
        old_k, old_v = self._k, self._v
        kept = self.length - start
        self._k = old_k.new_empty(rows.numel(), old_k.shape[1], capacity, old_k.shape[-1])
        self._v = old_v.new_empty(rows.numel(), old_v.shape[1], capacity, old_v.shape[-1])
        self._k[:, :, :kept] = old_k[rows, :, start : self.length]
        self._v[:, :, :kept] = old_v[rows, :, start : self.length]
        self.length = kept
        self.capacity = capacity
        self._set_views()

    def select(self, rows: torch.Tensor, capacity: int | None = None, start: int = 0) -> None:
        """Keep (or repeat) the batch rows ``rows``, in that order, with room for ``capacity`` tokens.

        ``start`` drops that many leading columns (positions every kept row masks out).
        """
        if not self.is_initialized:
            return
        self._resize(rows, max(self.length - start, capacity or self.capacity), start)

    def joined(self, other: PreallocatedLayer, capacity: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The rows of this layer then those of ``other``, both right-aligned, with room for ``capacity``.

        Returns new key and value buffers and their filled length; :meth:`adopt`
        installs them (two steps, so that running out of memory halfway through
        a cache leaves every layer as it was). The shorter side gains leading
        columns of zeros (its attention mask must mask them; zeros, not
        uninitialised memory, because a masked value still enters the weighted
        sum with weight 0, and 0 * NaN is NaN).
        """
        assert self._k is not None and self._v is not None and other._k is not None and other._v is not None
        length = max(self.length, other.length)
        capacity = max(capacity, length)
        ra, rb = self._k.shape[0], other._k.shape[0]
        out = []
        for a, b in ((self._k, other._k), (self._v, other._v)):
            new = a.new_empty(ra + rb, a.shape[1], capacity, a.shape[-1])
            for rows, src, n in ((slice(0, ra), a, self.length), (slice(ra, ra + rb), b, other.length)):
                new[rows, :, : length - n] = 0
                new[rows, :, length - n : length] = src[:, :, :n]
            out.append(new)
        return out[0], out[1], length

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Take ``keys`` and ``values`` (from :meth:`joined` or :func:`gather_prefills`) as this layer's buffers."""
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._k, self._v = keys, values
        self.length = length
        self.capacity = keys.shape[2]
        self._set_views()

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

    Plain linear-attention layers become :class:`~twinkle_torch.state.StateLayer`;
    layers of other kinds (sliding windows, mixed layers) keep the type
    ``transformers`` chose for them.
    """
    cache = DynamicCache(config=config)
    if cache.layers:
        plain = sum(1 for layer in cache.layers if type(layer) is DynamicLayer)
        reservation = _Reservation(plain)
        cache.layers = [_ours(layer, capacity, reservation) for layer in cache.layers]
    else:  # a config transformers could not read: every layer is plain attention
        cache.layer_class_to_replicate = None
        layers = config.get_text_config(decoder=True).num_hidden_layers
        reservation = _Reservation(layers)
        cache.layers = [PreallocatedLayer(capacity, reservation) for _ in range(layers)]
    return cache


def _ours(layer: Any, capacity: int, reservation: _Reservation) -> Any:
    """The decode loop's layer for one ``transformers`` chose: preallocated keys and values, or a row state."""
    if type(layer) is DynamicLayer:
        return PreallocatedLayer(capacity, reservation)
    if type(layer) is LinearAttentionLayer:
        return StateLayer(number_of_states=layer.number_of_states)
    return layer


def select_rows(cache: DynamicCache, rows: torch.Tensor, capacity: int | None = None, start: int = 0) -> None:
    """Keep (or repeat) ``rows`` of every layer of ``cache``, in that order.

    ``start`` drops leading columns; only a :func:`joinable` cache can.
    """
    for layer in cache.layers:
        if isinstance(layer, PreallocatedLayer):
            layer.select(rows, capacity, start)
        elif isinstance(layer, StateLayer):
            layer.select(rows)  # a state has no columns to trim
        else:
            assert start == 0, "only preallocated layers drop leading columns"
            layer.batch_select_indices(rows)


def joinable(cache: DynamicCache) -> bool:
    """Whether every layer of ``cache`` is preallocated or a row state: only those can be joined and trimmed."""
    return all(isinstance(layer, (PreallocatedLayer, StateLayer)) for layer in cache.layers)


def rewindable(cache: DynamicCache) -> bool:
    """Whether a forward's writes to ``cache`` can be cut back: not where a layer holds a recurrent state."""
    return not any(isinstance(layer, StateLayer) for layer in cache.layers)


def join_caches(first: DynamicCache, second: DynamicCache, capacity: int) -> None:
    """Append the rows of ``second`` to ``first`` (in place), right-aligned (see :meth:`PreallocatedLayer.joined`).

    Both must be :func:`joinable`; ``second`` is consumed.
    """
    joined: list[Any] = []
    for a, b in zip(first.layers, second.layers):
        if isinstance(a, StateLayer) and isinstance(b, StateLayer):
            joined.append(a.joined(b))
        else:
            assert isinstance(a, PreallocatedLayer) and isinstance(b, PreallocatedLayer)
            joined.append(a.joined(b, capacity))
    for layer, new in zip(first.layers, joined):
        if isinstance(layer, StateLayer):
            layer.adopt(new)
        else:
            assert isinstance(layer, PreallocatedLayer)
            layer.adopt(*new)


def gather_prefills(
    config: Any, parts: Iterable[tuple[DynamicCache, torch.Tensor, torch.Tensor]], rows: int, width: int, capacity: int
) -> DynamicCache:
    """One cache of ``rows`` rows from several prefilled caches, right-aligned to ``width``, room for ``capacity``.

    Each part is ``(cache, src, dest)``: row ``src[i]`` of that :func:`joinable`
    cache (left-padded, every column filled, at most ``width`` wide) becomes
    row ``dest[i]`` (a row may be taken several times: one prefill shared by
    its samples). The columns left of a narrower part are zeros (masked, and
    zeros rather than uninitialised memory for the reason
    :meth:`PreallocatedLayer.joined` gives). ``parts`` is read one at a time
    and each part copied before the next is read, so a generator that
    prefills as it goes holds one part's cache at a time. Every row must be
    some part's ``dest``.
    """
    capacity = max(capacity, width)
    out = make_cache(config, capacity)
    assert joinable(out)
    buffers: dict[int, list[torch.Tensor]] = {}
    states: dict[int, StateTensors] = {}
    for cache, src, dest in parts:
        for index, layer in enumerate(cache.layers):
            if isinstance(layer, StateLayer):
                states[index] = gather_states(layer, states.get(index), rows, src, dest)
                continue
            assert isinstance(layer, PreallocatedLayer) and layer._k is not None and layer._v is not None
            w = layer.length
            if index not in buffers:
                buffers[index] = [t.new_empty(rows, t.shape[1], capacity, t.shape[-1]) for t in (layer._k, layer._v)]
            for new, part in zip(buffers[index], (layer._k, layer._v)):
                new[dest, :, : width - w] = 0
                new[dest, :, width - w : width] = part[src, :, :w]
        del cache
    for index, layer in enumerate(out.layers):
        if isinstance(layer, StateLayer):
            layer.adopt(states[index])
        else:
            assert isinstance(layer, PreallocatedLayer)
            keys, values = buffers[index]
            layer.adopt(keys, values, width)
    return out
