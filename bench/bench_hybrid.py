"""A Qwen3.5-shaped hybrid model on every engine, side by side: tokens/s and peak memory, bfloat16.

    python bench/bench_hybrid.py                       # batches 1 16 64 x 32 tokens
    python bench/bench_hybrid.py --batches 1 16 --tokens 16 --no-hf

The model is random (weights do not change the work) and built once, offline,
in Qwen3.5's shape scaled down to what two CPU cores sample in minutes:
eight layers, three Gated DeltaNet to one gated attention as in the real
family, hidden 1024, Gated DeltaNet heads of 128 (8 key heads, 16 value
heads, as the 0.8B and 2B have), attention 8 query and 2 KV heads of 128,
MLP 3,584 wide (the 0.8B's): 148M parameters.
The vocabulary is the tiny tokenizer's (768), so the head costs little and
the layers dominate, as they do in the real models. Every runner samples
the same chat prompts (one completion each, ``ignore_eos``, temperature 1,
top_p 0.95) in bfloat16:

* ``twinkle-torch``: the torch engine (``create_sampler("torch", ...)``);
* ``twinkle-vllm``: the vLLM engine;
* ``vllm-raw``: ``vllm.LLM.generate`` with the same engine options;
* ``hf-generate``: ``transformers``' ``generate``, one left-padded batch.

Each runner runs in its own process (``bench/harness.py``): its peak memory
(resident set) is its own. The table's ratios are against ``vllm-raw``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vllm import ENGINE_ARGS
from harness import Runner, Workload, compare, cycled_prompts

#: The scaled-down Qwen3.5 text model (see the module's docstring).
SHAPE: dict[str, Any] = dict(
    hidden_size=1024, intermediate_size=3584, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4,
)  # fmt: skip


def build_model(out: Path) -> Path:
    """The random Qwen3.5-shaped model in ``out`` (built once; the tiny Qwen3.5's tokenizer and template)."""
    if (out / "model.safetensors").is_file():
        return out
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from twinkle_core.testing import build_tiny_model

    tiny = build_tiny_model("qwen3_5")
    base = json.loads((tiny / "config.json").read_text(encoding="utf-8"))
    layers = int(SHAPE["num_hidden_layers"])
    config = Qwen3_5TextConfig(
        **{k: v for k, v in base.items() if k not in ("architectures", "transformers_version", "layer_types", *SHAPE)},
        **SHAPE,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
    )
    config.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for path in tiny.iterdir():
        if (
            path.suffix in (".json", ".jinja", ".txt")
            and path.name != "twinkle_tiny_model.json"
            and not (out / path.name).exists()
        ):
            shutil.copy2(path, out / path.name)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--model", type=Path, default=Path("/tmp/twinkle-bench-qwen3_5-scaled"))
    parser.add_argument("--no-hf", action="store_true", help="skip the hf-generate runner")
    args = parser.parse_args(argv)
    model = str(build_model(args.model))
    # vLLM's hybrid prefix cache needs chunked prefill, which is off on CPU: twinkle's engine turns the cache
    # off by itself (twinkle_vllm._hybrid); raw vLLM is told the same, so both arms run one engine
    engine_args = {k: v for k, v in ENGINE_ARGS.items() if k != "max_num_seqs"}
    engine_args |= {"max_num_seqs": 64, "enable_prefix_caching": False}
    runners = [
        Runner("vllm-raw", "bench_vllm:vllm_raw_runner", dict(engine_args)),
        Runner("twinkle-vllm", "harness:sampler_runner", {"engine": "vllm", "engine_args": dict(engine_args)}),
        Runner("twinkle-torch", "harness:sampler_runner", {"engine": "torch"}),
    ]
    if not args.no_hf:
        runners.append(Runner("hf-generate", "harness:hf_generate_runner", {}))
    workloads = [
        Workload(
            name=f"batch {batch}",
            model_id=model,
            prompts=cycled_prompts(batch),
            num_samples=1,
            max_tokens=args.tokens,
            dtype="bfloat16",
        )
        for batch in args.batches
    ]
    compare(runners, workloads, baseline="vllm-raw", repeats=args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
