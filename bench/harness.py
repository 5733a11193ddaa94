"""Side-by-side sampling benchmarks: one workload, several engines ("runners"), one table.

Each runner runs in its own child process, so its peak memory is its own: the
table reports the child's resident-set high-water mark (``ru_maxrss`` from
``wait4``), model weights and runtime included, next to its tokens/s.

A runner is a ``"module:function"`` target plus keyword arguments. The function
takes the :class:`Workload` (and the keyword arguments), loads what it needs,
and returns a callable that runs a workload once and returns the number of
tokens it generated::

    def my_runner(workload: Workload, **kwargs) -> Callable[[Workload], int]:
        engine = load(workload.model_id, **kwargs)
        return lambda w: engine.generate(w)

The child calls it once on a small warm-up slice of the workload, then
``repeats`` times on the whole workload, and reports the fastest run (the
least disturbed by other load on the machine) and the median.

Two runners ship here for every engine's benchmark to share:
:func:`hf_generate_runner` (the Hugging Face ``model.generate`` baseline) and
:func:`sampler_runner` (any twinkle engine through ``create_sampler``).

Engine benchmarks (``bench_torch.py``, ``bench_vllm.py``) build their
workloads and runner lists and call :func:`compare`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BENCH_PROMPTS",
    "Result",
    "Runner",
    "Workload",
    "compare",
    "cycled_prompts",
    "format_table",
    "hf_generate_runner",
    "machine_summary",
    "run_runner",
    "sampler_runner",
]

_HERE = Path(__file__).resolve().parent

#: 32 chat prompts of mixed length (a few tokens to a few hundred): single
#: questions, system prompts, multi-turn conversations.
BENCH_PROMPTS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Count from 3 to 8."}],
    [{"role": "user", "content": "Tell me a story about a duck."}],
    [{"role": "user", "content": "What is 4 plus 3?"}],
    [{"role": "user", "content": "List three animals."}],
    [{"role": "user", "content": "Thanks!"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Tell me about Alice."},
    ],
    [
        {"role": "system", "content": "You are a friendly assistant. Answer briefly."},
        {"role": "user", "content": "Why is the sky blue? Explain it to a ten year old in a few sentences."},
    ],
    [{"role": "user", "content": "Give me three tips for writing clear emails at work, with one example each."}],
    [
        {"role": "user", "content": "What color is the sky?"},
        {"role": "assistant", "content": "The sky is blue."},
        {"role": "user", "content": "What does the cow say?"},
    ],
    [{"role": "user", "content": "Translate 'good morning, how are you?' into French, Spanish and German."}],
    [{"role": "user", "content": "Explain what a hash table is and when you would use one instead of a list."}],
    [{"role": "user", "content": "Write a short poem about autumn leaves falling in a quiet park at dusk."}],
    [
        {"role": "system", "content": "You are a careful math tutor. Show your steps."},
        {"role": "user", "content": "A train travels 120 km in 1.5 hours. What is its average speed in km/h?"},
    ],
    [{"role": "user", "content": "Summarise the plot of Romeo and Juliet in three sentences."}],
    [
        {"role": "user", "content": "I have eggs, spinach, cheese and bread. What can I cook for breakfast?"},
        {"role": "assistant", "content": "You could make a spinach and cheese omelette with toast."},
        {"role": "user", "content": "How long does that take, and what do I need to be careful about?"},
    ],
    [{"role": "user", "content": "What are the main differences between Python lists and tuples? Give examples."}],
    [{"role": "user", "content": "Suggest five names for a small bakery that sells bread and cakes."}],
    [
        {"role": "system", "content": "You answer in exactly one sentence."},
        {"role": "user", "content": "What is photosynthesis?"},
    ],
    [
        {
            "role": "user",
            "content": "Here is a paragraph: 'The committee met on Tuesday to review the budget. After a long"
            " discussion, they agreed to postpone the decision until more data was available from the"
            " regional offices, which had been slow to report.' Rewrite it in plain, short sentences.",
        }
    ],
    [{"role": "user", "content": "How do I reverse a string in Python? Show two ways."}],
    [
        {"role": "user", "content": "Plan a one-day trip to Rome for someone who loves history and food."},
        {"role": "assistant", "content": "Start at the Colosseum in the morning, then walk to the Forum."},
        {"role": "user", "content": "Where should I eat lunch nearby, and what should I order?"},
        {"role": "assistant", "content": "Try a trattoria in Monti and order cacio e pepe."},
        {"role": "user", "content": "And what should I see in the afternoon?"},
    ],
    [{"role": "user", "content": "What is the difference between weather and climate?"}],
    [{"role": "user", "content": "Write a limerick about a cat who loves to sleep in the sun all day long."}],
    [
        {"role": "system", "content": "You are a helpful assistant who explains things step by step."},
        {
            "role": "user",
            "content": "My bicycle chain keeps falling off when I change gears. What could be wrong, and how can"
            " I check each possible cause at home with simple tools?",
        },
    ],
    [{"role": "user", "content": "Name the planets of the solar system in order from the sun."}],
    [{"role": "user", "content": "Give me a recipe for a simple tomato soup."}],
    [
        {"role": "user", "content": "Is it better to study in the morning or at night?"},
        {"role": "assistant", "content": "It depends on the person, but many people focus better in the morning."},
        {"role": "user", "content": "Why?"},
    ],
    [
        {
            "role": "user",
            "content": "Read this list and group the items into fruits and vegetables: apple, carrot, banana,"
            " broccoli, pear, spinach, grape, potato, mango, onion, cherry, cucumber, peach, lettuce.",
        }
    ],
    [{"role": "user", "content": "What should I pack for a weekend camping trip in the mountains?"}],
]


@dataclass(frozen=True)
class Workload:
    """What every runner generates: the same prompts and sampling parameters.

    Attributes:
        name: a label for the table.
        model_id: a twinkle model id (local folder, ``builtin://...``, ``hf://...``).
        prompts: chat conversations (lists of ``{"role", "content"}`` dicts).
        num_samples: completions per prompt.
        max_tokens: tokens per completion (with ``ignore_eos`` exactly this many).
        temperature: sampling temperature.
        top_p: nucleus mass.
        ignore_eos: keep generating past EOS (so every runner generates the same count).
        dtype: the model dtype every runner loads.
    """

    name: str
    model_id: str
    prompts: list[list[dict[str, str]]]
    num_samples: int = 4
    max_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 0.95
    ignore_eos: bool = True
    dtype: str = "float32"

    def warmup(self) -> Workload:
        """A small slice of this workload, to warm caches and kernels before timing."""
        return dataclasses.replace(self, prompts=self.prompts[:2], max_tokens=min(8, self.max_tokens))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Runner:
    """An engine to benchmark: ``target`` is ``"module:function"``, called as ``function(workload, **kwargs)``."""

    name: str
    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    """One runner on one workload."""

    runner: str
    workload: str
    tokens: int = 0
    best_s: float = 0.0
    median_s: float = 0.0
    load_s: float = 0.0
    peak_rss_mib: float = 0.0
    error: str | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.best_s if self.best_s else 0.0

    @property
    def median_tokens_per_s(self) -> float:
        return self.tokens / self.median_s if self.median_s else 0.0


# -- shared runners ---------------------------------------------------------------------------
def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def hf_generate_runner(workload: Workload, device: str = "cpu") -> Callable[[Workload], int]:
    """The baseline: Hugging Face ``model.generate``, one batched call per workload.

    All prompts go in one left-padded batch with ``num_return_sequences``;
    ``ignore_eos`` becomes ``min_new_tokens = max_tokens``. Top-k is switched
    off (``top_k=0``) so the sampling matches the other runners'.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from twinkle_core.hub import resolve_model_id

    path = str(resolve_model_id(workload.model_id))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_torch_dtype(workload.dtype)).to(device).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(w: Workload) -> int:
        ids = [
            list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
            for m in w.prompts
        ]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                do_sample=w.temperature > 0,
                temperature=w.temperature if w.temperature > 0 else None,
                top_p=w.top_p,
                top_k=0,
                max_new_tokens=w.max_tokens,
                min_new_tokens=w.max_tokens if w.ignore_eos else None,
                num_return_sequences=w.num_samples,
                pad_token_id=pad,
            )
        generated = out[:, width:]
        if w.ignore_eos:
            return int(generated.numel())
        return int((generated != pad).sum())

    return run


