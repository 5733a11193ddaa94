"""A grouped-query-aware SDPA attention for ``transformers`` models on CPU.

``transformers``' ``sdpa`` attention hands grouped-query attention (fewer key /
value heads than query heads) to ``scaled_dot_product_attention`` natively
only when there is no attention mask; with one (left padding always needs one)
it first copies the keys and values once per query group (``repeat_kv``). In
a batched decode loop that copy is the whole KV cache, several times over, on
every layer and every step: on CPU it costs more than the attention itself.
``scaled_dot_product_attention(..., enable_gqa=True)`` takes the mask and the
grouped heads as they are.

:func:`register` adds it to ``transformers`` as ``"twinkle_sdpa"`` (with the
same masks as ``"sdpa"``), and as ``"twinkle_native"`` the same with decode
steps through :mod:`twinkle_torch.native`'s kernel (prefill, and whatever the
kernel does not take, stay on SDPA). :class:`~twinkle_torch.sampler.TorchSampler`
loads CPU models with one of them unless ``attn_implementation`` is given
(``attention_kernel`` chooses).

A call that carries an argument neither SDPA nor the kernel honours (Gemma 2's
logit soft-cap, gpt-oss's attention sinks...) goes to the model's own eager
attention instead, with the masks turned into its additive form: the model
keeps its meaning, only that family loses the speed.
"""

from __future__ import annotations

import functools
import itertools
import sys
import weakref
from typing import Any

import torch

from twinkle_torch.native import decode_attention as native_decode_attention

__all__ = [
    "ATTN_IMPLEMENTATION",
    "NATIVE_ATTN_IMPLEMENTATION",
    "grouped_sdpa_attention_forward",
    "native_attention_forward",
    "register",
    "row_blocks",
]

#: The name ``from_pretrained(attn_implementation=...)`` knows it by.
ATTN_IMPLEMENTATION = "twinkle_sdpa"
#: The same, decode steps through the native kernel.
NATIVE_ATTN_IMPLEMENTATION = "twinkle_native"


