"""Where an unmerged LoRA adapter on vLLM's Qwen3.5 (CPU, bfloat16) stands against the truth.

For one module kind at a time (attention ``q/k/v/o``, MLP, each Gated DeltaNet
projection) it builds a random adapter on the tiny Qwen3.5 and scores the
policy suite's prompts (top 8 log-probs at every prompt position) four ways:

- vLLM, the adapter loaded unmerged (vLLM's LoRA layers);
- vLLM, the adapter merged into the bfloat16 weights by ``update_weights``;
- ``transformers`` + ``peft`` in float32, the adapter unmerged (the exact result);
- vLLM's base model against ``transformers``' float32 base (the rounding floor).

Each vLLM scoring's gap to the float32 truth is printed, over the same tokens.
A LoRA not applied, applied to the wrong slice of a packed projection or
scaled wrong leaves the unmerged gap far above the merged one; bfloat16
rounding leaves them alike. ``--scales`` repeats it with adapters of other
magnitudes (the ``B`` factor's scale).

    python bench/probe_vllm_lora.py [--scales 0.05 0.2]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

#: One adapter per module kind the tiny Qwen3.5 has.
KINDS: tuple[tuple[str, ...], ...] = (
    ("q_proj",),
    ("k_proj",),
    ("v_proj",),
    ("o_proj",),
    ("gate_proj",),
    ("up_proj",),
    ("down_proj",),
    ("in_proj_qkv",),
    ("in_proj_z", "0:in_proj_qkv"),
    ("in_proj_qkv", "in_proj_z"),
    ("in_proj_b",),
    ("in_proj_a",),
    ("out_proj",),
)
FUSED = (
    ("in_proj_qkv", "in_proj_z"),
    ("in_proj_b", "in_proj_a"),
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("A_log", "dt_bias"),
)


def adapter_for(base_weights: Mapping[str, Any], kind: tuple[str, ...], scale: float) -> Any:
    """A random adapter on ``kind``'s modules; a module named ``0:<name>`` gets zero ``A`` and ``B`` (no change)."""
    from twinkle_core.testing.policy import random_lora

    zero = tuple(k[2:] for k in kind if k.startswith("0:"))
    targets = tuple(k.removeprefix("0:") for k in kind)
    return random_lora(base_weights, targets, seed=11, scale=scale, zero=zero)


def gaps(a: list[list[dict[int, float]]], b: list[list[dict[int, float]]]) -> str:
    """The largest and the mean difference of two scorings over the same tokens, as ``max/mean``."""
    diffs = [abs(x[t] - y[t]) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True) for t in x]
    return f"{max(diffs):.4f}/{sum(diffs) / len(diffs):.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", type=float, nargs="+", default=[0.05])
    parser.add_argument("--kinds", nargs="+", default=None, help="comma-joined module names, one adapter each")
    parser.add_argument("--engine-args", default="{}", help="extra vLLM engine options, JSON")
    args = parser.parse_args()

    import torch

    from twinkle_core.testing import build_tiny_model
    from twinkle_core.testing.policy import (
        PolicyContractTests,
        checkpoint_weights,
        merged_weights,
        score_gap,
        transformers_scores,
    )
    from twinkle_vllm.sampler import vLLMSampler

    kinds = [tuple(k.split(",")) for k in args.kinds] if args.kinds else list(KINDS)
    folder = build_tiny_model("qwen3_5")
    fp32: Mapping[str, Any] = checkpoint_weights(folder)
    base_weights: Mapping[str, Any] = {n: t.to(torch.bfloat16) for n, t in fp32.items()}
    suite = PolicyContractTests()
    suite.fused_weights = FUSED
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    options = dict(
        enforce_eager=True,
        kv_cache_memory_bytes=1 << 30,
        max_num_seqs=64,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
        max_cpu_loras=3,
        max_logprobs=vocab,
    )
    options.update(json.loads(args.engine_args))
    with vLLMSampler(folder, engine_args=options) as sampler:
        prompts = [list(f.input_ids) for f in suite.policy_prompts(sampler)]
        base = suite.scores(sampler)
        print(f"base model: vLLM bf16 vs HF fp32 {gaps(base, transformers_scores(folder, prompts, base))} (max/mean)")
        print(
            "kind | scale | effect: HF fp32 adapter vs base | vLLM unmerged vs HF+peft fp32 | vLLM merged vs HF+peft"
            " fp32 | HF+peft bf16 vs fp32 | vLLM unmerged vs merged | HF bf16: peft unmerged vs merged | HF fp32:"
            " peft unmerged vs merged",
            flush=True,
        )
        for scale in args.scales:
            for n, kind in enumerate(kinds):
                adapter = adapter_for(base_weights, kind, scale)
                name = f"probe-{n}-{scale}"
                sampler.add_adapter_to_model(name, adapter[0], weights=adapter[1])
                unmerged = suite.scores(sampler, name)
                sampler.remove_adapter(name)
                merged = merged_weights(base_weights, *adapter)
                sampler.update_weights(suite.with_siblings(merged, base_weights))
                served_merged = suite.scores(sampler)
                sampler.update_weights(dict(base_weights))
                truth = transformers_scores(folder, prompts, unmerged, adapter=adapter)
                peft_bf16 = transformers_scores(folder, prompts, unmerged, adapter=adapter, dtype="bfloat16")
                hf_merged = transformers_scores(folder, prompts, unmerged, weights=merged, dtype="bfloat16")
                fp32_merged = transformers_scores(folder, prompts, unmerged, weights=merged_weights(fp32, *adapter))
                effect = gaps(transformers_scores(folder, prompts, unmerged), truth)
                truth_m = transformers_scores(folder, prompts, served_merged, adapter=adapter)
                print(
                    f"{'+'.join(kind)} | {scale} | {effect} | {gaps(unmerged, truth)} | {gaps(served_merged, truth_m)}"
                    f" | {gaps(peft_bf16, truth)} | {score_gap(unmerged, served_merged):.4f} |"
                    f" {gaps(peft_bf16, hf_merged)} | {gaps(truth, fp32_merged)}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
