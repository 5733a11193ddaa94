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
same masks as ``"sdpa"``); :class:`~twinkle_torch.sampler.TorchSampler` loads
CPU models with it unless ``attn_implementation`` is given.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ATTN_IMPLEMENTATION", "grouped_sdpa_attention_forward", "register"]

#: The name ``from_pretrained(attn_implementation=...)`` knows it by.
ATTN_IMPLEMENTATION = "twinkle_sdpa"

# keyword arguments that only the stock implementation knows how to honour
_STOCK_ONLY = ("position_bias", "s_aux", "sinks", "cache")


def grouped_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """``transformers``' attention-function signature.

    Takes ``[batch, heads, seq, dim]`` queries, keys and values; returns ``[batch, seq, heads, dim]``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[1] == key.shape[1] or any(kwargs.get(k) is not None for k in _STOCK_ONLY):
        stock: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
        return stock
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len == 1 and (attention_mask is None or attention_mask.shape[-2] == 1):
        # Decoding: the query heads of a group attend to the same keys under the same mask, so
        # they can be the query rows of one head: [batch, kv_heads, group, dim]. Faster still
        # than enable_gqa, which loops over the groups.
        grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
        out = torch.nn.functional.scaled_dot_product_attention(
            grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
        )
        return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation="twinkle_sdpa"`` available to ``transformers`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, grouped_sdpa_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
