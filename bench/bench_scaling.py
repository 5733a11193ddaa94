"""The scaling picture: tokens/s and peak memory against batch size and completion length, four engines.

    python bench/bench_scaling.py --out docs/scaling_smollm2.png     # ~15 min on 2 CPU cores

One run, SmolLM2-135M-Instruct in float32 (``builtin://smollm2-135m-instruct``),
the same sampled workload (chat prompts from ``harness.BENCH_PROMPTS``,
cycled; one completion each; ``ignore_eos`` so every engine generates exactly
the asked length; temperature 1.0, top_p 0.95) through

* ``hf-generate``: Hugging Face ``model.generate``, one left-padded batch;
* ``vllm-raw``: ``vllm.LLM.generate`` (bench_vllm.py's runner, same engine options);
* ``twinkle-vllm``: ``vLLMSampler.sample`` on that engine;
* ``twinkle-torch``: ``TorchSampler.sample``;
* ``twinkle-torch-packed``: the same with ``linear_kernel="onednn-packed"``
  (not in the default ``--runners``).

Two sweeps: batch size (``--batches``, default 1 4 16 64 256 sequences) at
``--batch-length`` tokens, and completion length (``--lengths``, default 32
128 512) at ``--length-batch`` sequences. Each engine runs in its own child
process that loads the model once, warms up, then runs every point once.

Peak memory per point: the resident-set high-water mark (``VmHWM``) of the
child and every process it started (vLLM's engine core), reset before each
point (``/proc/<pid>/clear_refs``), summed over those processes. It includes
the weights and, for vLLM, the preallocated KV cache (``kv_cache_memory_bytes``).

``--max-point-tokens`` trims the grid: a point of an engine asking more tokens
than that is skipped (and listed), so a slow engine cannot take the run
past minutes on a small machine. The figure is one run on a machine that
may be shared: compare the engines, not the absolute numbers across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Workload, cycled_prompts, machine_summary

MODEL_ID = "builtin://smollm2-135m-instruct"

#: vLLM options, as bench_vllm.py (both vLLM arms run the same engine).
VLLM_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "kv_cache_memory_bytes": 2 << 30,
    "max_num_seqs": 256,
    "disable_log_stats": True,
}

#: name -> (runner target in bench/, its keyword arguments)
RUNNERS: dict[str, tuple[str, dict[str, Any]]] = {
    "hf-generate": ("harness:hf_generate_runner", {}),
    "vllm-raw": ("bench_vllm:vllm_raw_runner", dict(VLLM_ARGS)),
    "twinkle-vllm": ("harness:sampler_runner", {"engine": "vllm", "engine_args": dict(VLLM_ARGS)}),
    "twinkle-torch": ("harness:sampler_runner", {"engine": "torch"}),
    "twinkle-torch-packed": ("harness:sampler_runner", {"engine": "torch", "linear_kernel": "onednn-packed"}),
}


def _tree(pid: int) -> list[int]:
    """``pid`` and every live descendant."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _reset_peaks(pids: list[int]) -> None:
    for p in pids:
        try:
            Path(f"/proc/{p}/clear_refs").write_text("5")  # 5: reset the peak RSS to the current RSS
        except OSError:
            pass


