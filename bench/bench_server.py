"""``twinkle serve`` against in-process ``sample()``: concurrent clients, same requests, two patterns.

    python bench/bench_server.py                     # vLLM CPU engine, the tiny model, both patterns
    python bench/bench_server.py --engine torch --clients 8 --pattern chat

Patterns: ``chat`` (an agent framework's calls: one conversation each,
``max_tokens`` generated) and ``score`` (lm-evaluation-harness's
loglikelihood requests: ``/v1/completions`` with a batch of ``--batch``
token-id prompts, ``echo``, ``logprobs: 1``, ``max_tokens: 1``; in process,
the same prompts through ``sample()`` with ``prompt_logprobs=1``). The
throughput counted is generated tokens for ``chat`` and scored prompt
tokens for ``score``.

One engine is started; the same workload runs on it in two arms:

* ``in-process``: ``clients`` threads, each calling ``sampler.sample()`` on its
  chat requests one after another (vLLM batches the concurrent calls);
* ``server``: ``clients`` threads, each with its own ``openai`` client, sending
  the same requests to ``start_server(sampler)`` on a loopback port. The
  clients run in a child process, as an agent framework would: in the
  server's process their threads would compete with it for the GIL.

Every request asks for exactly ``max_tokens`` tokens (``ignore_eos``), so both
arms generate the same number of tokens. The arms alternate for ``repeats``
rounds (in-process, server, in-process, server, ...), so a slow spell of a
shared machine falls on both; each round gives a tokens/s ratio server /
in-process and a p50 latency difference. Reported: the median of each over
the rounds (target ratio >= 0.8x), and their range, which says how far one
round's number can be trusted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

PROMPTS = [
    "What is the capital of France?",
    "Tell me a story about a duck.",
    "Count from 3 to 8.",
    "Tell me about Carol.",
]


def _run(clients: int, per_client: int, call: Callable[[int, int], int]) -> tuple[float, int, list[float]]:
    """Run ``call(client, k)`` from ``clients`` threads; return wall seconds, tokens and latencies."""
    latencies: list[float] = []
    tokens = [0] * clients
    lock = threading.Lock()
    go = threading.Barrier(clients + 1)

    def worker(c: int) -> None:
        go.wait()
        for k in range(per_client):
            t0 = time.perf_counter()
            n = call(c, k)
            dt = time.perf_counter() - t0
            with lock:
                latencies.append(dt)
            tokens[c] += n

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    go.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - start, sum(tokens), latencies


def _messages(c: int, k: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPTS[(c + k) % len(PROMPTS)]}]


def _score_batch(prompts: list[list[int]], batch: int, c: int, k: int) -> list[list[int]]:
    start = ((c * 7 + k) * batch) % len(prompts)
    return [prompts[(start + i) % len(prompts)] for i in range(batch)]


def _score_prompts(sampler: Any, n: int = 64, length: int = 96) -> list[list[int]]:
    """Token-id prompts of ``length`` tokens, as lm-eval sends context + continuation."""
    text = " ".join(PROMPTS) + " The quick brown fox jumps over the lazy dog. "
    ids = sampler.template.tokenizer.encode(text * 20)
    return [ids[i : i + length] for i in range(n)]


def _clients(args: argparse.Namespace) -> None:
    """The child process: ``clients`` threads of ``openai`` clients against the server."""
    import openai

    local = threading.local()
    if args.pattern == "score":
        import httpx

        with open(args.prompts_file) as f:
            prompts = json.load(f)

        def score(c: int, k: int) -> int:
            if not hasattr(local, "client"):
                local.client = httpx.Client(base_url=args.client_of, timeout=600)
            body = {
                "model": "base",
                "prompt": _score_batch(prompts, args.batch, c, k),
                "echo": True,
                "logprobs": 1,
                "max_tokens": 1,
                "temperature": 0,
            }
            r = local.client.post("/v1/completions", json=body).json()
            return sum(len(ch["logprobs"]["token_logprobs"]) - 1 - len(ch["token_ids"]) for ch in r["choices"])

        _run(min(4, args.clients), 1, score)  # warm-up
        print(json.dumps(_run(args.clients, args.requests, score)))
        return

    def via_server(c: int, k: int) -> int:
        if not hasattr(local, "client"):
            local.client = openai.OpenAI(base_url=args.client_of + "/v1", api_key="unused", max_retries=0)
        r = local.client.chat.completions.create(
            model="base",
            messages=_messages(c, k),
            max_tokens=args.max_tokens,
            temperature=1.0,
            extra_body={"ignore_eos": True},
        )
        return len(r.choices[0].model_extra["token_ids"])

    _run(min(4, args.clients), 1, via_server)  # warm-up
    print(json.dumps(_run(args.clients, args.requests, via_server)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="vllm", choices=["vllm", "torch"])
    ap.add_argument("--model", default=None, help="model folder (default: the tiny test model)")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="rounds of the two arms, alternating")
    ap.add_argument("--pattern", default="both", choices=["chat", "score", "both"])
    ap.add_argument("--batch", type=int, default=8, help="prompts per scoring request (lm-eval's batch_size)")
    ap.add_argument("--client-of", default=None, help=argparse.SUPPRESS)  # internal: run the clients against URL
    ap.add_argument("--prompts-file", default=None, help=argparse.SUPPRESS)  # internal: the scoring prompts
    args = ap.parse_args()
    if args.client_of:
        _clients(args)
        return
    patterns = ["chat", "score"] if args.pattern == "both" else [args.pattern]
    summary = {p: _bench(args, p) for p in patterns}
    for pattern, result in summary.items():
        print(
            f"{pattern}: server / in-process: median {result['ratio_median']:.2f}x over {len(result['rounds'])} rounds"
            f" (range {result['ratio_min']:.2f}-{result['ratio_max']:.2f}); added p50 latency"
            f" {result['added_p50_ms_median']:.0f} ms"
        )
    print(json.dumps(summary))


def _bench(args: argparse.Namespace, pattern: str) -> dict[str, Any]:
    """Both arms of one pattern, alternating for ``repeats`` rounds."""
    import tempfile

    from twinkle_core import SamplingParams, create_sampler
    from twinkle_core.server import start_server
    from twinkle_core.testing import build_tiny_model

    model = args.model or str(build_tiny_model("llama"))
    kwargs: dict[str, Any] = {"model_id": model}
    if args.engine == "vllm":
        kwargs["engine_args"] = {
            "enforce_eager": True,
            "kv_cache_memory_bytes": 1 << 30,
            "dtype": "float32",
            "max_num_seqs": 64,
        }
    else:
        kwargs["device"] = "cpu"
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=1.0, logprobs=0)

    rounds: list[dict[str, Any]] = []
    with create_sampler(args.engine, **kwargs) as sampler:
        prompts = _score_prompts(sampler)
        scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, logprobs=1)

        def direct(c: int, k: int) -> int:
            if pattern == "score":
                batch = _score_batch(prompts, args.batch, c, k)
                responses = sampler.sample([{"input_ids": p} for p in batch], scoring)
                return sum(len(r.prompt_logprobs or []) - 1 for r in responses)
            return len(sampler.sample({"messages": _messages(c, k)}, params)[0].sequences[0].tokens)

        _run(min(4, args.clients), 1, direct)  # warm-up
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as prompts_file:
            json.dump(prompts, prompts_file)
        with start_server(sampler, log_level="error") as srv:
            argv = [
                sys.executable,
                __file__,
                "--client-of",
                srv.url,
                "--clients",
                str(args.clients),
                "--requests",
                str(args.requests),
                "--max-tokens",
                str(args.max_tokens),
                "--pattern",
                pattern,
                "--batch",
                str(args.batch),
                "--prompts-file",
                prompts_file.name,
            ]
            for r in range(args.repeats):
                arms: dict[str, tuple[float, int, list[float]]] = {}
                arms["in-process"] = _run(args.clients, args.requests, direct)
                out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
                wall, toks, lat = json.loads(out.strip().splitlines()[-1])
                arms["server"] = (wall, toks, lat)
                row: dict[str, Any] = {}
                for name, (wall, toks, lat) in arms.items():
                    row[name] = {"tokens_per_s": toks / wall, "tokens": toks, "p50_s": statistics.median(lat)}
                row["ratio"] = row["server"]["tokens_per_s"] / row["in-process"]["tokens_per_s"]
                row["added_p50_s"] = row["server"]["p50_s"] - row["in-process"]["p50_s"]
                rounds.append(row)
                print(
                    f"{pattern} round {r}: in-process {row['in-process']['tokens_per_s']:.1f} tok/s"
                    f" p50 {row['in-process']['p50_s']:.3f}s | server {row['server']['tokens_per_s']:.1f} tok/s"
                    f" p50 {row['server']['p50_s']:.3f}s | ratio {row['ratio']:.2f}x,"
                    f" added p50 {row['added_p50_s'] * 1000:.0f} ms",
                    flush=True,
                )

    os.unlink(prompts_file.name)
    ratios = [r["ratio"] for r in rounds]
    added = [r["added_p50_s"] * 1000 for r in rounds]
    return {
        "engine": args.engine,
        "clients": args.clients,
        "requests_per_client": args.requests,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "added_p50_ms_median": statistics.median(added),
        "rounds": rounds,
    }


if __name__ == "__main__":
    main()
