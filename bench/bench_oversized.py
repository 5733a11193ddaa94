"""What one oversized prompt costs: the answer, the time to it and the memory, in process and over HTTP.

    python bench/bench_oversized.py                       # 64 MiB chat message, both arms, torch engine
    python bench/bench_oversized.py --mib 16 --arms http --timeout 60

Each arm runs in its own child process, so one arm's memory never shows in
the other's figures:

* ``in-process``: ``sampler.sample()`` on the torch engine with one chat
  message of ``"a " * (mib * 2**19)`` (``--mib`` MiB of text);
* ``http``: ``twinkle serve --engine torch`` on a loopback port, and the same
  message as a ``/v1/chat/completions`` body.

Printed per arm: the answer (the error type, or the HTTP status and the
start of its message), the seconds to it, the resident memory before, at its
peak while the call ran (sampled every 50 ms) and 5 s after the answer, and
whether a normal greedy call afterwards still answers. A call that gets no
answer within ``--timeout`` seconds is reported as such and its process is
killed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

MODEL = "builtin://smollm2-135m-instruct"


class _Peak:
    """The peak resident memory of a process, sampled in a thread while a block runs."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.peak = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def rss(self) -> int:
        return int(self.proc.memory_info().rss)

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.rss())
            except Exception:
                return

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def _in_process(mib: int, timeout: float) -> dict[str, Any]:
    from twinkle_core import create_sampler

    sampler = create_sampler("torch", model_id=MODEL)
    text = "a " * (mib * 2**19)
    params = {"max_tokens": 4, "temperature": 0.0}
    sampler.sample([{"messages": [{"role": "user", "content": "hi"}]}], params)  # warm
    result: dict[str, Any] = {}

    def call() -> None:
        try:
            sampler.sample([{"messages": [{"role": "user", "content": text}]}], params)
            result["answer"] = "sampled (no error)"
        except Exception as exc:
            result["answer"] = f"{type(exc).__name__}: {str(exc)[:100]}"

    peak = _Peak(os.getpid())
    before = peak.rss()
    start = time.perf_counter()
    with peak:
        worker = threading.Thread(target=call, daemon=True)
        worker.start()
        worker.join(timeout)
    took = time.perf_counter() - start
    if worker.is_alive():
        return {"answer": f"no answer within {timeout:.0f} s", "seconds": took, "before": before, "peak": peak.peak}
    time.sleep(5)
    after = peak.rss()
    ok = sampler.sample([{"messages": [{"role": "user", "content": "hi"}]}], params)[0].sequences[0].tokens
    return {**result, "seconds": took, "before": before, "peak": peak.peak, "after": after, "usable": bool(ok)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(mib: int, timeout: float) -> dict[str, Any]:
    import httpx

    port = _free_port()
    twinkle = os.path.join(os.path.dirname(sys.executable), "twinkle")
    server = subprocess.Popen(
        [twinkle, "serve", "--engine", "torch", "--model", MODEL, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        small = {"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
        httpx.post(f"{base}/v1/chat/completions", json=small, timeout=60).raise_for_status()
        body = json.dumps({**small, "messages": [{"role": "user", "content": "a " * (mib * 2**19)}]}).encode()
        peak = _Peak(server.pid)
        before = peak.rss()
        start = time.perf_counter()
        with peak:
            try:
                reply = httpx.post(
                    f"{base}/v1/chat/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout=timeout,
                )
                answer = f"{reply.status_code}: {reply.text[:100]}"
            except httpx.TimeoutException:
                answer = f"no answer within {timeout:.0f} s"
            except httpx.HTTPError as exc:  # the server may close the connection after answering early
                answer = f"{type(exc).__name__}: {exc}"
        took = time.perf_counter() - start
        time.sleep(5)
        after = peak.rss()
        try:
            usable = httpx.post(f"{base}/v1/chat/completions", json=small, timeout=timeout).status_code == 200
        except httpx.HTTPError:
            usable = False
        return {
            "answer": answer,
            "seconds": took,
            "before": before,
            "peak": peak.peak,
            "after": after,
            "usable": usable,
        }
    finally:
        server.kill()
        server.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64, help="MiB of text in the message")
    ap.add_argument("--arms", default="in-process,http")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for an answer")
    ap.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # the child's own arm
    args = ap.parse_args()
    if args.arm is not None:
        run = _in_process if args.arm == "in-process" else _http
        print(json.dumps(run(args.mib, args.timeout)))
        return
    print(f"one chat message of {args.mib} MiB, torch engine, {MODEL}")
    print(f"{'arm':<11} {'seconds':>8} {'RSS before':>11} {'peak':>11} {'5 s after':>11}  usable  answer")
    for arm in args.arms.split(","):
        cmd = [sys.executable, __file__, "--arm", arm, "--mib", str(args.mib), "--timeout", str(args.timeout)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 600)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines:
            print(f"{arm:<11} failed: {proc.stderr[-400:]}")
            continue
        r = json.loads(lines[-1])
        after = _mib(r["after"]) if "after" in r else "-"
        print(
            f"{arm:<11} {r['seconds']:>8.1f} {_mib(r['before']):>11} {_mib(r['peak']):>11} {after:>11}"
            f"  {r.get('usable', '-')!s:<6}  {r['answer']}"
        )


if __name__ == "__main__":
    main()
