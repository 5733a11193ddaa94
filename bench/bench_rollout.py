"""Long-tail rollouts: a streaming driver that keeps the engine full against batch ``sample()`` steps.

    python bench/bench_rollout.py --engine vllm                 # tiny model, a few minutes on 2 CPU cores
    python bench/bench_rollout.py --engine vllm --model smollm2

The workload (fixed, so both drivers generate exactly the same tokens): 64
prompts x 4 samples, ``ignore_eos`` with per-request ``max_tokens``: every
tenth prompt (7 of 64, 11% of the completions) runs to 512 tokens, the others
stop at 32. Both drivers hold at most ``--capacity`` prompts (x 4 samples) in
flight:

* ``batch``: RL steps of ``capacity`` prompts; each step issues its
  ``sample()`` calls (one per length, concurrently, as per-call parameters
  need) and waits for all of them before the next step starts, so the engine
  runs the step's long tail nearly empty.
* ``stream``: ``capacity`` threads each call ``sample()`` on the next prompt
  as soon as their previous one is done (submit as capacity frees).

Also measured on the same engine: the time from ``abort_all()`` to every
handle done (p50/p95 over handles and trials), and how long
``update_weights(..., in_flight="keep")`` takes with calls in flight against
a plain ``update_weights`` with none. Ratios come from one run; on a shared
machine, expect noise.

The vLLM half lives in the ``vllm_*`` functions; other engines add their own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import BENCH_PROMPTS, machine_summary

NUM_PROMPTS = 64
NUM_SAMPLES = 4
SHORT, LONG = 32, 512
LONG_EVERY = 10  # prompt i is long when i % LONG_EVERY == 0


def _model_id(model: str) -> str:
    if model == "tiny":
        from twinkle_core.testing import build_tiny_model

        return str(build_tiny_model("llama"))
    return "builtin://smollm2-135m-instruct"


def _workload(sampler: Any) -> list[tuple[Any, int]]:
    """(prompt feature, max_tokens) for the 64 prompts, long ones spread evenly."""
    from twinkle_core import Trajectory

    out = []
    for i in range(NUM_PROMPTS):
        messages = BENCH_PROMPTS[i % len(BENCH_PROMPTS)]
        feature = sampler.template.encode(Trajectory(messages=messages), add_generation_prompt=True)
        out.append((feature, LONG if i % LONG_EVERY == 0 else SHORT))
    return out


def _params(max_tokens: int) -> Any:
    from twinkle_core import SamplingParams

    return SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, ignore_eos=True, seed=0)


def _count(responses: list[Any]) -> int:
    return sum(len(s.tokens) for r in responses for s in r.sequences)


def batch_driver(sampler: Any, work: list[tuple[Any, int]], capacity: int) -> int:
    """Steps of ``capacity`` prompts; each waits for its slowest completion. Returns tokens generated."""
    tokens = 0
    for start in range(0, len(work), capacity):
        step = work[start : start + capacity]
        handles = []
        for length in sorted({n for _, n in step}):
            prompts = [f for f, n in step if n == length]
            handles.append(sampler.submit(prompts, _params(length), num_samples=NUM_SAMPLES))
        tokens += sum(_count(h.result()) for h in handles)
    return tokens


def stream_driver(sampler: Any, work: list[tuple[Any, int]], capacity: int) -> int:
    """``capacity`` prompts in flight at all times: each finished one is replaced at once. Returns tokens."""

    def one(item: tuple[Any, int]) -> int:
        feature, length = item
        return _count(sampler.sample(feature, _params(length), num_samples=NUM_SAMPLES))

    with ThreadPoolExecutor(capacity) as pool:
        return sum(pool.map(one, work))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def abort_latency(sampler: Any, work: list[tuple[Any, int]], capacity: int, trials: int) -> list[float]:
    """Seconds from ``abort_all()`` to each handle done, ``capacity`` long calls in flight, over ``trials``."""
    waits: list[float] = []
    for _ in range(trials):
        handles = [sampler.submit(f, _params(LONG), num_samples=NUM_SAMPLES) for f, _ in work[:capacity]]
        # abort once they all run: a short call submitted after them comes back first
        sampler.sample(work[1][0], _params(4))
        done_at: list[float] = [0.0] * len(handles)
        t0 = time.perf_counter()
        sampler.abort_all()

        def wait(handle: Any, k: int, done_at: list[float]) -> None:
            handle.result()
            done_at[k] = time.perf_counter()

        threads = [threading.Thread(target=wait, args=(h, k, done_at)) for k, h in enumerate(handles)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        waits += [d - t0 for d in done_at]
    return waits


def swap_times(
    sampler: Any, weights: dict[str, Any], work: list[tuple[Any, int]], capacity: int, trials: int
) -> dict[str, float]:
    """Median seconds of a plain ``update_weights`` (nothing in flight) and of one with ``in_flight="keep"``."""
    plain, keep = [], []
    for _ in range(trials):
        t0 = time.perf_counter()
        sampler.update_weights(weights)
        plain.append(time.perf_counter() - t0)
        handles = [sampler.submit(f, _params(LONG), num_samples=NUM_SAMPLES) for f, _ in work[:capacity]]
        sampler.sample(work[1][0], _params(4))
        t0 = time.perf_counter()
        sampler.update_weights(weights, in_flight="keep")
        keep.append(time.perf_counter() - t0)
        sampler.abort_all()
        for h in handles:
            h.result()
    return {"plain_s": statistics.median(plain), "keep_s": statistics.median(keep)}


# -- vLLM ----------------------------------------------------------------------------------------------
def vllm_sampler(model_id: str) -> Any:
    """A vLLM sampler with the CPU bench's engine options."""
    from twinkle_vllm import vLLMSampler

    return vLLMSampler(
        model_id,
        engine_args={
            "dtype": "float32",  # as bench_vllm.py; the swap trials push the checkpoint's float32 tensors
            "enforce_eager": True,
            "kv_cache_memory_bytes": 2 << 30,
            "max_num_seqs": 256,
            "disable_log_stats": True,
        },
    )


