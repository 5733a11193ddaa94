"""vLLMSampler against raw vLLM, TorchSampler and HF ``generate``; and weight-sync bandwidth.

    python bench/bench_vllm.py --preset quick   # about 3 minutes on 2 CPU cores
    python bench/bench_vllm.py --preset full    # 32 prompts x 4 samples x 128 tokens on SmolLM2
    python bench/bench_vllm.py --preset full --models smollm2 --no-torch --no-sync --repeats 1 --rounds 3
                                                # the vLLM engine against raw vLLM: median of 3 interleaved rounds

Sampling: the same workload (chat prompts of mixed length, ``num_samples=4``,
``ignore_eos``, temperature 1.0, top_p 0.95, float32) through

* ``vllm-raw``: ``vllm.LLM.generate`` on token ids, vLLM's defaults otherwise;
* ``twinkle-vllm``: ``vLLMSampler.sample`` with the same engine options;
* ``twinkle-torch`` and ``hf-generate`` (the torch engine's runners), for the ratios.

Each runner runs in its own process (``bench/harness.py``), one after the
other in the same run; the table gives tokens/s and ratios to ``vllm-raw``.
The target is ``twinkle-vllm`` >= 0.95x ``vllm-raw``.

Weight sync: ``update_weights`` of the model's full state dict into a running
vLLMSampler (shared-memory buckets, checksums, layerwise reload, prefix-cache
reset), seconds and GB/s, beside a plain ``copy_`` of the same tensors into
preallocated memory measured in the same process. Target: >= 0.3x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BENCH_PROMPTS, Runner, Workload, compare

#: Engine options shared by ``vllm-raw`` and ``twinkle-vllm`` (identical engines).
ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,  # no compile step: minutes of start-up on CPU for little gain here
    "kv_cache_memory_bytes": 2 << 30,
    "max_num_seqs": 256,
    "disable_log_stats": True,
}

PRESETS: dict[str, dict[str, Any]] = {
    # model -> (prompts, max_tokens); sync: timed weight updates; repeats: timed runs per runner
    "quick": {"models": {"smollm2": (16, 48)}, "sync": 3, "repeats": 1, "torch": False},
    "full": {"models": {"tiny": (32, 128), "smollm2": (32, 128)}, "sync": 5, "repeats": 2, "torch": True},
}


def _model_id(model: str) -> str:
    if model == "tiny":
        from twinkle_core.testing import build_tiny_model

        return str(build_tiny_model("llama"))
    try:
        from twinkle_core.hub import resolve_model_id

        resolve_model_id("builtin://smollm2-135m-instruct")
        return "builtin://smollm2-135m-instruct"
    except Exception as exc:  # pragma: no cover - no built-in model on this machine
        print(f"built-in SmolLM2 unavailable ({exc}); using the tiny model", file=sys.stderr)
        return _model_id("tiny")


# -- runners (executed in the harness's child processes) --------------------------------------
def vllm_raw_runner(workload: Workload, **engine_args: Any) -> Callable[[Workload], int]:
    """Raw ``vllm.LLM.generate`` on the chat prompts' token ids."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from twinkle_core.hub import resolve_model_id
    from twinkle_vllm._engine_args import platform_defaults

    path = str(resolve_model_id(workload.model_id))
    # the scheduler twinkle's engine runs with on this platform, so both arms run the same engine
    llm = LLM(model=path, dtype=workload.dtype, **{**platform_defaults(engine_args), **engine_args})
    tokenizer = llm.get_tokenizer()

    def run(w: Workload) -> int:
        prompts = [
            TokensPrompt(
                prompt_token_ids=list(
                    tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False)
                )
            )
            for m in w.prompts
        ]
        params = SamplingParams(
            n=w.num_samples,
            temperature=w.temperature,
            top_p=w.top_p,
            max_tokens=w.max_tokens,
            ignore_eos=w.ignore_eos,
        )
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.token_ids) for r in outputs for o in r.outputs)

    return run