def _peak_mib(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def _points(args: argparse.Namespace) -> list[dict[str, Any]]:
    points = [{"sweep": "batch", "batch": b, "length": args.batch_length} for b in args.batches]
    points += [{"sweep": "length", "batch": args.length_batch, "length": n} for n in args.lengths]
    return points


def child(runner: str, points: list[dict[str, Any]], max_point_tokens: dict[str, int], out_path: str) -> None:
    """In a fresh process: load one engine, then time every point and record its peak memory."""
    import torch
    from harness import _load_target

    torch.set_num_threads(os.cpu_count() or 1)
    target, kwargs = RUNNERS[runner]

    def workload(batch: int, length: int) -> Workload:
        prompts = cycled_prompts(batch)
        return Workload(name=f"{batch}x{length}", model_id=MODEL_ID, prompts=prompts, num_samples=1, max_tokens=length)

    run = _load_target(target)(workload(2, 8), **kwargs)
    run(workload(4, 8))  # warm-up
    rows = []
    for point in points:
        asked = point["batch"] * point["length"]
        if asked > max_point_tokens.get(runner, max_point_tokens["*"]):
            rows.append({**point, "skipped": f"{asked} tokens > --max-point-tokens"})
            continue
        pids = _tree(os.getpid())
        _reset_peaks(pids)
        t0 = time.perf_counter()
        tokens = run(workload(point["batch"], point["length"]))
        seconds = time.perf_counter() - t0
        rows.append({**point, "tokens": tokens, "seconds": seconds, "peak_mib": _peak_mib(_tree(os.getpid()))})
        print(runner, json.dumps(rows[-1]), file=sys.stderr, flush=True)
        Path(out_path).write_text(json.dumps(rows))  # what finished survives a later timeout
    Path(out_path).write_text(json.dumps(rows))


def plot(results: dict[str, list[dict[str, Any]]], out: Path, title: str) -> None:
    """Two panels of tokens/s (log-log), peak memory annotated in the table printed alongside."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    for runner, rows in results.items():
        done = [r for r in rows if "tokens" in r]
        for ax, sweep, key in ((axes[0], "batch", "batch"), (axes[1], "length", "length")):
            pts = sorted((r[key], r["tokens"] / r["seconds"]) for r in done if r["sweep"] == sweep)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=runner)
        pts = sorted((r["batch"], r["peak_mib"]) for r in done if r["sweep"] == "batch")
        if pts:
            axes[2].plot(*zip(*pts), marker="o", label=runner)
    first = next(iter(results.values()))
    blen = next((r["length"] for r in first if r["sweep"] == "batch"), 0)
    lbat = next((r["batch"] for r in first if r["sweep"] == "length"), 0)
    axes[0].set(xscale="log", yscale="log", xlabel="batch size (sequences)", ylabel="tokens/s",
                title=f"throughput vs batch ({blen} tokens each)")  # fmt: skip
    axes[1].set(xscale="log", yscale="log", xlabel="completion length (tokens)", ylabel="tokens/s",
                title=f"throughput vs length (batch {lbat})")  # fmt: skip
    axes[2].set(xscale="log", xlabel="batch size (sequences)", ylabel="peak RSS, MiB (process tree)",
                title="peak memory vs batch")  # fmt: skip
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    """A markdown table: one row per point, tokens/s and peak MiB per engine."""
    runners = list(results)
    keys = list(dict.fromkeys((r["sweep"], r["batch"], r["length"]) for rows in results.values() for r in rows))
    head = "| sweep | batch | length | " + " | ".join(f"{r} tok/s (peak MiB)" for r in runners) + " |"
    lines = [head, "|" + "---|" * (3 + len(runners))]
    for sweep, batch, length in keys:
        cells = []
        for runner in runners:
            row = next(r for r in results[runner] if (r["sweep"], r["batch"], r["length"]) == (sweep, batch, length))
            if "tokens" in row:
                cells.append(f"{row['tokens'] / row['seconds']:.0f} ({row['peak_mib']:.0f})")
            else:
                cells.append("skipped" if "skipped" in row else str(row.get("error", "-")))
        lines.append(f"| {sweep} | {batch} | {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runners",
        default=",".join(r for r in RUNNERS if r != "twinkle-torch-packed"),
        help=f"comma-separated, of {', '.join(RUNNERS)}",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--batch-length", type=int, default=64, help="completion length of the batch sweep")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--length-batch", type=int, default=16, help="batch size of the length sweep")
    parser.add_argument(
        "--max-point-tokens",
        default="*=20000",
        help="skip a point asking more tokens than this, per runner: 'hf-generate=4000,*=20000'",
    )
    parser.add_argument(
        "--runner-budget-s", type=float, default=900, help="stop an engine after this; its points left are 'not run'"
    )
    parser.add_argument("--out", default="scaling.png", help="the PNG; the table and raw JSON go beside it")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    limits = {k: int(v) for k, v in (p.split("=") for p in args.max_point_tokens.split(","))}
    limits.setdefault("*", 1 << 62)
    if args.child:
        runner, points_json, limits_json, out_path = args.child
        child(runner, json.loads(points_json), json.loads(limits_json), out_path)
        return 0

    points = _points(args)
    results: dict[str, list[dict[str, Any]]] = {}
    started = time.perf_counter()
    for runner in args.runners.split(","):
        with tempfile.TemporaryDirectory(prefix="twinkle-scaling-") as tmp:
            out_path = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, str(Path(__file__).resolve()), "--child", runner, json.dumps(points)]
            log_path = os.path.join(tmp, "log.txt")
            with open(log_path, "w") as log:
                # its own session, so a timeout ends vLLM's engine process with it
                proc = subprocess.Popen(
                    [*cmd, json.dumps(limits), out_path], stdout=log, stderr=log, start_new_session=True
                )
                try:
                    returncode = proc.wait(timeout=args.runner_budget_s)
                    failed = "failed"
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    returncode = proc.wait()
                    failed = f"over --runner-budget-s {args.runner_budget_s:g}"
            rows = json.loads(Path(out_path).read_text()) if os.path.exists(out_path) else []
            if returncode != 0:
                tail = " | ".join(Path(log_path).read_text(errors="replace").strip().splitlines()[-3:])
                print(f"{runner}: exit {returncode} ({tail})", file=sys.stderr)
            finished = {(r["sweep"], r["batch"], r["length"]) for r in rows}
            rows += [{**p, "error": failed} for p in points if (p["sweep"], p["batch"], p["length"]) not in finished]
            results[runner] = rows
            print(f"{runner}: done", file=sys.stderr, flush=True)
    minutes = (time.perf_counter() - started) / 60
    machine = machine_summary()
    title = f"SmolLM2-135M-Instruct, float32, sampled, ignore_eos; one run, {minutes:.0f} min; {machine}"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = f"{title}\n\n{table(results)}\n"
    print(text, flush=True)  # before the files: a run's figures are never lost to a bad path
    out.with_suffix(".md").write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"title": title, "results": results}, indent=1))
    plot(results, out, title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
