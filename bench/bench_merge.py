"""Sampling time of one LoRA call on the vLLM engine: merged, unmerged, and the base model.

    python bench/bench_merge.py                       # the core's tiny Llama
    python bench/bench_merge.py --model builtin://smollm2-135m-instruct --max-tokens 64

One engine (LoRA on, float32, eager), one random rank-8 adapter on every
linear layer, the same greedy call (``--prompts`` x ``--samples``,
``--max-tokens`` with ``ignore_eos``) three ways, each the median of
``--repeats`` runs after a warm-up, in the same process: ratios matter, not
the absolute times (a shared machine moves those).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def _adapter(model_dir: Path, out: Path, rank: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    model.save_pretrained(str(out))
    return out


def _median_s(sampler: Any, prompts: list[Any], params: Any, adapter: str, repeats: int) -> float:
    sampler.sample(prompts, params, adapter_name=adapter)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler.sample(prompts, params, adapter_name=adapter)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    """Run the three calls and print a table (and JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="model id (default: the core's tiny Llama)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from twinkle_core import SamplingParams, Trajectory
    from twinkle_core.hub import resolve_model_id
    from twinkle_core.testing import build_tiny_model
    from twinkle_vllm.sampler import vLLMSampler

    model_dir = Path(resolve_model_id(args.model)) if args.model else build_tiny_model("llama")
    prompts = [
        Trajectory(messages=[{"role": "user", "content": f"Question {i}: tell me about the number {i}."}])
        for i in range(args.prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, num_samples=args.samples)
    engine_args = {
        "enforce_eager": True,
        "dtype": "float32",
        "kv_cache_memory_bytes": 1 << 30,
        "enable_lora": True,
        "max_lora_rank": args.rank,
    }
    with tempfile.TemporaryDirectory() as tmp, vLLMSampler(model_dir, engine_args=engine_args) as sampler:
        folder = _adapter(model_dir, Path(tmp) / "adapter", args.rank)
        base = _median_s(sampler, prompts, params, "", args.repeats)
        sampler.add_adapter_to_model("policy", folder)
        unmerged = _median_s(sampler, prompts, params, "policy", args.repeats)
        start = time.perf_counter()
        sampler.add_adapter_to_model("policy", folder, merge=True)
        merge_s = time.perf_counter() - start
        merged = _median_s(sampler, prompts, params, "policy", args.repeats)
    result = {
        "model": str(model_dir),
        "base_s": base,
        "unmerged_s": unmerged,
        "merged_s": merged,
        "merge_push_s": merge_s,
        "merged_over_base": merged / base,
        "unmerged_over_base": unmerged / base,
    }
    if args.json:
        print(json.dumps(result))
    print(f"{'call':<10}{'seconds':>10}{'x base':>9}")
    for label, value in (("base", base), ("unmerged", unmerged), ("merged", merged)):
        print(f"{label:<10}{value:>10.3f}{value / base:>9.2f}")
    print(f"merge push (re-adding with merge=True): {merge_s:.3f} s")


if __name__ == "__main__":
    main()
