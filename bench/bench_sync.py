"""Weight sync against its floor: ``update_weights`` beside vLLM's own ``reload_weights`` of the same tensors.

    python bench/bench_sync.py                    # SmolLM2-135M, float32, 5 interleaved repeats
    python bench/bench_sync.py --bucket-mib 64    # another staging slot size

One vLLM engine (CPU build here), one process. For each share of the model's
weights (10%, 50% and 100% of the bytes, whole tensors in state-dict order,
plus one small tensor for the fixed cost) it times, interleaved so both see
the same moments of machine load:

* ``update_weights`` of those tensors from the driver (validation, the
  checksummed bucket channel, vLLM's layerwise reload in the worker), with
  the default non-finite scan and with ``check_finite=False``;
* the floor: vLLM's ``reload_weights`` of the *same* tensors, already in the
  worker's memory (no transport, no checksum), timed from the driver through
  the same ``collective_rpc`` round trip.

It prints medians and bests, the ratio to the floor (target: at most 1.15x
for the whole model), and a least-squares fit ``seconds = fixed + bytes /
bandwidth`` over the partial updates. Ratios matter, not absolute times: the
machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

#: Engine options of bench_vllm.py's sync measurement.
ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "kv_cache_memory_bytes": 1 << 30,
    "max_num_seqs": 256,
    "disable_log_stats": True,
    "dtype": "float32",
}
SHARES = (0.1, 0.5, 1.0)


def _subset(state: dict[str, Any], share: float) -> list[str]:
    """Whole tensors in state-dict order until ``share`` of the bytes is reached."""
    total = sum(t.numel() * t.element_size() for t in state.values())
    names, used = [], 0
    for name, tensor in state.items():
        if used >= share * total:
            break
        names.append(name)
        used += tensor.numel() * tensor.element_size()
    return names


def run(model_id: str, repeats: int, bucket_mib: int) -> dict[str, Any]:
    """Time every share, interleaved; return the raw numbers."""
    import torch
    from _worker_hooks import bench_worker_hooks
    from safetensors.torch import load_file, save_file

    from twinkle_core.hub import resolve_model_id
    from twinkle_vllm import ReplayStore
    from twinkle_vllm.sampler import vLLMSampler

    path = resolve_model_id(model_id)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(file)))
    # Plain process memory in the engine's dtype, like a trainer's tensors.
    state = {k: v.to(torch.float32).clone() for k, v in state.items()}
    extra = {"sync_bucket_bytes": bucket_mib << 20} if bucket_mib else {}
    store = ReplayStore()  # ours: the channel-only timing turns its weight copies off and on
    with bench_worker_hooks():  # the floor's worker methods (not in the shipped extension)
        sampler = vLLMSampler(path, engine_args=ENGINE_ARGS, replay_store=store, **extra)
    # The smallest tensor alone: what a sync costs beyond its bytes.
    smallest = min(state, key=lambda k: state[k].numel())
    cases = {f"{round(share * 100)}%": _subset(state, share) for share in SHARES}
    cases = {"1 tensor": [smallest], **cases}
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as folder:
        file = os.path.join(folder, "state.safetensors")
        save_file(state, file)
        try:
            sampler.engine._rpc("twinkle_bench_stage", file)
            os.unlink(file)  # the worker holds its own copy; free the page cache
            for label, names in cases.items():
                tensors = [(n, state[n]) for n in names]
                times: dict[str, list[float]] = {
                    "update": [],
                    "update_nocheck": [],
                    "update_channel": [],
                    "floor": [],
                    "floor_worker": [],
                }
                sampler.update_weights(tensors)  # warm-up
                sampler.engine._rpc("twinkle_bench_reload", names)
                phases: dict[str, float] = {}
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    sampler.update_weights(tensors)
                    times["update"].append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    sampler.update_weights(tensors, check_finite=False)
                    times["update_nocheck"].append(time.perf_counter() - t0)
                    # The channel alone: no scan, and no host copy kept for replay after an engine restart.
                    store.keep_weights = False
                    t0 = time.perf_counter()
                    sampler.update_weights(tensors, check_finite=False)
                    times["update_channel"].append(time.perf_counter() - t0)
                    store.keep_weights = True
                    phases = sampler.last_sync_stats
                    t0 = time.perf_counter()
                    inside = sampler.engine._rpc("twinkle_bench_reload", names)[0]
                    times["floor"].append(time.perf_counter() - t0)
                    times["floor_worker"].append(float(inside))
                pairs = [u / f for u, f in zip(times["update"], times["floor"])]
                pairs_nocheck = [u / f for u, f in zip(times["update_nocheck"], times["floor"])]
                pairs_channel = [u / f for u, f in zip(times["update_channel"], times["floor"])]
                rows[label] = {
                    # each repeat's update over the floor timed right after it: robust to load that drifts
                    "paired_ratio_median": statistics.median(pairs),
                    "paired_ratio_nocheck_median": statistics.median(pairs_nocheck),
                    "paired_ratio_channel_median": statistics.median(pairs_channel),
                    "tensors": len(names),
                    "bytes": sum(state[n].numel() * state[n].element_size() for n in names),
                    **{f"{k}_median_s": statistics.median(v) for k, v in times.items()},
                    **{f"{k}_best_s": min(v) for k, v in times.items()},
                    "phases": {k: round(v, 4) for k, v in phases.items()},
                }
                print(label, json.dumps(rows[label]), file=sys.stderr, flush=True)
            reply = sampler.sample({"messages": [{"role": "user", "content": "Hi"}]}, {"max_tokens": 4})
            assert reply[0].sequences[0].tokens, "the engine still samples after the syncs"
        finally:
            sampler.close()
    return {"model": model_id, "repeats": repeats, "bucket_mib": bucket_mib, "rows": rows}


def report(result: dict[str, Any]) -> str:
    """A markdown table, the ratio to the floor, and the fixed + per-byte fit."""
    from harness import machine_summary

    rows = result["rows"]
    lines = [
        f"model {result['model']}, float32, {result['repeats']} interleaved repeats;"
        f" bucket {result['bucket_mib'] or 'default'} MiB; {machine_summary()}",
        "",
        "| update | tensors | MB | update_weights median (best) | check_finite=False median (best)"
        " | channel alone median (best) | floor: reload_weights median (best)"
        " | ratio to floor, median of paired repeats: default / no scan / channel alone |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, r in rows.items():
        lines.append(
            f"| {label} | {r['tensors']} | {r['bytes'] / 1e6:.1f}"
            f" | {r['update_median_s']:.3f} s ({r['update_best_s']:.3f})"
            f" | {r['update_nocheck_median_s']:.3f} s ({r['update_nocheck_best_s']:.3f})"
            f" | {r['update_channel_median_s']:.3f} s ({r['update_channel_best_s']:.3f})"
            f" | {r['floor_median_s']:.3f} s ({r['floor_best_s']:.3f})"
            f" | {r['paired_ratio_median']:.2f}x / {r['paired_ratio_nocheck_median']:.2f}x"
            f" / {r['paired_ratio_channel_median']:.2f}x |"
        )
    # seconds = fixed + bytes / bandwidth, least squares over every case
    xs = [r["bytes"] / 1e9 for r in rows.values()]
    for key, what in (("update", "update_weights"), ("floor", "reload_weights")):
        ys = [r[f"{key}_median_s"] for r in rows.values()]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        lines.append(
            f"\n{what}: {my - slope * mx:.3f} s fixed + {slope:.3f} s per GB ({1 / slope:.2f} GB/s), least squares"
        )
    lines.append(f"\nphases of the last full sync (s): {rows[list(rows)[-1]]['phases']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mib", type=int, default=0, help="staging slot size (default: the sampler's)")
    parser.add_argument("--json", default=None, help="also write the raw numbers here")
    args = parser.parse_args(argv)
    result = run(args.model, args.repeats, args.bucket_mib)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    print(report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
