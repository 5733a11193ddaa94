"""What ``return_routed_experts`` costs the torch engine: tokens/s with and without, one run.

A random Qwen3-MoE model (built here, no download; the layer count, experts
and top-k are options) samples the same batch with and without routes,
alternately, ``--repeats`` times each; the best of each is compared::

    python bench/bench_routes.py                      # 8 layers, 32 experts, top-4, 16 prompts x 4 samples
    python bench/bench_routes.py --layers 16 --experts 64 --top-k 8
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.testing.tiny_random import save_random_model


def build(out: Path, layers: int, experts: int, top_k: int) -> None:
    """A random Qwen3-MoE of the given shape in ``out``, with the tiny Llama's tokenizer."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=768, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048, pad_token_id=0,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=256, tie_word_embeddings=False,
    )  # fmt: skip
    save_random_model(config, out, std=0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from twinkle_torch import TorchSampler

    words = ["tell me " * (1 + i % 7) + "a story" for i in range(args.prompts)]
    prompts = [Trajectory(messages=[{"role": "user", "content": text}]) for text in words]
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=args.max_tokens, ignore_eos=True, num_samples=args.samples, logprobs=0
    )
    best = {"without routes": 0.0, "with routes": 0.0}
    with tempfile.TemporaryDirectory() as folder:
        build(Path(folder), args.layers, args.experts, args.top_k)
        with TorchSampler(folder, device="cpu") as sampler:
            sampler.sample(prompts[:2], params.replace(max_tokens=4))  # warm up
            for _ in range(args.repeats):
                for label, routes in (("without routes", False), ("with routes", True)):
                    clock = time.perf_counter()
                    results = sampler.sample(prompts, params.replace(return_routed_experts=routes))
                    seconds = time.perf_counter() - clock
                    tokens = sum(len(s.tokens) for r in results for s in r.sequences)
                    best[label] = max(best[label], tokens / seconds)
    print(
        f"Qwen3-MoE {args.layers} layers, {args.experts} experts, top-{args.top_k}; {args.prompts} prompts x"
        f" {args.samples} samples x {args.max_tokens} tokens; best of {args.repeats}, torch {torch.__version__},"
        f" {torch.get_num_threads()} threads"
    )
    base = best["without routes"]
    for label, rate in best.items():
        print(f"  {label:<15} {rate:9.1f} tok/s   {rate / base:.3f}x")
    print(f"  overhead of returning routes: {100 * (1 - best['with routes'] / base):.1f}%")


if __name__ == "__main__":
    main()
