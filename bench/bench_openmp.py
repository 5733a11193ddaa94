"""What the caller's idle OpenMP pool costs the torch engine's decode loop, in one run.

``sample()`` blocks its caller while the engine's decode loop runs on a thread
of its own. A caller that has run parallel PyTorch work (loaded the model,
pushed weights, trained) holds an OpenMP worker pool, and next to the loop's
pool that is more threads than a 2-core machine has CPUs: ``libgomp`` then
puts workers to sleep between parallel loops and every loop pays to wake
them (``twinkle_torch.openmp``). The engine now releases the caller's idle
pool; this alternates rounds with that release and without it (the engine
as it was), on the scaling workload, and prints the ratio. With ``--call
sample`` each round runs parallel work on the caller's thread, then
``sample()`` (released before the caller waits); with ``--call asample``
each round pushes the model's own weights (``update_weights``, released
when the push returns), then awaits ``asample()``, which waits on a thread
of its own::

    python bench/bench_openmp.py                        # SmolLM2, batch 1 16 64 256, 64 tokens, 3 rounds
    python bench/bench_openmp.py --call asample --batches 1 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import cycled_prompts, machine_summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each arm, alternated")
    parser.add_argument("--call", choices=("sample", "asample"), default="sample")
    args = parser.parse_args(argv)

    import asyncio

    import torch

    from twinkle_core import SamplingParams, Trajectory, create_sampler
    from twinkle_torch import openmp

    openmp.release_idle_workers()  # finds the runtimes: an empty list below turns the release off
    runtimes = openmp._runtimes
    sampler = create_sampler("torch", model_id=args.model, dtype="float32")
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=args.tokens, ignore_eos=True, logprobs=0)
    weights = [(name, value.detach().clone()) for name, value in sampler.model.state_dict().items()]
    print(machine_summary())
    print(
        f"{args.model}, float32, {args.tokens} tokens per completion, temperature 1.0, top_p 0.95, logprobs=0;"
        f" each round: {'parallel work, sample()' if args.call == 'sample' else 'update_weights, asample()'}"
    )
    print("| batch | caller's pool kept: tok/s per round | released: tok/s per round | released / kept (medians) |")
    print("|---|---|---|---|")
    try:
        for batch in args.batches:
            prompts = [Trajectory(messages=m) for m in cycled_prompts(batch)]
            sampler.engine.max_batch_tokens = max(sampler.engine.max_batch_tokens, batch * 512)
            sampler.sample(prompts[: min(batch, 4)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
            rates: dict[str, list[float]] = {"kept": [], "released": []}
            for _ in range(args.rounds):
                for arm in ("kept", "released"):
                    openmp._runtimes = runtimes if arm == "released" else []
                    if args.call == "sample":
                        torch.ones(1 << 22).mul_(2.0)  # the caller runs parallel work: its pool exists
                        start = time.perf_counter()
                        out = sampler.sample(prompts, params)
                    else:
                        sampler.update_weights(weights)  # parallel copies on this thread: its pool exists
                        start = time.perf_counter()
                        out = asyncio.run(sampler.asample(prompts, params))
                    wall = time.perf_counter() - start
                    rates[arm].append(sum(len(s.tokens) for r in out for s in r.sequences) / wall)
            kept, rel = statistics.median(rates["kept"]), statistics.median(rates["released"])
            print(
                f"| {batch} | {' / '.join(f'{r:.0f}' for r in rates['kept'])}"
                f" | {' / '.join(f'{r:.0f}' for r in rates['released'])} | **{rel / kept:.2f}x** |",
                flush=True,
            )
    finally:
        openmp._runtimes = runtimes
        sampler.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