def sampler_runner(
    workload: Workload, engine: str = "torch", sampling: dict[str, Any] | None = None, **kwargs: Any
) -> Callable[[Workload], int]:
    """Any twinkle engine, built with ``create_sampler(engine, model_id=..., dtype=..., **kwargs)``.

    ``sampling``: more ``SamplingParams`` fields than the workload's (``structured_outputs``...).
    """
    from twinkle_core import SamplingParams, Trajectory, create_sampler

    sampler = create_sampler(engine, model_id=workload.model_id, dtype=workload.dtype, **kwargs)

    def run(w: Workload) -> int:
        params = SamplingParams(
            temperature=w.temperature,
            top_p=w.top_p,
            max_tokens=w.max_tokens,
            ignore_eos=w.ignore_eos,
            num_samples=w.num_samples,
            **(sampling or {}),
        )
        out = sampler.sample([Trajectory(messages=m) for m in w.prompts], params)
        return sum(len(s.tokens) for r in out for s in r.sequences)

    return run


# -- running ------------------------------------------------------------------------------------
def _load_target(target: str) -> Callable[..., Callable[[Workload], int]]:
    module, _, name = target.partition(":")
    if str(_HERE) not in sys.path:
        sys.path.insert(0, str(_HERE))
    return getattr(importlib.import_module(module), name)


