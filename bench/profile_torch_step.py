"""Where a decode step of the torch engine goes, against the matmul floor of the same shapes.

    python bench/profile_torch_step.py                       # SmolLM2, batch 1 16 64 256, 64 tokens
    python bench/profile_torch_step.py --batches 64 --tokens 32 --logprobs none
    python bench/profile_torch_step.py --attention-kernel sdpa      # PyTorch's attention instead
    python bench/profile_torch_step.py --linear-kernel onednn-packed  # the matmuls on packed weights
    python bench/profile_torch_step.py --nucleus topk               # log-probs' top-p mass by topk

One run, in one process, on ``builtin://smollm2-135m-instruct`` in float32
(or ``--model``), the scaling benchmark's workload: chat prompts from
``harness.BENCH_PROMPTS``, one completion each, ``ignore_eos``, temperature
1.0, top_p 0.95, plus ``logprobs=0`` (what an RL loop asks for; ``--logprobs
none`` leaves them out). For each batch size the engine's real decode loop
runs the whole workload once (after a warm-up), with timers wrapped around
its parts from outside (this script patches them; the engine has no hooks):

* ``linear``: every ``nn.Linear`` of the decoder layers (q, k, v, o, gate, up, down);
* ``lm head``: the output projection to the vocabulary;
* ``attention``: the attention function over the cache (decode steps through
  ``twinkle_torch.native``'s kernel; ``--attention-kernel sdpa`` for PyTorch's);
* ``cache write``: writing the step's keys and values into the cache;
* ``other model ops``: the rest of the model's forward (norms, rotary
  embeddings, activations, residual adds, masks, and ``transformers``' Python);
* ``sampling``: the token sampler (processing, truncation, the draw);
* ``log-probs``: the sampler's log-prob work (inside the draw's call);
* ``row bookkeeping``: the rest of a step's sampling pass (per-row Python:
  appending tokens, stop checks, seeded streams);
* ``prune / join``: dropping finished rows and joining new ones;
* ``loop``: what is left of the decode steps' wall time.

The timers cost time of their own (a Python call around each of some 270
ops a step), so each batch also runs once with no timer inside the step,
before the timed run: the decode rate and the shares of the floor come from
that run, the split into parts from the timed one (whose step is longer).

The prefill is timed apart (it is not part of a decode step). The floor is
the measured time of the same matmuls alone: every linear layer of the
model, with its real weights, in the model's order, on a ``[batch, hidden]``
input, best of ``--floor-repeats`` passes, in the same process and run,
through three kernels (``F.linear``; oneDNN on the dense weights, what the
engine runs on CPU; oneDNN on prepacked weights); the share is against the fastest.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import cycled_prompts, machine_summary

#: The matmul floors measured; the shares are against the fastest.
FLOOR_KERNELS = ("torch", "onednn", "onednn-packed")

PARTS = [
    "linear",
    "lm head",
    "attention",
    "cache write",
    "other model ops",
    "sampling",
    "log-probs",
    "row bookkeeping",
    "prune / join",
    "loop",
]


class Timers:
    """Wall time per part, inclusive, from the decode loop's thread only."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.on = False
        self.thread: int | None = None
        self.phase = ""  # "prefill/" while a prefill runs: its parts are kept apart from the decode steps'

    def wrap(self, name: str | Callable[..., str], fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on or threading.get_ident() != self.thread:
                return fn(*args, **kwargs)
            label = name if isinstance(name, str) else name(*args)
            outer = self.phase
            if label == "prefill":
                self.phase = "prefill/"
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[outer + label] += time.perf_counter() - t0
                self.phase = outer

        return timed


def time_steps(timers: Timers) -> None:
    """Time the decode loop's whole steps and prefills only (nothing inside a step)."""
    from twinkle_torch import admission, decoding

    prefiller = admission.Prefiller
    prefiller.__call__ = timers.wrap("prefill", prefiller.__call__)  # type: ignore[method-assign]
    dec = decoding.Decoder
    dec._step = timers.wrap("step", dec._step)  # type: ignore[method-assign]


def instrument(sampler: Any, timers: Timers) -> None:
    """Wrap the engine's parts with timers (class attributes: this process runs one engine)."""
    import torch
    from transformers import AttentionInterface

    from twinkle_torch import batch, decoding, sampling
    from twinkle_torch.attention import ATTN_IMPLEMENTATION
    from twinkle_torch.cache import PreallocatedLayer

    model = sampler.model
    head = model.get_output_embeddings()
    torch.nn.Linear.forward = timers.wrap(  # type: ignore[method-assign]
        lambda module, *_: "lm head" if module is head else "linear", torch.nn.Linear.forward
    )
    for module in model.modules():  # layers the engine gave a forward of their own (twinkle_torch.linear)
        if isinstance(module, torch.nn.Linear) and "forward" in vars(module):
            module.forward = timers.wrap("lm head" if module is head else "linear", module.forward)
    impl = model.config._attn_implementation
    AttentionInterface.register(impl, timers.wrap("attention", AttentionInterface._global_mapping[impl]))
    assert impl == ATTN_IMPLEMENTATION or impl in AttentionInterface._global_mapping
    PreallocatedLayer.update = timers.wrap("cache write", PreallocatedLayer.update)  # type: ignore[method-assign]
    dec = decoding.Decoder
    dec._forward = timers.wrap("forward", dec._forward)  # type: ignore[method-assign]
    dec._sample = timers.wrap("sample pass", dec._sample)  # type: ignore[method-assign]
    layout = batch.Batch
    layout.prune = timers.wrap("prune / join", layout.prune)  # type: ignore[method-assign]
    layout.join = timers.wrap("prune / join", layout.join)  # type: ignore[method-assign]
    time_steps(timers)
    ts = sampling.TokenSampler
    ts.__call__ = timers.wrap("sampler", ts.__call__)  # type: ignore[method-assign]
    for name in ("_finish_full", "_candidate_logprobs", "_candidates", "_nucleus_logprobs"):
        if hasattr(ts, name):
            setattr(ts, name, timers.wrap(f"lp:{name}", getattr(ts, name)))


def matmul_floor(model: Any, batch: int, repeats: int, kernel: str) -> float:
    """Seconds of one step's matmuls alone: every linear layer in order, real weights, best of ``repeats``.

    ``kernel``: ``"torch"`` (``F.linear``), ``"onednn"`` (the engine's CPU
    kernel on the dense weights) or ``"onednn-packed"`` (oneDNN on weights
    reordered to its blocked layout once, a second copy of the model: the
    fastest matmul this PyTorch has for these shapes).
    """
    import torch

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    linears = [m for m in linears if m is not head] + [head]
    inputs = {m.in_features: torch.randn(batch, m.in_features, dtype=m.weight.dtype) for m in linears}
    pointwise = torch.ops.mkldnn._linear_pointwise
    with torch.inference_mode():
        weights = [m.weight for m in linears]
        if kernel == "onednn-packed":
            weights = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass warms up
            t0 = time.perf_counter()
            for m, w in zip(linears, weights):
                x = inputs[m.in_features]
                if kernel == "torch":
                    torch.nn.functional.linear(x, w, m.bias)
                else:
                    pointwise(x, w, m.bias, "none", [], "")
            best = min(best, time.perf_counter() - t0)
    return best


def parts_of(seconds: dict[str, float], logprob_seconds: float) -> dict[str, float]:
    """The table's parts from the inclusive timers (each part exclusive of those inside it)."""
    forward = seconds["forward"]
    inside = seconds["linear"] + seconds["lm head"] + seconds["attention"] + seconds["cache write"]
    sampler = seconds["sampler"]
    out = {
        "linear": seconds["linear"],
        "lm head": seconds["lm head"],
        "attention": seconds["attention"],
        "cache write": seconds["cache write"],
        "other model ops": max(0.0, forward - inside),
        "sampling": max(0.0, sampler - logprob_seconds),
        "log-probs": logprob_seconds,
        "row bookkeeping": max(0.0, seconds["sample pass"] - sampler),
        "prune / join": seconds["prune / join"],
    }
    out["loop"] = max(0.0, seconds["step"] - seconds["prefill"] - sum(out.values()))
    return out


def run_batch(sampler: Any, timers: Timers, batch: int, tokens: int, logprobs: int | None) -> dict[str, Any]:
    from twinkle_core import SamplingParams, Trajectory

    decoder = sampler.engine._decoder
    params = SamplingParams(
        temperature=1.0, top_p=0.95, max_tokens=tokens, ignore_eos=True, logprobs=logprobs, seed=None
    )
    prompts = [Trajectory(messages=m) for m in cycled_prompts(batch)]
    sampler.engine.max_batch_tokens = max(sampler.engine.max_batch_tokens, batch * 512)
    sampler.sample(prompts[: min(batch, 4)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    timers.seconds.clear()
    steps0 = decoder.stats.steps
    timers.on = True
    t0 = time.perf_counter()
    out = sampler.sample(prompts, params)
    wall = time.perf_counter() - t0
    timers.on = False
    steps = decoder.stats.steps - steps0
    generated = sum(len(s.tokens) for r in out for s in r.sequences)
    sec = dict(timers.seconds)
    logprob_seconds = sum(v for k, v in sec.items() if k.startswith("lp:"))
    # _candidates also runs to draw under top-k; under top-p alone it serves the log-probs only
    return {
        "batch": batch,
        "tokens": generated,
        "steps": steps,
        "wall_s": wall,
        "prefill_s": sec.get("prefill", 0.0),
        "decode_s": sec.get("step", 0.0) - sec.get("prefill", 0.0),
        "prefill_parts_s": {
            "linear": sec.get("prefill/linear", 0.0),
            "lm head": sec.get("prefill/lm head", 0.0),
            "attention": sec.get("prefill/attention", 0.0),
            "cache write": sec.get("prefill/cache write", 0.0),
        },
        "parts_s": parts_of(defaultdict(float, sec), logprob_seconds),
    }


@contextmanager
def quiet() -> Iterator[None]:
    import logging

    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| part | " + " | ".join(f"batch {r['batch']}" for r in rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for part in PARTS:
        cells = []
        for r in rows:
            ms = 1000 * r["parts_s"][part] / max(1, r["timed_steps"])
            share = r["parts_s"][part] / r["timed_decode_s"] if r["timed_decode_s"] else 0.0
            cells.append(f"{ms:.2f} ms ({100 * share:.0f}%)")
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    for label, fn in (
        (
            "decode step, timed (the parts' run)",
            lambda r: f"{1000 * r['timed_decode_s'] / max(1, r['timed_steps']):.2f} ms",
        ),
        ("**decode step, no timers**", lambda r: f"{1000 * r['decode_s'] / max(1, r['steps']):.2f} ms"),
        *(
            (f"matmul floor, {kernel}", lambda r, k=kernel: f"{1000 * r[f'floor_{k}_s']:.2f} ms")
            for kernel in FLOOR_KERNELS
        ),
        ("decode tok/s (no timers)", lambda r: f"{r['decode_tok_s']:.0f}"),
        ("floor tok/s (the fastest floor)", lambda r: f"{r['floor_tok_s']:.0f}"),
        ("share of the fastest floor", lambda r: f"**{100 * r['of_floor']:.0f}%**"),
        ("share of the `F.linear` floor", lambda r: f"**{100 * r['of_torch_floor']:.0f}%**"),
        ("prefill (all prompts), s", lambda r: f"{r['prefill_s']:.2f}"),
        (
            "of which linear + lm head, s",
            lambda r: f"{r['prefill_parts_s']['linear'] + r['prefill_parts_s']['lm head']:.2f}",
        ),
        ("of which attention, s", lambda r: f"{r['prefill_parts_s']['attention']:.2f}"),
        ("end-to-end tok/s (prefill included)", lambda r: f"{r['tokens'] / r['wall_s']:.0f}"),
    ):
        lines.append(f"| {label} | " + " | ".join(fn(r) for r in rows) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--tokens", type=int, default=64, help="tokens per completion")
    parser.add_argument("--logprobs", default="0", help="SamplingParams.logprobs: a number, or 'none'")
    parser.add_argument("--floor-repeats", type=int, default=5)
    parser.add_argument("--attention-kernel", default="auto", help="the engine's attention_kernel option")
    parser.add_argument("--linear-kernel", default="auto", help="the engine's linear_kernel option (onednn-packed...)")
    parser.add_argument(
        "--nucleus",
        choices=("auto", "topk"),
        default="auto",
        help="the top-p normaliser of log-probs: the engine's choice, or always the topk path",
    )
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    args = parser.parse_args(argv)
    logprobs = None if args.logprobs == "none" else int(args.logprobs)

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    from twinkle_core import create_sampler

    with quiet():
        sampler = create_sampler(
            "torch",
            model_id=args.model,
            dtype=args.dtype,
            attention_kernel=args.attention_kernel,
            linear_kernel=args.linear_kernel,
        )
    if args.nucleus == "topk":
        sampler.engine._decoder.native_kernels = False
    plain, timers = Timers(), Timers()
    # the decode loop's thread is started per burst of work: it tells the timers its id
    decoder_class = type(sampler.engine._decoder)
    original = decoder_class._loop

    def loop(self: Any) -> None:
        plain.thread = timers.thread = threading.get_ident()
        original(self)

    decoder_class._loop = loop  # type: ignore[method-assign]
    time_steps(plain)
    run_batch(sampler, plain, args.batches[0], args.tokens, logprobs)  # warm up: the first run in a process is slow
    untimed = {batch: run_batch(sampler, plain, batch, args.tokens, logprobs) for batch in args.batches}
    instrument(sampler, timers)
    rows = []
    for batch in args.batches:
        row = run_batch(sampler, timers, batch, args.tokens, logprobs)
        row["timed_decode_s"], row["timed_steps"] = row["decode_s"], row["steps"]
        for key in ("decode_s", "steps", "prefill_s", "wall_s", "tokens"):
            row[key] = untimed[batch][key]
        for kernel in FLOOR_KERNELS:
            row[f"floor_{kernel}_s"] = statistics.median(
                [matmul_floor(sampler.model, batch, args.floor_repeats, kernel) for _ in range(3)]
            )
        row["floor_s"] = min(row[f"floor_{kernel}_s"] for kernel in FLOOR_KERNELS)
        row["decode_tok_s"] = batch * row["steps"] / row["decode_s"] if row["decode_s"] else 0.0
        row["floor_tok_s"] = batch / row["floor_s"]
        row["of_floor"] = row["decode_tok_s"] / row["floor_tok_s"]
        row["of_torch_floor"] = row["decode_tok_s"] * row["floor_torch_s"] / batch
        rows.append(row)
        print(
            f"batch {batch}: {row['steps']} steps, decode {row['decode_tok_s']:.0f} tok/s, floor"
            f" {row['floor_tok_s']:.0f} tok/s ({100 * row['of_floor']:.0f}%)",
            file=sys.stderr,
            flush=True,
        )
    sampler.close()
    print(machine_summary())
    print(
        f"{args.model}, {args.dtype}, attention_kernel={args.attention_kernel}, nucleus={args.nucleus},"
        f" {args.tokens} tokens per completion,"
        " temperature 1.0, top_p 0.95,"
        f" logprobs={logprobs}; per decode step (share of the decode time)\n"
    )
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
