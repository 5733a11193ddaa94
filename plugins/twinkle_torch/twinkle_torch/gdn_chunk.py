"""The Gated DeltaNet prefill on a CPU: ``transformers``' chunked kernel, with its triangular solve in blocks.

A Gated DeltaNet layer prefills a prompt with ``transformers``'
``torch_chunk_gated_delta_rule`` when ``flash-linear-attention`` is not
installed. It cuts the prompt into chunks of 64 tokens; within a chunk the
delta rule's sequential updates are one unit lower-triangular system
(``(I + strictly lower(beta k k^T * decay)) X = [beta v | beta k exp(g)]``),
solved with ``torch.linalg.solve_triangular`` twice, once for the values and
once for the keys. On a CPU that batched solve is LAPACK's, one small matrix
at a time: at 64 prompts of 52 tokens and 16 heads it is 40% of the
function's time, about ten times a matrix product of the same size.

:func:`chunk_gated_delta_rule` computes the same quantities:

* the system is solved once for values and keys together, in blocks of 16
  rows: each block's own 16 x 16 triangle is inverted (the only LAPACK call,
  cheap at that size) and everything else is a batched matrix product;
* the padding of the last chunk to 64 tokens is not computed (a 52-token
  prompt is one chunk of 52);
* a chunk with no state before it (the first, without an initial state) reads
  no state, and the state after the last is computed only when asked for;
* the tensors are cast to float32 and laid out by heads once, as
  ``transformers`` does, and the output is laid back and cast in one pass.

The results are ``transformers``' own up to float32 rounding order.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["chunk_gated_delta_rule"]

#: Rows of the triangular system solved by one small inverse; the rest are matrix products.
_BLOCK = 16


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``transformers``' ``torch_chunk_gated_delta_rule`` (same arguments and results), solved in blocks.

    The arguments and results are those of :func:`twinkle_torch.gdn.recurrent_gated_delta_rule`, plus
    ``chunk_size``, the most tokens solved as one system; ``initial_state`` is read, never written.
    """
    dtype = query.dtype
    batch, tokens, heads, key_dim = key.shape
    value_dim = value.shape[-1]
    q, k, v, b, decay = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (query, key, value, beta, g)
    )
    scale = key_dim**-0.5
    if use_qk_l2norm_in_kernel:
        q = q * (torch.rsqrt((q * q).sum(dim=-1, keepdim=True) + 1e-6) * scale)
        k = k * torch.rsqrt((k * k).sum(dim=-1, keepdim=True) + 1e-6)
    else:
        q = q * scale
    state = None if initial_state is None else initial_state.to(torch.float32)
    parts = []
    for start in range(0, tokens, chunk_size):
        end = min(tokens, start + chunk_size)
        out, state = _chunk(
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], b[:, :, start:end], decay[:, :, start:end],
            state, last=end == tokens and not output_final_state,
        )  # fmt: skip
        parts.append(out)
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    if output_final_state and state is None:  # no tokens
        state = torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float32, device=value.device)
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state


def _chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    decay: torch.Tensor,
    state: torch.Tensor | None,
    *,
    last: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: its outputs ``[batch, heads, n, value dim]`` and the state after it (``None`` when ``last``)."""
    n = q.shape[2]
    value_dim = v.shape[-1]
    g = decay.cumsum(dim=-1)  # the log decay from the chunk's start to each token
    later = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
    pair = (g.unsqueeze(-1) - g.unsqueeze(-2)).masked_fill_(later, float("-inf")).exp_()  # exp(g_i - g_j), j <= i
    kt = k.transpose(-1, -2)
    bc = b.unsqueeze(-1)
    system = (k @ kt).mul_(bc).mul_(pair)
    attn = (q @ kt).mul_(pair)
    solved = _solve_unit_lower(system, torch.cat((v * bc, k * (bc * g.exp().unsqueeze(-1))), dim=-1))
    fresh, read = solved[..., :value_dim], solved[..., value_dim:]
    if state is None:
        out = attn @ fresh
    else:
        fresh = fresh - read @ state  # what the state before the chunk does not already predict
        out = (q * g.exp().unsqueeze(-1)) @ state + attn @ fresh
    if last:
        return out, None
    end = g[..., -1:]
    written = (k * (end - g).exp().unsqueeze(-1)).transpose(-1, -2) @ fresh
    return out, written if state is None else state * end.exp().unsqueeze(-1) + written


def _solve_unit_lower(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``X`` with ``(I + strictly lower(system)) X = rhs``: per block of rows, a small inverse and matrix products."""
    size = system.shape[-1]
    solved = torch.empty_like(rhs)
    for start in range(0, size, _BLOCK):
        end = min(size, start + _BLOCK)
        part = rhs[..., start:end, :]
        if start:
            part = part - system[..., start:end, :start] @ solved[..., :start, :]
        eye = torch.eye(end - start, dtype=rhs.dtype, device=rhs.device).expand(*system.shape[:-2], -1, -1)
        inverse = torch.linalg.solve_triangular(system[..., start:end, start:end], eye, upper=False, unitriangular=True)
        solved[..., start:end, :] = inverse @ part
    return solved
