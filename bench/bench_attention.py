"""Decode attention on CPU against reading its cache: PyTorch's kernels and the engine's own, against the memory floor.

    python bench/bench_attention.py                  # SmolLM2's shapes, 256 rows, 150 cached tokens
    python bench/bench_attention.py --rows 64 --tokens 100 200

One layer of one decode step with SmolLM2-135M's attention shapes (3 key /
value heads of 64, 9 query heads: 3 per group), float32, the cache a view
of a preallocated buffer as the torch engine keeps it, half the rows with a
quarter of their columns masked (shorter prompts). Side by side, best of
``--repeats``: the ``attention_kernel="sdpa"`` call (the group's query heads
as the query rows of one ``scaled_dot_product_attention`` with a boolean
mask), the same without a mask, ``q @ kᵀ`` alone (half the work), the
engine's native kernel (``twinkle_torch.native``, the default on CPU), and a
plain sum over the keys and values (the bytes attention must read, and
nothing else). The last columns are each attention's time over the read's:
what a kernel bound by memory alone would leave on the table.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import machine_summary


def _best(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _one_layer(rows: int, heads: int, group: int, dim: int, tokens: int, repeats: int) -> tuple[list[float], float]:
    """Seconds of each way over one layer's cache, and the megabytes of keys and values it holds."""
    import torch
    import torch.nn.functional as F

    capacity = tokens + 64  # room for the rest of the generation, as the engine's cache has
    key = torch.randn(rows, heads, capacity, dim)[:, :, :tokens]
    value = torch.randn(rows, heads, capacity, dim)[:, :, :tokens]
    query = torch.randn(rows, heads, group, dim)
    mask = torch.ones(rows, 1, 1, tokens, dtype=torch.bool)
    mask[: rows // 2, :, :, : tokens // 4] = False  # half the rows have a shorter prompt
    from twinkle_torch import native

    native.load()
    expected = F.scaled_dot_product_attention(query, key, value, attn_mask=mask).reshape(rows, heads * group, dim)
    got = native.decode_attention(query, key, value, mask, None)
    assert got is not None and torch.allclose(got, expected, atol=1e-5), "the native kernel disagrees with SDPA"
    timings = [
        _best(lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask), repeats),
        _best(lambda: F.scaled_dot_product_attention(query, key, value), repeats),
        _best(lambda: torch.matmul(query, key.transpose(-1, -2)), repeats),
        _best(lambda: native.decode_attention(query, key, value, mask, None), repeats),
        _best(lambda: (key.sum(), value.sum()), repeats),
    ]
    return timings, 2 * key.numel() * key.element_size() / 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tokens", type=int, nargs="+", default=[150], help="cached tokens per row")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3, help="query heads per key/value head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)

    import torch

    torch.manual_seed(0)
    rows, heads, group, dim = args.rows, args.kv_heads, args.group, args.head_dim
    print(machine_summary())
    print(f"{rows} rows, {heads} key/value heads x {group} query heads, head size {dim}, float32; ms per layer")
    print()
    print(
        "| cached tokens | MB read | SDPA, masked | SDPA, no mask | q @ kᵀ alone | native kernel, masked"
        " | read keys + values | SDPA / read | native / read | SDPA / native |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tokens in args.tokens:
        timings, megabytes = _one_layer(rows, heads, group, dim, tokens, args.repeats)
        cells = " | ".join(f"{t * 1e3:.2f}" for t in timings)
        sdpa, own, read = timings[0], timings[3], timings[4]
        print(
            f"| {tokens} | {megabytes:.0f} | {cells} | {sdpa / read:.1f}x | {own / read:.1f}x | **{sdpa / own:.1f}x** |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
