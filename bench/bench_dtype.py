"""The torch engine in bfloat16 against float32: speed side by side, and what the switch costs in exactness.

    python bench/bench_dtype.py                          # SmolLM2, batch 16 64 256 x 64 tokens
    python bench/bench_dtype.py --batches 64 --tokens 32

One process, ``builtin://smollm2-135m-instruct`` (or ``--model``), the
scaling workload (chat prompts from ``harness.BENCH_PROMPTS``, one completion
each, ``ignore_eos``, temperature 1.0, top_p 0.95), through the torch engine
built once with ``dtype="float32"`` and once with ``dtype="bfloat16"``:

* **speed**: tokens/s of each batch size (after a warm-up; every row seeded), and their ratio;
* **log-probs**: the float32 engine samples completions (seeded); both
  engines then score each prompt + completion (``prompt_logprobs``), and the
  table gives how far the bfloat16 log-prob of each completion token is from
  the float32 one (mean, 99th percentile, largest), and the same for the
  sequence's summed log-prob (what a policy-gradient ratio multiplies);
* **greedy**: the share of greedy completions that are token for token the
  same under both, and the mean position of the first difference.

Whether the CPU has native bfloat16 (``avx512_bf16`` / AMX), as oneDNN reports
it, is printed: the speed-up measured on one that has it says nothing about one without.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import cycled_prompts, machine_summary

DTYPES = ("float32", "bfloat16")


def _speed(sampler: Any, batches: list[int], tokens: int) -> dict[int, float]:
    from twinkle_core import SamplingParams, Trajectory

    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=tokens, ignore_eos=True, seed=0)
    sampler.sample([Trajectory(messages=m) for m in cycled_prompts(4)], params)  # warm-up
    out = {}
    for batch in batches:
        t0 = time.perf_counter()
        res = sampler.sample([Trajectory(messages=m) for m in cycled_prompts(batch)], params)
        seconds = time.perf_counter() - t0
        out[batch] = sum(len(s.tokens) for r in res for s in r.sequences) / seconds
    return out


def _scores(sampler: Any, sequences: list[tuple[list[int], int]]) -> list[list[float]]:
    """Each sequence's completion-token log-probs (the last ``n`` positions), scored as a prompt."""
    from twinkle_core import InputFeature, SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    res = sampler.sample([InputFeature(input_ids=ids) for ids, _ in sequences], params)
    return [[float(x) for x in r.prompt_logprobs[-n:]] for r, (_, n) in zip(res, sequences)]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion")
    parser.add_argument("--parity-prompts", type=int, default=32, help="completions compared for log-probs and greedy")
    args = parser.parse_args(argv)

    import torch

    from twinkle_core import SamplingParams, Trajectory, create_sampler

    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) if hasattr(torch.ops, "mkldnn") else False
    speed: dict[str, dict[int, float]] = {}
    greedy: dict[str, list[list[int]]] = {}
    scored: dict[str, list[list[float]]] = {}
    sequences: list[tuple[list[int], int]] = []
    prompts = [Trajectory(messages=m) for m in cycled_prompts(args.parity_prompts)]
    for dtype in DTYPES:
        with create_sampler("torch", model_id=args.model, dtype=dtype) as sampler:
            speed[dtype] = _speed(sampler, args.batches, args.tokens)
            res = sampler.sample(prompts, SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True))
            greedy[dtype] = [r.sequences[0].tokens for r in res]
            if not sequences:  # the float32 engine's samples are the sequences both score
                params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=args.tokens, ignore_eos=True, seed=1)
                sampled = sampler.sample(prompts, params)
                sequences = [(r.prompt_token_ids + r.sequences[0].tokens, len(r.sequences[0].tokens)) for r in sampled]
            scored[dtype] = _scores(sampler, sequences)
        print(f"{dtype}: done", file=sys.stderr, flush=True)

    print(machine_summary())
    print(f"native bfloat16 on this CPU (oneDNN): {native}")
    print(f"{args.model}, torch engine, {args.tokens} tokens per completion, temperature 1.0, top_p 0.95")
    print()
    print("| batch | float32 tok/s | bfloat16 tok/s | bfloat16 / float32 |")
    print("|---|---|---|---|")
    for batch in args.batches:
        a, b = speed["float32"][batch], speed["bfloat16"][batch]
        print(f"| {batch} | {a:.0f} | {b:.0f} | **{b / a:.2f}x** |")
    print()
    token_diff = [abs(b - a) for ra, rb in zip(scored["float32"], scored["bfloat16"]) for a, b in zip(ra, rb)]
    seq_diff = [abs(sum(rb) - sum(ra)) for ra, rb in zip(scored["float32"], scored["bfloat16"])]
    print(f"log-probs of {len(token_diff)} sampled completion tokens ({len(seq_diff)} completions),", end=" ")
    print("|bfloat16 - float32|:")
    print("| | mean | p99 | max |")
    print("|---|---|---|---|")
    for name, values in (("per token", token_diff), ("per completion (sum)", seq_diff)):
        p99 = f"{_percentile(values, 0.99):.4f}" if len(values) >= 100 else "n/a (under 100 values)"
        print(f"| {name} | {statistics.fmean(values):.4f} | {p99} | {max(values):.4f} |")
    same = sum(a == b for a, b in zip(greedy["float32"], greedy["bfloat16"]))
    first = [
        next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        for a, b in zip(greedy["float32"], greedy["bfloat16"])
    ]
    print()
    print(
        f"greedy: {same} of {len(first)} completions the same token for token; first difference at token"
        f" {statistics.fmean(first):.1f} on average (of {args.tokens})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