def _carried() -> frozenset[str]:
    """Keyword arguments an attention call may carry that change nothing here.

    The ones every model's forward hands down to its attention
    (``transformers``' ``TransformersKwargs``: output flags, packed-sequence
    lengths, positions...), the cache's, and ``sliding_window``: the masks
    already carry windows and packed sequences, as they do for
    ``transformers``' own SDPA. Any other one set (a soft-cap, attention
    sinks, sparse indices, a position bias...) is the attention module's own
    and sends the call to the model's eager attention, which honours it:
    PyTorch's SDPA and the native kernel would ignore it.
    """
    try:
        from transformers.utils.generic import TransformersKwargs

        handed_down = set(TransformersKwargs.__annotations__)
    except ImportError:  # pragma: no cover - an older transformers: the names it had
        handed_down = {"output_attentions", "output_hidden_states", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"}
    return frozenset(handed_down | {"sliding_window", "use_cache", "cache_position", "past_key_values"})


_CARRIED = _carried()

#: Decode steps split the batch into blocks of rows only from this many rows on.
_MIN_BLOCK_ROWS = 16
#: At most this many blocks per step (each is one more attention call per layer).
_MAX_BLOCKS = 8

# The last decode mask seen and its blocks: every layer of a step gets the same mask object.
_last_blocks: tuple[weakref.ref[torch.Tensor], list[tuple[int, int, int]] | None] | None = None


def row_blocks(mask: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """Contiguous blocks of rows of a decode mask ``[rows, 1, 1, columns]``, each with the columns its rows need.

    The batch's cache is right-aligned: a row whose prompt is short masks many
    leading columns, and one attention call over the whole batch reads them
    anyway (attention on CPU is bound by reading the cache). Rows come in
    blocks of at least ``_MIN_BLOCK_ROWS``; block ``(a, b, start)`` attends over
    columns ``start:`` only, ``start`` being the first column any of its rows
    attends to. ``None``: one call over everything (a small batch, a mask
    without leading columns to skip, or a split that would not save a fifth).
    The decoder keeps rows of similar prompt length together, which is what
    makes the blocks narrow.
    """
    global _last_blocks
    last = _last_blocks
    if last is not None and last[0]() is mask:
        return last[1]
    blocks = _split(mask)
    _last_blocks = (weakref.ref(mask), blocks)
    return blocks


def _split(mask: torch.Tensor) -> list[tuple[int, int, int]] | None:
    rows, columns = mask.shape[0], mask.shape[-1]
    if rows < 2 * _MIN_BLOCK_ROWS or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1:3] != (1, 1):
        return None
    first = mask.reshape(rows, columns).to(torch.uint8).argmax(dim=-1).tolist()  # each row's first attended column
    count = min(_MAX_BLOCKS, rows // _MIN_BLOCK_ROWS)
    edges = [round(i * rows / count) for i in range(count + 1)]
    blocks = [(a, b, min(first[a:b])) for a, b in itertools.pairwise(edges)]
    read = sum((b - a) * (columns - start) for a, b, start in blocks)
    if read > 0.8 * rows * columns:
        return None
    return blocks


def grouped_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    native: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers``' attention-function signature.

    Takes ``[batch, heads, seq, dim]`` queries, keys and values; returns ``[batch, seq, heads, dim]``.
    ``native``: decode steps through :func:`twinkle_torch.native.decode_attention` where it applies.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    extras = sorted(k for k, v in kwargs.items() if v is not None and v is not False and k not in _CARRIED)
    if extras:
        return _model_eager(module, query, key, value, attention_mask, dropout, scaling, is_causal, extras, kwargs)
    # one mask row for all query heads (a mask per head, as Doge makes, takes the general path below)
    decoding = q_len == 1 and (attention_mask is None or attention_mask.shape[-3:-1] == (1, 1))
    # Decoding: the query heads of a group attend to the same keys under the same mask, so they
    # can be the query rows of one head: [batch, kv_heads, group, dim].
    if native and decoding and dropout == 0.0 and heads % kv_heads == 0:
        grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
        fast = native_decode_attention(grouped, key, value, attention_mask, scaling)
        if fast is not None:
            return fast.view(batch, 1, heads, dim), None
    if heads == kv_heads:
        stock: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
        return stock
    if decoding:  # SDPA on the grouped query: faster still than enable_gqa, which loops over the groups
        grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
        blocks = row_blocks(attention_mask) if attention_mask is not None else None
        if blocks is None or attention_mask is None:
            out = torch.nn.functional.scaled_dot_product_attention(
                grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
            )
        else:
            out = grouped.new_empty(*grouped.shape[:-1], value.shape[-1])  # values may be wider than keys (MLA)
            for a, b, start in blocks:
                out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                    grouped[a:b], key[a:b, :, start:], value[a:b, :, start:],
                    attn_mask=attention_mask[a:b, ..., start:], dropout_p=dropout, scale=scaling,
                )  # fmt: skip
        return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def _model_eager(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    is_causal: bool | None,
    extras: list[str],
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """The model's own ``eager_attention_forward`` (from its modeling module), for what only it honours.

    Its masks are additive floats and it applies no causality of its own: the
    boolean (or absent) masks made for SDPA become one.
    """
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            f"{type(module).__name__} passes {extras} to its attention, which twinkle's attention does not"
            " implement, and its module has no eager_attention_forward to defer to; load the model with"
            " attn_implementation='eager'"
        )
    q_len, tokens = query.shape[2], key.shape[2]
    mask = attention_mask
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if mask is None and causal and q_len > 1:
        mask = torch.ones(q_len, tokens, dtype=torch.bool, device=query.device).tril(tokens - q_len)[None, None]
    if mask is not None and mask.dtype == torch.bool:
        blocked = torch.finfo(query.dtype).min
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, blocked)
    out, _ = eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    return out, None


#: ``"twinkle_native"``'s function: decode steps through the native kernel.
native_attention_forward = functools.partial(grouped_sdpa_attention_forward, native=True)


def register() -> None:
    """Make ``attn_implementation="twinkle_sdpa"`` and ``"twinkle_native"`` known to ``transformers`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, grouped_sdpa_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    AttentionInterface.register(NATIVE_ATTN_IMPLEMENTATION, native_attention_forward)
    AttentionMaskInterface.register(NATIVE_ATTN_IMPLEMENTATION, sdpa_mask)