def _child(spec: dict[str, Any], out_path: str) -> None:
    """Body of a runner's child process: load, warm up, time, write the result as JSON."""
    import torch

    torch.set_num_threads(spec.get("threads") or os.cpu_count() or 1)
    workload = Workload(**spec["workload"])
    factory = _load_target(spec["target"])
    start = time.perf_counter()
    run = factory(workload, **spec.get("kwargs", {}))
    run(workload.warmup())
    load_s = time.perf_counter() - start
    times, tokens = [], 0
    for _ in range(spec.get("repeats", 1)):
        t0 = time.perf_counter()
        tokens = run(workload)
        times.append(time.perf_counter() - t0)
    Path(out_path).write_text(
        json.dumps({"tokens": tokens, "best_s": min(times), "median_s": statistics.median(times), "load_s": load_s})
    )


def run_runner(
    runner: Runner, workload: Workload, *, repeats: int = 1, threads: int | None = None, timeout_s: float = 3600
) -> Result:
    """Run one runner on one workload in a child process and measure its peak memory.

    ``threads`` sets torch's intra-op threads in the child (default: one per CPU).
    """
    result = Result(runner=runner.name, workload=workload.name)
    with tempfile.TemporaryDirectory(prefix="twinkle-bench-") as tmp:
        out_path = Path(tmp) / "result.json"
        spec = {
            "target": runner.target,
            "kwargs": runner.kwargs,
            "workload": workload.to_dict(),
            "repeats": repeats,
            "threads": threads,
        }
        (Path(tmp) / "spec.json").write_text(json.dumps(spec))
        log_path = Path(tmp) / "log.txt"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--child", str(Path(tmp) / "spec.json"), str(out_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + timeout_s
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() > deadline:
                    proc.kill()
                    pid, status, usage = os.wait4(proc.pid, 0)
                    break
                time.sleep(0.05)
            proc.returncode = os.waitstatus_to_exitcode(status)
        result.peak_rss_mib = usage.ru_maxrss / 1024  # kilobytes on Linux
        if proc.returncode != 0 or not out_path.exists():
            tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
            result.error = f"exit {proc.returncode}: " + " | ".join(tail)
            return result
        data = json.loads(out_path.read_text())
    result.tokens, result.best_s, result.median_s, result.load_s = (
        data["tokens"],
        data["best_s"],
        data["median_s"],
        data["load_s"],
    )
    return result


def format_table(results: Sequence[Result], baseline: str) -> str:
    """A plain-text table, one row per (workload, runner), ratios against ``baseline``."""
    header = (
        f"{'workload':<24} {'runner':<16} {'tokens':>7} {'best s':>8} {'tok/s':>9} {'median':>9}"
        f" {'x base':>7} {'peak MiB':>9} {'mem x':>6} {'load s':>7}"
    )
    lines = [header, "-" * len(header)]
    for workload in dict.fromkeys(r.workload for r in results):
        rows = [r for r in results if r.workload == workload]
        base = next((r for r in rows if r.runner == baseline and not r.error), None)
        for r in rows:
            if r.error:
                lines.append(f"{workload:<24} {r.runner:<16} FAILED {r.error}")
                continue
            speed = f"{r.tokens_per_s / base.tokens_per_s:.2f}" if base and base.tokens_per_s else "-"
            mem = f"{r.peak_rss_mib / base.peak_rss_mib:.2f}" if base and base.peak_rss_mib else "-"
            lines.append(
                f"{workload:<24} {r.runner:<16} {r.tokens:>7} {r.best_s:>8.2f} {r.tokens_per_s:>9.1f}"
                f" {r.median_tokens_per_s:>9.1f} {speed:>7} {r.peak_rss_mib:>9.0f} {mem:>6} {r.load_s:>7.1f}"
            )
    return "\n".join(lines)


