"""The Gated DeltaNet kernels twinkle runs for ``transformers``' on a CPU; the decode step's recurrence, reordered.

Without ``flash-linear-attention``, a Gated DeltaNet layer (Qwen3.5, Qwen3-Next,
OLMo hybrid) decodes one token with ``transformers``' pure-PyTorch
``torch_recurrent_gated_delta_rule``. Per row and head it keeps a float32
state ``S`` of ``key dim x value dim`` (64 KiB at 128 x 128) and, per token::

    S = exp(g) * S                    # decay
    delta = beta * (v - k S)          # what the state mispredicts for v
    S = S + k^T delta                 # the rank-one correction
    o = q S

which that function writes as broadcast products and sums: each line makes a
temporary as large as the state and reads it again, about a dozen passes over
the state per token, which on a CPU is the whole cost of the step (at 16 rows
of 16 heads, 11 ms of a layer's 13). :func:`recurrent_gated_delta_rule` does the
same arithmetic in three passes: ``q S`` and ``k S`` in one batched matmul over
the old state, then the new state as ``exp(g) S`` (one pass) plus
``k^T delta`` added in place by ``baddbmm`` (one pass), and the output from
the old state's product, ``o = exp(g) (q S) + (q . k) delta``, which equals
``q`` times the new state without reading it. The results are
``transformers``' own up to float32 rounding order (about 1e-7 relative on the
state).

:func:`gdn_kernels` puts it (as :data:`decode_step`: the cache's state updated in
place, which the layer then copies onto itself), and :func:`twinkle_torch.gdn_chunk.chunk_gated_delta_rule`
for the prefill's chunked kernel, in place of ``transformers``' functions for the
duration of a forward, in the modeling modules of ``model`` whose function is
``transformers``' own (compared by code, so a kernel from the hub or a patched
function is left alone; :func:`kernel_sites`), and puts the originals back after;
counted, so samplers in several threads share them.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from types import ModuleType
from typing import Any

import torch

from twinkle_torch.gdn_chunk import chunk_gated_delta_rule

__all__ = ["decode_step", "gdn_kernels", "kernel_sites", "recurrent_gated_delta_rule"]

_LOCK = threading.Lock()
_USERS: Counter[tuple[str, str]] = Counter()
_ORIGINALS: dict[tuple[str, str], Any] = {}


def recurrent_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    in_place: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``transformers``' ``torch_recurrent_gated_delta_rule`` (same arguments and results) in three passes a token.

    Args:
        query, key: ``[batch, tokens, heads, key dim]``.
        value: ``[batch, tokens, heads, value dim]``.
        g: the log decay, ``[batch, tokens, heads]``.
        beta: the write strength, ``[batch, tokens, heads]``.
        initial_state: ``[batch, heads, key dim, value dim]`` (not changed unless ``in_place``), or ``None`` for
            zeros.
        output_final_state: return the last state.
        use_qk_l2norm_in_kernel: normalise queries and keys to unit length first.
        in_place: when the last state is asked for and ``initial_state`` is a contiguous float32 tensor, update
            it in place and return it: no new tensor of the state's size (at 64 rows of 16 heads, 64 MiB a
            layer and a step, which the allocator maps and faults in afresh), and a layer that copies the
            result into its cache (``transformers``' do) copies a tensor onto itself, which is free.

    Returns:
        The outputs ``[batch, tokens, heads, value dim]`` in the query's dtype, and the last state in float32
        (``None`` unless asked for).
    """
    dtype = query.dtype
    batch, tokens, heads, key_dim = key.shape
    value_dim = value.shape[-1]
    q, k, v, b, decay = (x.transpose(1, 2).float() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(dim=-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True) + 1e-6)
    q = q / key_dim**0.5
    if initial_state is None:
        state = torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float32, device=value.device)
    else:
        state = initial_state.to(torch.float32)
    # whether ``state`` may be written: ours, or the caller's when asked (and the same tensor)
    writable = initial_state is None or (
        in_place and output_final_state and state is initial_state and state.is_contiguous()
    )
    out = torch.empty(batch, heads, tokens, value_dim, dtype=torch.float32, device=value.device)
    rows = batch * heads
    for t in range(tokens):
        q_t, k_t = q[:, :, t], k[:, :, t]
        keep = decay[:, :, t].exp().unsqueeze(-1)  # [batch, heads, 1]
        read = torch.matmul(torch.stack((q_t, k_t), dim=-2), state)  # q S and k S of the old state, one pass
        delta = (v[:, :, t] - keep * read[:, :, 1]) * b[:, :, t].unsqueeze(-1)
        if writable:
            state.mul_(keep.unsqueeze(-1))
        else:  # a new tensor: the caller's state is not written
            state, writable = state * keep.unsqueeze(-1), True
        state.view(rows, key_dim, value_dim).baddbmm_(k_t.reshape(rows, key_dim, 1), delta.reshape(rows, 1, value_dim))
        out[:, :, t] = keep * read[:, :, 0] + (q_t * k_t).sum(dim=-1, keepdim=True) * delta
    return out.transpose(1, 2).contiguous().to(dtype), (state if output_final_state else None)


#: The decode step's recurrence in a forward of the engine: the cache's state updated in place.
decode_step = partial(recurrent_gated_delta_rule, in_place=True)

#: ``transformers``' pure-PyTorch Gated DeltaNet functions (their names in the modeling modules) -> twinkle's.
_KERNELS: dict[str, Any] = {
    "torch_recurrent_gated_delta_rule": decode_step,
    "torch_chunk_gated_delta_rule": chunk_gated_delta_rule,
}


def _is_transformers_own(name: str, function: Any) -> bool:
    """Whether ``function`` is ``transformers``' pure-PyTorch ``name`` (its code, whichever module holds it)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    own = getattr(modeling_qwen3_5, name)
    code = getattr(function, "__code__", None)
    return code is not None and (code.co_code, code.co_consts) == (own.__code__.co_code, own.__code__.co_consts)


def kernel_sites(model: Any) -> list[tuple[str, str]]:
    """``(modeling module, function name)`` of each of ``transformers``' own Gated DeltaNet kernels ``model`` calls."""
    names = {type(m).__module__ for m in model.modules()}
    return sorted(
        (module, name)
        for module in names
        if isinstance(sys.modules.get(module), ModuleType)
        for name in _KERNELS
        if _replaceable(name, getattr(sys.modules[module], name, None))
    )


def _replaceable(name: str, function: Any) -> bool:
    # a module without the function (every non-GDN model) is decided without importing transformers' Qwen3.5
    return function is not None and (function is _KERNELS[name] or _is_transformers_own(name, function))


@contextmanager
def gdn_kernels(sites: list[tuple[str, str]]) -> Iterator[None]:
    """twinkle's kernels in place of ``transformers``' at ``sites`` (:func:`kernel_sites`) while the block runs."""
    if not sites:
        yield
        return
    with _LOCK:
        for site in sites:
            if _USERS[site] == 0:
                module, name = site
                _ORIGINALS[site] = getattr(sys.modules[module], name)
                setattr(sys.modules[module], name, _KERNELS[name])
            _USERS[site] += 1
    try:
        yield
    finally:
        with _LOCK:
            for site in sites:
                _USERS[site] -= 1
                if _USERS[site] == 0:
                    setattr(sys.modules[site[0]], site[1], _ORIGINALS.pop(site))
