"""TorchSampler against Hugging Face ``generate``, side by side, on the same workload.

    python bench/bench_torch.py --preset quick   # about a minute on 2 idle CPU cores
    python bench/bench_torch.py --preset full    # the issue's workload: 32 prompts x 4 x 128 tokens

Workloads: the core's tiny test model and the built-in SmolLM2-135M-Instruct,
float32, chat prompts of mixed length, ``num_samples=4``, ``ignore_eos``,
temperature 1.0 and top_p 0.95. Each engine runs in its own process; the
table gives tokens/s, peak resident memory and their ratios to ``generate``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BENCH_PROMPTS, Runner, Workload, compare

PRESETS = {
    # (prompts, max_tokens) per model; timed repeats per child; rounds of the runners taking turns
    "quick": {"tiny": (32, 128), "smollm2": (16, 48), "repeats": 1, "rounds": 1},
    "full": {"tiny": (32, 128), "smollm2": (32, 128), "repeats": 2, "rounds": 2},
}


def workloads(preset: str, models: list[str]) -> list[Workload]:
    """The workloads of a preset (``models`` picks among ``tiny`` and ``smollm2``)."""
    spec = PRESETS[preset]
    out = []
    if "tiny" in models:
        from twinkle_core.testing import build_tiny_model

        n, tokens = spec["tiny"]
        out.append(
            Workload(
                name="tiny-llama", model_id=str(build_tiny_model("llama")), prompts=BENCH_PROMPTS[:n], max_tokens=tokens
            )
        )
    if "smollm2" in models:
        n, tokens = spec["smollm2"]
        out.append(
            Workload(
                name="smollm2-135m",
                model_id="builtin://smollm2-135m-instruct",
                prompts=BENCH_PROMPTS[:n],
                max_tokens=tokens,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark TorchSampler against HF generate.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per child process (best is reported)")
    parser.add_argument("--rounds", type=int, default=None, help="times the engines take turns (best is reported)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per engine (default: one per CPU)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    runners = [
        Runner("hf-generate", "harness:hf_generate_runner", {"device": args.device}),
        Runner("twinkle-torch", "harness:sampler_runner", {"engine": "torch", "device": args.device}),
    ]
    preset = PRESETS[args.preset]
    results = compare(
        runners,
        workloads(args.preset, args.models.split(",")),
        baseline="hf-generate",
        repeats=args.repeats or preset["repeats"],
        rounds=args.rounds or preset["rounds"],
        threads=args.threads,
    )
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
