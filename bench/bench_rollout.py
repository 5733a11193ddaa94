"""Long-tail rollouts: a streaming driver that keeps the engine full against batch ``sample()`` steps.

    python bench/bench_rollout.py --engine torch                    # the core's tiny model
    python bench/bench_rollout.py --engine torch --model smollm2    # the built-in SmolLM2-135M-Instruct

The workload (issue 12): 64 prompts x 4 samples, each completion its own
request with its own ``max_tokens`` (``ignore_eos``, so the mix is fixed):
about 90% end within 32 tokens (8 to 32), 10% run to 512 (less the prompt
where the context window is shorter, as on the tiny model). Requests are
shuffled once, with a fixed seed; sampling is seeded per request, so both
drivers generate the same tokens.

* **batch**: the synchronous loop. Each step sends the next ``--capacity``
  requests together and waits for all of them (a step lasts as long as its
  longest completion; the engine idles through the tail).
* **stream**: keeps ``--capacity`` requests in flight, submitting the next one
  as soon as one finishes (``submit`` + ``as_completed``).

Both give the engine the same number of rows at most, so the ratio is what
keeping the engine full is worth. Also measured: the time from
``abort_all()`` to each handle done (p50 / p95), and the time of
``update_weights(..., in_flight="keep")`` with requests in flight against a
plain ``update_weights`` with none.

Numbers are from one run on whatever machine runs it (a shared machine
disturbs them; the ratio is the figure to read). The engine is chosen with
``--engine``; :func:`rollout_torch` and :func:`rollout_vllm` build the samplers,
the drivers are engine-agnostic.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import cycled_prompts, machine_summary

from twinkle_core import SamplingParams, Trajectory
from twinkle_core.data_format import InputFeature
from twinkle_core.requests import SampleHandle
from twinkle_core.sampler import Sampler

MODELS = {"tiny": None, "smollm2": "builtin://smollm2-135m-instruct"}


def workload(
    sampler: Sampler, *, prompts: int, samples: int, long_share: float, long_tokens: int, seed: int
) -> list[tuple[InputFeature, int, int]]:
    """``(prompt, max_tokens, seed)`` per request, shuffled with ``seed``."""
    rng = random.Random(seed)
    feats = [sampler.template.encode(Trajectory(messages=m)) for m in cycled_prompts(prompts)]
    total = prompts * samples
    n_long = round(total * long_share)
    kinds = [True] * n_long + [False] * (total - n_long)
    rng.shuffle(kinds)
    out = []
    for k, is_long in enumerate(kinds):
        feat = feats[k // samples]
        room = sampler.max_model_len - len(feat.input_ids)
        out.append((feat, min(long_tokens, room) if is_long else rng.randint(8, 32), k))
    return out


def params_for(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed)


def batch_driver(sampler: Sampler, requests: list[tuple[InputFeature, int, int]], capacity: int) -> int:
    """Steps of ``capacity`` requests, each step waiting for its slowest; returns the tokens generated."""
    tokens = 0
    for start in range(0, len(requests), capacity):
        step = [sampler.submit(f, params_for(m, s)) for f, m, s in requests[start : start + capacity]]
        tokens += sum(len(r.sequences[0].tokens) for h in step for r in h.result())
    return tokens


def stream_driver(sampler: Sampler, requests: list[tuple[InputFeature, int, int]], capacity: int) -> int:
    """Keep ``capacity`` requests in flight, submitting the next as one finishes; returns the tokens generated."""
    finished: list[SampleHandle] = []
    cond = threading.Condition()
    tokens = 0

    def on_done(handle: SampleHandle) -> Callable[[], None]:
        def watch() -> None:
            handle.result()
            with cond:
                finished.append(handle)
                cond.notify()

        return watch

    pending = list(requests)
    in_flight = 0
    while pending or in_flight:
        while pending and in_flight < capacity:
            f, m, s = pending.pop(0)
            handle = sampler.submit(f, params_for(m, s))
            threading.Thread(target=on_done(handle), daemon=True).start()
            in_flight += 1
        with cond:
            cond.wait_for(lambda: bool(finished))
            done, finished[:] = list(finished), []
        for handle in done:
            tokens += sum(len(seq.tokens) for r in handle.result() for seq in r.sequences)
            in_flight -= 1
    return tokens


def timed(fn: Callable[[], int]) -> tuple[int, float]:
    t0 = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - t0


def abort_latency(sampler: Sampler, requests: list[tuple[InputFeature, int, int]], capacity: int) -> list[float]:
    """Seconds from ``abort_all()`` to each handle done, with ``capacity`` long requests in flight."""
    longs = [r for r in requests if r[1] > 32][:capacity] or requests[:capacity]
    handles = [sampler.submit(f, params_for(m, s)) for f, m, s in longs]
    probe = sampler.submit(longs[0][0], params_for(4, 0))  # once this is back, the others are decoding
    probe.result()
    done_at: list[float] = []
    lock = threading.Lock()

    def wait(h: SampleHandle) -> None:
        h.result()
        with lock:
            done_at.append(time.perf_counter())

    waiters = [threading.Thread(target=wait, args=(h,)) for h in handles]
    for w in waiters:
        w.start()
    t0 = time.perf_counter()
    sampler.abort_all()
    for w in waiters:
        w.join()
    return sorted(t - t0 for t in done_at)


def swap_times(
    sampler: Sampler, weights: Any, requests: list[tuple[InputFeature, int, int]], capacity: int
) -> dict[str, float]:
    """``update_weights`` with nothing in flight, and with ``capacity`` requests in flight under ``keep``."""
    sampler.update_weights(weights)  # warm-up: the first update pays one-off costs
    t0 = time.perf_counter()
    sampler.update_weights(weights)
    plain = time.perf_counter() - t0
    longs = [r for r in requests if r[1] > 32][:capacity] or requests[:capacity]
    handles = [sampler.submit(f, params_for(m, s)) for f, m, s in longs]
    sampler.submit(longs[0][0], params_for(4, 0)).result()  # the others are decoding now
    t0 = time.perf_counter()
    sampler.update_weights(weights, in_flight="keep")
    keep = time.perf_counter() - t0
    for h in handles:
        h.result()
    return {"plain_s": plain, "keep_s": keep}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def rollout_torch(model: str, device: str, capacity: int) -> tuple[Sampler, Any]:
    """The torch engine, and a full weight update for it (its own weights)."""
    from twinkle_core import create_sampler

    sampler = create_sampler("torch", model_id=_model_path(model), device=device, dtype="float32")
    weights = {k: v.detach().clone() for k, v in sampler.model.state_dict().items()}  # type: ignore[attr-defined]
    return sampler, weights


def rollout_vllm(model: str, device: str, capacity: int) -> tuple[Sampler, Any]:
    """The vLLM engine, and a full weight update for it (read from the checkpoint)."""
    from safetensors.torch import load_file

    from twinkle_core import create_sampler
    from twinkle_core.hub import resolve_model_id

    path = _model_path(model)
    # float32 like the torch arm (and like the checkpoint's tensors the update pushes)
    sampler = create_sampler("vllm", model_id=path, max_num_seqs=capacity, dtype="float32")
    weights: dict[str, Any] = {}
    for file in sorted(Path(resolve_model_id(path)).glob("*.safetensors")):
        weights.update(load_file(str(file)))
    return sampler, weights


def _model_path(model: str) -> str:
    if MODELS[model] is None:
        from twinkle_core.testing import build_tiny_model

        return str(build_tiny_model("llama"))
    return str(MODELS[model])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Streaming vs batch rollouts on a long-tail workload.")
    parser.add_argument("--engine", choices=["torch", "vllm"], default="torch")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--long-share", type=float, default=0.1)
    parser.add_argument("--long-tokens", type=int, default=512)
    parser.add_argument("--capacity", type=int, default=64, help="rows in flight (both drivers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    build = rollout_torch if args.engine == "torch" else rollout_vllm
    sampler, weights = build(args.model, args.device, args.capacity)
    try:
        requests = workload(
            sampler,
            prompts=args.prompts,
            samples=args.samples,
            long_share=args.long_share,
            long_tokens=args.long_tokens,
            seed=args.seed,
        )
        stream_driver(sampler, requests[:8], 8)  # warm-up
        batch_tokens, batch_s = timed(lambda: batch_driver(sampler, requests, args.capacity))
        stream_tokens, stream_s = timed(lambda: stream_driver(sampler, requests, args.capacity))
        aborts = abort_latency(sampler, requests, args.capacity)
        swaps = swap_times(sampler, weights, requests, args.capacity)
    finally:
        sampler.close()
    lengths = [m for _, m, _ in requests]
    result = {
        "engine": args.engine,
        "model": args.model,
        "machine": machine_summary(),
        "requests": len(requests),
        "short_within_32": sum(m <= 32 for m in lengths) / len(lengths),
        "long_tokens": max(lengths),
        "capacity": args.capacity,
        "batch": {"tokens": batch_tokens, "seconds": batch_s, "tokens_per_s": batch_tokens / batch_s},
        "stream": {"tokens": stream_tokens, "seconds": stream_s, "tokens_per_s": stream_tokens / stream_s},
        "stream_over_batch": (stream_tokens / stream_s) / (batch_tokens / batch_s),
        "abort_all_to_done_s": {"p50": percentile(aborts, 0.5), "p95": percentile(aborts, 0.95), "n": len(aborts)},
        "update_weights_s": swaps,
    }
    print(f"engine={args.engine} model={args.model} requests={len(requests)} capacity={args.capacity}")
    print(f"  {result['short_within_32']:.0%} of completions end within 32 tokens, the rest at {max(lengths)}")
    for name in ("batch", "stream"):
        r = result[name]
        print(f"  {name:6s} {r['tokens']:6d} tokens in {r['seconds']:7.2f} s = {r['tokens_per_s']:8.1f} tokens/s")
    print(f"  stream / batch: {result['stream_over_batch']:.2f}x")
    ab = result["abort_all_to_done_s"]
    print(f"  abort_all() to every handle done: p50 {ab['p50'] * 1e3:.1f} ms, p95 {ab['p95'] * 1e3:.1f} ms")
    print(
        f"  update_weights: plain {swaps['plain_s'] * 1e3:.1f} ms (nothing in flight),"
        f" keep {swaps['keep_s'] * 1e3:.1f} ms ({args.capacity} requests in flight)"
    )
    print(f"  machine: {result['machine']} (one run; a shared machine disturbs the absolute numbers)")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