def vllm_weights(model_id: str) -> dict[str, Any]:
    """The model's own state dict (a full update that changes nothing, so every trial samples the same model)."""
    from safetensors.torch import load_file

    from twinkle_core.hub import resolve_model_id

    folder = Path(resolve_model_id(model_id))
    state: dict[str, Any] = {}
    for path in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def vllm_bench(model: str, capacity: int, trials: int) -> dict[str, Any]:
    """The whole benchmark on the vLLM engine; returns the numbers."""
    model_id = _model_id(model)
    with vllm_sampler(model_id) as sampler:
        work = _workload(sampler)
        sampler.sample(work[0][0], _params(8))  # warm-up
        results: dict[str, Any] = {"engine": "vllm", "model": model, "capacity": capacity}
        for name, driver in (("batch", batch_driver), ("stream", stream_driver)):
            t0 = time.perf_counter()
            tokens = driver(sampler, work, capacity)
            seconds = time.perf_counter() - t0
            results[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
        results["stream_over_batch"] = results["stream"]["tokens_per_s"] / results["batch"]["tokens_per_s"]
        print(json.dumps(results), flush=True)  # the throughput numbers, before the abort and swap trials
        waits = abort_latency(sampler, work, capacity, trials)
        results["abort_all_to_done_s"] = {"p50": _percentile(waits, 0.5), "p95": _percentile(waits, 0.95)}
        results["swap"] = swap_times(sampler, vllm_weights(model_id), work, capacity, trials)
    return results


def _report(results: dict[str, Any]) -> str:
    b, s = results["batch"], results["stream"]
    a, w = results["abort_all_to_done_s"], results["swap"]
    return "\n".join(
        [
            f"engine={results['engine']} model={results['model']} capacity={results['capacity']} prompts x "
            f"{NUM_SAMPLES} samples={NUM_PROMPTS}x{NUM_SAMPLES} (long: every {LONG_EVERY}th prompt to {LONG})",
            "| driver | tokens | seconds | tokens/s |",
            "|---|---|---|---|",
            f"| batch sample() steps | {b['tokens']} | {b['seconds']:.1f} | {b['tokens_per_s']:.0f} |",
            f"| streaming (refill) | {s['tokens']} | {s['seconds']:.1f} | {s['tokens_per_s']:.0f} |",
            f"stream / batch: {results['stream_over_batch']:.2f}x (target >= 1.5x)",
            f"abort_all() -> every handle done: p50 {a['p50'] * 1e3:.0f} ms, p95 {a['p95'] * 1e3:.0f} ms",
            f"update_weights: plain {w['plain_s']:.2f} s, in_flight='keep' with calls in flight {w['keep_s']:.2f} s",
            machine_summary(),
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["vllm"], default="vllm")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--capacity", type=int, default=16, help="prompts in flight (x 4 samples)")
    parser.add_argument("--trials", type=int, default=3, help="abort and swap trials")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    results = vllm_bench(args.model, args.capacity, args.trials)
    print(_report(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
