"""The sampler/trainer log-prob gap on a hybrid (Gated DeltaNet) model, for each engine.

    python bench/bench_hybrid_gap.py                      # the tiny Qwen3.5, 16 prompts x 4 samples x 48 tokens
    python bench/bench_hybrid_gap.py --model PATH --prompts 8 --samples 2

An RL trainer scores the sampler's tokens with its own forward. On a hybrid
model the engines run the recurrent form of the Gated DeltaNet kernel one
token at a time while a trainer's full forward runs the chunked form, in
another order of sums, and the difference is carried through the state; in
bfloat16 each side also rounds differently. This measures what that costs:
each engine samples (temperature 1, seeded) and the same tokens are scored by
``transformers``' full forward in bfloat16 (the dtype a trainer trains in)
and float32. Per engine and trainer dtype, over every completion token:

* the mean and largest ``|trainer - sampler|`` log-prob;
* the k3 estimate of ``KL(sampler || trainer)`` per token
  (``exp(r) - 1 - r`` with ``r = trainer - sampler``), the number peers quote
  as the "step-0 KL";
* the largest gap of a sequence's summed log-prob (what a sequence-level
  importance ratio multiplies).

Numerics only: the machine's load changes the times, not these numbers.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import cycled_prompts, machine_summary

ENGINES = ("torch/float32", "torch/bfloat16", "vllm/bfloat16")


def _sample(engine: str, model: Path, prompts: int, samples: int, tokens: int) -> list[tuple[list[int], Any]]:
    """``(prompt ids, sequence)`` of every sample the engine draws."""
    from twinkle_core import SamplingParams, Trajectory, create_sampler

    name, dtype = engine.split("/")
    options: dict[str, Any] = {"dtype": dtype} if name == "torch" else {"engine_args": {"enforce_eager": True}}
    params = SamplingParams(
        temperature=1.0, max_tokens=tokens, ignore_eos=True, logprobs=0, num_samples=samples, seed=7
    )
    with create_sampler(name, str(model), **options) as sampler:
        results = sampler.sample([Trajectory(messages=m) for m in cycled_prompts(prompts)], params)
    return [(list(r.prompt_token_ids), s) for r in results for s in r.sequences]


def _trainer_scores(model: Path, dtype: str, drawn: list[tuple[list[int], Any]]) -> list[list[float]]:
    """The completion tokens' log-probs under ``transformers``' full forward of prompt + completion."""
    import torch
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(str(model), dtype=getattr(torch, dtype)).eval()
    out = []
    with torch.no_grad():
        for prompt, sequence in drawn:
            ids = torch.tensor([prompt + list(sequence.tokens)])
            logits = trainer(ids).logits[0, len(prompt) - 1 : -1].float()
            chosen = torch.tensor(sequence.tokens).unsqueeze(-1)
            out.append(torch.log_softmax(logits, dim=-1).gather(-1, chosen).squeeze(-1).tolist())
    return out


def _row(engine: str, trainer: str, drawn: list[tuple[list[int], Any]], scores: list[list[float]]) -> str:
    gaps, k3, sums = [], [], []
    for (_, sequence), theirs in zip(drawn, scores):
        ours = [float(x) for x in sequence.logprobs]
        ratios = [t - s for s, t in zip(ours, theirs)]
        gaps += [abs(r) for r in ratios]
        k3 += [math.exp(r) - 1 - r for r in ratios]
        sums.append(abs(sum(ratios)))
    return (
        f"| {engine} | {trainer} | {len(gaps)} | {statistics.fmean(gaps):.2e} | {max(gaps):.2e} "
        f"| {statistics.fmean(k3):.2e} | {max(sums):.2e} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a hybrid model folder (default: the tiny Qwen3.5)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args(argv)
    if args.model:
        model = Path(args.model)
    else:
        from twinkle_core.testing import build_tiny_model

        model = build_tiny_model("qwen3_5")
    print(machine_summary())
    print(f"model {model}; {args.prompts} prompts x {args.samples} samples x {args.tokens} tokens, T=1, seed 7\n")
    rows = []
    for engine in args.engines:
        drawn = _sample(engine, model, args.prompts, args.samples, args.tokens)
        for trainer in ("bfloat16", "float32"):
            rows.append(_row(engine, f"transformers {trainer}", drawn, _trainer_scores(model, trainer, drawn)))
    header = ("sampler", "trainer forward", "tokens", "mean gap (nats)", "largest gap", "KL k3 per token")
    print("| " + " | ".join((*header, "largest sequence-sum gap")) + " |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