# -- weight sync ----------------------------------------------------------------------------
def sync_child(model_id: str, repeats: int, bucket_mib: int = 0) -> dict[str, Any]:
    """In a fresh process: time update_weights of the full state dict against a plain copy."""
    import torch
    from safetensors.torch import load_file

    from twinkle_core.hub import resolve_model_id
    from twinkle_vllm.sampler import vLLMSampler

    path = resolve_model_id(model_id)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(file)))
    # Plain process memory, like a trainer's tensors (not pages of the checkpoint file).
    state = {k: v.to(torch.float32).clone() for k, v in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    extra = {"sync_bucket_bytes": bucket_mib << 20} if bucket_mib else {}
    sampler = vLLMSampler(
        path, engine_args={**ENGINE_ARGS, "dtype": "float32", "kv_cache_memory_bytes": 1 << 30}, **extra
    )
    # The plain memory copy of the same bytes, tensor by tensor, into preallocated
    # memory: numpy's copyto (a memcpy; faster than torch's copy_ on CPU).
    import numpy as np

    src = {k: v.view(-1).view(torch.uint8).numpy() for k, v in state.items()}
    dst = {k: np.empty_like(v) for k, v in src.items()}

    def copy_all() -> None:
        for k, v in src.items():
            np.copyto(dst[k], v)

    try:
        sampler.update_weights(state)  # warm-up: first session, buffers mapped
        copy_all()
        # Interleaved, best of each: both see the same moments of machine load.
        sync_times, copy_times, stats = [], [], {}
        for _ in range(repeats):
            t0 = time.perf_counter()
            sampler.update_weights(state)
            sync_times.append(time.perf_counter() - t0)
            stats = sampler.last_sync_stats
            t0 = time.perf_counter()
            copy_all()
            copy_times.append(time.perf_counter() - t0)
        buckets = stats.get("buckets", 0.0)
        # vLLM's own in-place reload of the same checkpoint (from the page cache, no
        # transport): the floor of applying weights in this engine on this platform.
        reload_times = []
        for _ in range(max(repeats - 1, 1)):
            t0 = time.perf_counter()
            sampler.engine._rpc("reload_weights")
            reload_times.append(time.perf_counter() - t0)
        text = sampler.sample(
            {"messages": [{"role": "user", "content": "Hello!"}]}, {"max_tokens": 8, "temperature": 0}
        )
        assert text[0].sequences[0].tokens, "the engine still samples after the syncs"
    finally:
        sampler.close()
    return {
        "bytes": nbytes,
        "tensors": len(state),
        "buckets": buckets,
        "sync_best_s": min(sync_times),
        "sync_median_s": statistics.median(sync_times),
        "copy_best_s": min(copy_times),
        "vllm_reload_best_s": min(reload_times),
        "phases": {k: round(v, 3) for k, v in stats.items() if k.startswith(("driver_", "worker_"))},
    }


def bench_sync(model_id: str, repeats: int, bucket_mib: int = 0) -> dict[str, Any]:
    """Run :func:`sync_child` in its own process and print the result."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--sync-child", model_id, str(repeats), str(bucket_mib)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("SYNC ")]
    if done.returncode != 0 or not lines:
        tail = (done.stdout + done.stderr).strip().splitlines()[-8:]
        print("weight sync: FAILED\n  " + "\n  ".join(tail))
        return {"error": tail}
    r = json.loads(lines[-1][5:])
    gb = r["bytes"] / 1e9
    sync_bw, copy_bw = gb / r["sync_best_s"], gb / r["copy_best_s"]
    print(
        f"weight sync ({model_id}): {r['tensors']} tensors, {gb:.3f} GB in {r['buckets']:.0f} buckets:"
        f" {r['sync_best_s']:.3f} s best ({r['sync_median_s']:.3f} s median) = {sync_bw:.2f} GB/s;"
        f" memcpy {r['copy_best_s']:.3f} s = {copy_bw:.2f} GB/s; ratio {sync_bw / copy_bw:.2f}x (target >= 0.3x)"
    )
    print(
        f"  for scale: vLLM's own reload_weights of the same checkpoint (no transport) {r['vllm_reload_best_s']:.3f} s"
        f" = {gb / r['vllm_reload_best_s']:.2f} GB/s ({r['vllm_reload_best_s'] / r['copy_best_s']:.1f} memcpys)"
    )
    print(f"  phases of the last sync (s): {r['phases']}")
    return {**r, "sync_gbps": sync_bw, "copy_gbps": copy_bw, "ratio": sync_bw / copy_bw}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--models", default=None, help="comma-separated: tiny, smollm2 (default: the preset's)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per engine (best is reported)")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="times the engines take turns; > 1 prints each round's ratios, their median",
    )
    parser.add_argument("--no-sync", action="store_true", help="skip the weight-sync measurement")
    parser.add_argument("--no-torch", action="store_true", help="skip the twinkle-torch and hf-generate runners")
    parser.add_argument("--bucket-mib", type=int, default=0, help="weight-sync bucket size (default: the sampler's)")
    parser.add_argument("--sync-only", action="store_true", help="only the weight-sync measurement")
    parser.add_argument("--sync-child", nargs=3, metavar=("MODEL", "REPEATS", "BUCKET_MIB"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sync_child:
        model, repeats, bucket = args.sync_child
        print("SYNC " + json.dumps(sync_child(model, int(repeats), int(bucket))), flush=True)
        return 0

    preset = PRESETS[args.preset]
    models = args.models.split(",") if args.models else list(preset["models"])
    if args.sync_only:
        return 1 if "error" in bench_sync(_model_id(models[-1]), preset["sync"], args.bucket_mib) else 0
    workloads = []
    for model in models:
        n, tokens = preset["models"].get(model, (16, 64))
        workloads.append(
            Workload(name=f"{model}", model_id=_model_id(model), prompts=BENCH_PROMPTS[:n], max_tokens=tokens)
        )
    runners = [
        Runner("vllm-raw", "bench_vllm:vllm_raw_runner", dict(ENGINE_ARGS)),
        Runner("twinkle-vllm", "harness:sampler_runner", {"engine": "vllm", "engine_args": dict(ENGINE_ARGS)}),
    ]
    if preset["torch"] and not args.no_torch:
        runners += [
            Runner("twinkle-torch", "harness:sampler_runner", {"engine": "torch"}),
            Runner("hf-generate", "harness:hf_generate_runner", {}),
        ]
    repeats = args.repeats or preset["repeats"]
    results = compare(runners, workloads, baseline="vllm-raw", repeats=repeats, rounds=args.rounds)
    failed = any(r.error for r in results)
    if not args.no_sync:
        print()
        sync = bench_sync(_model_id(models[-1]), preset["sync"], args.bucket_mib)
        failed = failed or "error" in sync
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
