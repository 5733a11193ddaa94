"""One Gated DeltaNet layer's kernels, ``transformers``' against the torch engine's, interleaved in one process.

    python bench/bench_gdn_kernels.py                          # 16 and 64 rows, prompts of 52 tokens, 3 rounds
    python bench/bench_gdn_kernels.py --rows 64 --rounds 5

The layer is ``bench/bench_hybrid.py``'s (16 value heads of 128, keys
repeated to 16 heads), on random bfloat16 inputs, float32 state:

* ``prefill``: ``transformers``' ``torch_chunk_gated_delta_rule`` against
  :func:`twinkle_torch.gdn_chunk.chunk_gated_delta_rule` on ``rows`` prompts
  of ``--tokens`` tokens, final state asked for;
* ``decode``: one token's recurrence and the layer's copy of the new state
  into its cache, ``transformers``' ``torch_recurrent_gated_delta_rule``
  against :data:`twinkle_torch.gdn.decode_step` (which updates the cache's
  state in place, so the copy is onto itself), and ``decode twinkle, new``:
  the same recurrence returning a new state, as it did before.

Each round runs both, one after the other, so that a machine shared with
other work slows both alike; the table gives every round and the median.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

HEADS, DIM = 16, 128


def _inputs(rows: int, tokens: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, tokens, HEADS, DIM, generator=gen).to(torch.bfloat16) for _ in range(3))
    g = -torch.rand(rows, tokens, HEADS, generator=gen)
    beta = torch.rand(rows, tokens, HEADS, generator=gen).to(torch.bfloat16)
    return {"query": q, "key": k, "value": v, "g": g, "beta": beta}


def _rounds(arms: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    for run in arms.values():  # warm-up
        run()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, run in arms.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def _arms(rows: int, tokens: int) -> dict[str, Callable[[], object]]:
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from twinkle_torch.gdn import decode_step, recurrent_gated_delta_rule
    from twinkle_torch.gdn_chunk import chunk_gated_delta_rule

    options = {"output_final_state": True, "use_qk_l2norm_in_kernel": True}
    prompt = _inputs(rows, tokens)
    step = _inputs(rows, 1)
    cache = torch.randn(rows, HEADS, DIM, DIM, generator=torch.Generator().manual_seed(1)) * 0.01

    def decode(kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
        cache.copy_(kernel(**step, initial_state=cache, **options)[1])  # what the layer does with the state

    return {
        "prefill transformers": lambda: modeling_qwen3_5.torch_chunk_gated_delta_rule(**prompt, **options),
        "prefill twinkle": lambda: chunk_gated_delta_rule(**prompt, **options),
        "decode transformers": lambda: decode(modeling_qwen3_5.torch_recurrent_gated_delta_rule),
        "decode twinkle, new": lambda: decode(recurrent_gated_delta_rule),
        "decode twinkle": lambda: decode(decode_step),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--tokens", type=int, default=52, help="prompt tokens of the prefill")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    for rows in args.rows:
        for name, times in _rounds(_arms(rows, args.tokens), args.rounds).items():
            rounds = " ".join(f"{t * 1e3:.0f}" for t in times)
            print(f"{rows:>4} rows  {name:<22} median {statistics.median(times) * 1e3:8.1f} ms   rounds: {rounds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
