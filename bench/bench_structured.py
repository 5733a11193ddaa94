"""Structured decoding against unconstrained decoding, per engine: the same prompts, one table.

    python bench/bench_structured.py                       # torch on SmolLM2-135M, JSON schema
    python bench/bench_structured.py --engines torch,vllm --models tiny,smollm2

Each engine runs the workload twice, in separate processes: unconstrained, and
with ``structured_outputs`` set to a JSON schema whose one string field lets
the model write for the whole budget (so both runs generate about as many
tokens). The table gives tokens/s and the constrained/unconstrained ratio per
engine (the issue's target for the torch engine: at least 0.8x).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from harness import BENCH_PROMPTS, Runner, Workload, compare

#: A schema the model can fill for as long as it likes: one free-text field.
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}, "confident": {"type": "boolean"}},
    "required": ["answer", "confident"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Structured (JSON schema) against unconstrained decoding.")
    parser.add_argument("--engines", default="torch", help="comma-separated: torch, vllm")
    parser.add_argument("--models", default="smollm2", help="comma-separated: tiny, smollm2")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    models = {
        "smollm2": "builtin://smollm2-135m-instruct",
    }
    if "tiny" in args.models:
        from twinkle_core.testing import build_tiny_model

        models["tiny"] = str(build_tiny_model("llama"))
    engine_kwargs: dict[str, dict[str, Any]] = {
        "torch": {"device": "cpu"},
        "vllm": {"engine_args": {"gpu_memory_utilization": 0.1, "max_model_len": 2048}},
    }
    failed = False
    for engine in args.engines.split(","):
        runners = [
            Runner(f"{engine}-plain", "harness:sampler_runner", {"engine": engine, **engine_kwargs[engine]}),
            Runner(
                f"{engine}-json-schema",
                "harness:sampler_runner",
                {"engine": engine, "sampling": {"structured_outputs": {"json": SCHEMA}}, **engine_kwargs[engine]},
            ),
        ]
        workloads = [
            Workload(
                name=f"{name}",
                model_id=models[name],
                prompts=BENCH_PROMPTS[: args.prompts],
                max_tokens=args.max_tokens,
                num_samples=2,
                ignore_eos=True,
            )
            for name in args.models.split(",")
        ]
        results = compare(
            runners,
            workloads,
            baseline=f"{engine}-plain",
            repeats=args.repeats,
            rounds=args.rounds,
            threads=args.threads,
        )
        failed = failed or any(r.error for r in results)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