def cycled_prompts(n: int) -> list[list[dict[str, str]]]:
    """``n`` chat prompts: :data:`BENCH_PROMPTS` in order, from the start again once they run out."""
    return [BENCH_PROMPTS[i % len(BENCH_PROMPTS)] for i in range(n)]


def machine_summary() -> str:
    """One line about the machine: CPU count and model, memory, torch version and threads."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    try:
        import torch

        extra = f", torch {torch.__version__}"
        if torch.cuda.is_available():
            extra += f", {torch.cuda.get_device_name(0)}"
    except ImportError:  # pragma: no cover
        extra = ""
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"{os.cpu_count()} CPUs ({cpu}){mem}{extra}, Python {platform.python_version()}{load}"


def _best(results: list[Result]) -> Result:
    """The fastest of several runs of one runner; peak memory is the highest seen."""
    ok = [r for r in results if not r.error]
    if not ok:
        return results[-1]
    best = min(ok, key=lambda r: r.best_s)
    best.median_s = statistics.median(r.median_s for r in ok)
    best.peak_rss_mib = max(r.peak_rss_mib for r in ok)
    return best


def paired_ratios(runs: dict[str, list[Result]], baseline: str) -> str:
    """Each runner's tokens/s over the baseline's in the same round, per round and their median."""
    lines = []
    for name, results in runs.items():
        if name == baseline:
            continue
        ratios = [
            r.tokens_per_s / b.tokens_per_s
            for r, b in zip(results, runs[baseline])
            if not r.error and not b.error and b.tokens_per_s
        ]
        if ratios:
            each = ", ".join(f"{x:.3f}" for x in ratios)
            lines.append(f"  {name} / {baseline}, round by round: {each}; median {statistics.median(ratios):.3f}x")
    return "\n".join(lines)


def compare(
    runners: Sequence[Runner],
    workloads: Sequence[Workload],
    *,
    baseline: str,
    repeats: int = 1,
    rounds: int = 1,
    threads: int | None = None,
    stream: Any = None,
) -> list[Result]:
    """Run every runner on every workload (each in its own process) and print the table.

    Args:
        runners: the engines; ``baseline`` names the one ratios are against.
        workloads: what to generate.
        baseline: a runner name.
        repeats: timed runs per child after the warm-up (the best is reported).
        rounds: how many times the runners take turns (a fresh child each time);
            on a shared machine, alternating gives every runner the same
            chance of a quiet moment. The fastest round is reported.
        threads: torch threads per child (default: one per CPU).
        stream: where progress and the table go (default stdout).

    Returns:
        One result per (workload, runner), in the order run.
    """
    out = stream or sys.stdout
    print(f"machine: {machine_summary()}; torch threads per engine: {threads or os.cpu_count()}", file=out, flush=True)
    results = []
    for workload in workloads:
        print(
            f"workload {workload.name}: {workload.model_id}, {len(workload.prompts)} prompts x {workload.num_samples}"
            f" samples x {workload.max_tokens} tokens, temperature {workload.temperature}, top_p {workload.top_p},"
            f" ignore_eos={workload.ignore_eos}, {workload.dtype}",
            file=out,
            flush=True,
        )
        runs: dict[str, list[Result]] = {r.name: [] for r in runners}
        for _ in range(max(1, rounds)):
            for runner in runners:
                result = run_runner(runner, workload, repeats=repeats, threads=threads)
                status = result.error or f"{result.tokens_per_s:.1f} tokens/s, peak {result.peak_rss_mib:.0f} MiB"
                print(f"  {runner.name}: {status}", file=out, flush=True)
                runs[runner.name].append(result)
        results.extend(_best(runs[r.name]) for r in runners)
        if rounds > 1:
            print(paired_ratios(runs, baseline), file=out, flush=True)
    print(file=out)
    print(format_table(results, baseline), file=out, flush=True)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"), required=True, help=argparse.SUPPRESS)
    args = parser.parse_args()
    _child(json.loads(Path(args.child[0]).read_text()), args.child[1])
