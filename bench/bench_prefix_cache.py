"""Prefill on a GRPO-like workload: the version-keyed prefix cache against today's reset.

    python bench/bench_prefix_cache.py                  # the tiny model (512-token window), about 2 minutes
    python bench/bench_prefix_cache.py --model smollm2 --system-repeats 12  # the built-in SmolLM2-135M

Workload: each step pushes the policy's weights (``update_weights``, same
values: only the version changes) and samples 8 prompts x 16 samples that
share a long system prompt, in ``--calls`` calls per step (a trainer that
collects its rollouts in chunks). ``max_tokens`` is small, so the time is
mostly prefill. Three ways to handle the prefix cache across updates:

* ``salt``: this branch, every request salted with the weights version and adapter;
* ``reset``: the previous behaviour, the whole prefix cache reset after each update;
* ``off``: prefix caching disabled (what the cache saves at all).

Printed per mode: seconds of ``sample()`` per step (median over steps after
the first) and the share of prompt tokens served from the cache, read from
vLLM's ``RequestOutput.num_cached_tokens``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "dtype": "float32",
    "kv_cache_memory_bytes": 2 << 30,
    "max_num_seqs": 256,
}
SYSTEM = (
    "You are a careful assistant for arithmetic word problems. Read the question, restate the numbers, work"
    " through each step, check the result against the question, and answer with the number alone. "
)


def _model(name: str) -> Path:
    if name == "tiny":
        from twinkle_core.testing import build_tiny_model

        return build_tiny_model("llama")
    from twinkle_core.hub import resolve_model_id

    return Path(resolve_model_id("builtin://smollm2-135m-instruct"))


def _sampler(model: Path, caching: bool) -> Any:
    from twinkle_core import Sampler
    from twinkle_vllm.engine import vLLMEngine

    sampler = Sampler(vLLMEngine, model, engine_args={**ENGINE_ARGS, "enable_prefix_caching": caching})
    engine = sampler.engine
    engine.prompt_tokens = engine.cached_tokens = 0
    send = engine._requests.request

    async def recording(ids: list[int], *args: Any, **kwargs: Any) -> Any:
        out = await send(ids, *args, **kwargs)
        # vLLM prefills a prompt once per request and fans the samples out from it
        engine.prompt_tokens += len(ids)
        engine.cached_tokens += int(out.num_cached_tokens or 0)
        return out

    engine._requests.request = recording
    return sampler


def run(sampler: Any, mode: str, steps: int, calls: int, system_repeats: int, samples: int) -> dict[str, float]:
    """Time ``steps`` GRPO-like steps; returns the median step time and the cache-hit share."""
    from safetensors.torch import load_file

    from twinkle_core import SamplingParams, Trajectory

    state = load_file(str(Path(sampler.engine.model_dir) / "model.safetensors"))
    system = SYSTEM * system_repeats
    prompts = [
        Trajectory(
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"What is {i} + {i * 3}?"}]
        )
        for i in range(8)
    ]
    per_call = samples // calls
    params = SamplingParams(max_tokens=4, temperature=1.0, num_samples=per_call, ignore_eos=True, seed=0)
    times: list[float] = []
    sampler.engine.prompt_tokens = sampler.engine.cached_tokens = 0
    for _ in range(steps):
        sampler.update_weights([(k, v) for k, v in state.items()], check_finite=False)
        if mode == "reset":  # the previous behaviour, emulated on this branch
            sampler.engine._process.loop.run(sampler.engine._process.engine.reset_prefix_cache())
        start = time.perf_counter()
        for _ in range(calls):
            sampler.sample(prompts, params)
        times.append(time.perf_counter() - start)
    length = len(sampler.encode(prompts[0]).input_ids)
    return {
        "step_s": statistics.median(times[1:] or times),
        "hit_share": sampler.engine.cached_tokens / max(sampler.engine.prompt_tokens, 1),
        "prompt_len": length,
    }


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", choices=["tiny", "smollm2"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--calls", type=int, default=2, help="sample() calls per step (samples split evenly)")
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--system-repeats", type=int, default=4, help="copies of the system sentence")
    args = parser.parse_args(argv)
    model = _model(args.model)
    rows = []
    with _sampler(model, caching=True) as sampler:
        for mode in ("salt", "reset"):
            rows.append((mode, run(sampler, mode, args.steps, args.calls, args.system_repeats, args.samples)))
    with _sampler(model, caching=False) as sampler:
        rows.append(("off", run(sampler, "off", args.steps, args.calls, args.system_repeats, args.samples)))
    print(
        f"\n{args.model}: 8 prompts x {args.samples} samples in {args.calls} call(s) per step, prompt"
        f" {rows[0][1]['prompt_len']} tokens, {args.steps} steps, {os.cpu_count()} CPUs"
    )
    print(f"{'mode':6}  {'sample s/step':>13}  {'cached share':>12}")
    for mode, r in rows:
        print(f"{mode:6}  {r['step_s']:13.3f}  {r['hit_share']:12.1%}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
