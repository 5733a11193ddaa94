"""Weights to many replicas: the object store against the collective, for 1, 2 and 4 replicas.

    python bench/bench_transport.py                          # tiny model and SmolLM2-135M, float32
    python bench/bench_transport.py --models tiny --repeats 5
    python bench/bench_transport.py --chain-only             # the chain between processes alone

One Ray cluster of separate nodes on this machine (``ray.cluster_utils``):
a head node with no CPUs, where this process (the trainer) runs, and one
node per replica, each with its own raylet and object store, so an object
store pull really crosses nodes (over loopback TCP, through the object
managers). Each replica is a TorchSampler of the model. For each model and
replica count it pushes the whole state dict ``--repeats`` times with each
transport, interleaved, and reports per update:

* seconds (median, best) of ``update_weights``, validation to version bump;
* the trainer node's egress over the model's bytes: what this process
  wrote (``wchar`` in ``/proc/<pid>/io``: gloo writes its sockets with
  ``writev``) plus what the head node's raylet sent on its TCP sockets
  (``ss``; its object manager serves the pulls, over gRPC's ``sendmsg``,
  which ``wchar`` does not count).

Targets (issue 27): the collective's egress at most 1.2x the model at 4
replicas, and its time at 4 replicas at most 1.5x its time at 1. Ratios
matter, not absolute times: two cores serve every node here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = {"tiny": None, "smollm2": "builtin://smollm2-135m-instruct"}


def _wchar(pid: int) -> int:
    """Bytes the process wrote with write/writev (gloo's sockets among them; not sendmsg)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise RuntimeError(f"no wchar for pid {pid}")


def _tcp_sent(pid: int) -> int:
    """Bytes sent on the process's open TCP sockets (``ss``: the kernel's count; gRPC's sendmsg included)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    total, mine = 0, False
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            mine = f"pid={pid}," in line
        elif mine:
            match = re.search(r"bytes_sent:(\d+)", line)
            total += int(match.group(1)) if match else 0
    return total


def _egress(raylet: int) -> int:
    """What left the trainer's node: this process's writes (the collective's gloo sockets) and the
    head raylet's TCP sends (the object manager serving pulls); both keep their sockets for the measure."""
    return _wchar(os.getpid()) + _tcp_sent(raylet)


def _state(model_dir: str) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    out: list[tuple[str, Any]] = []
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        out += list(load_file(str(path)).items())
    return out


def _model_dir(model: str) -> str:
    if MODELS[model] is None:
        from twinkle_core.testing import build_tiny_model

        return str(build_tiny_model())
    from twinkle_core.hub import resolve_model_id

    return str(resolve_model_id(MODELS[model]))


class _PeakRss:
    """This process's resident memory above its level at start, at its highest until :meth:`stop` (5 ms samples)."""

    def __init__(self) -> None:
        import threading

        self.page = os.sysconf("SC_PAGE_SIZE")
        self.base = self._rss()
        self.peak = self.base
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * self.page

    def _run(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, self._rss()) - self.base


def _receiver(spec: Any, rank: int, out: Any) -> None:
    import resource

    from twinkle_core.transport.collective import receive

    def cpu() -> float:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    start, cpu0 = time.perf_counter(), cpu()
    _buckets, _checksums, _forwarded = receive(spec, rank)
    out.put((rank, time.perf_counter() - start, cpu() - cpu0))


def chain_only(models: list[str], counts: list[int], repeats: int) -> list[dict[str, Any]]:
    """The chain alone: this process sends, ``n`` spawned processes receive (and checksum); no Ray, no engine."""
    import multiprocessing

    from twinkle_core.transport.collective import Sender

    ctx = multiprocessing.get_context("spawn")
    rows: list[dict[str, Any]] = []
    for model in models:
        state = _state(_model_dir(model))
        model_bytes = sum(t.numel() * t.element_size() for _, t in state)
        for n in counts:
            times, egress, cpus, extra, peaks = [], [], [], [], []
            for _ in range(repeats + 1):
                sender = Sender(n + 1, host="127.0.0.1", timeout_s=300)
                queue = ctx.Queue()
                procs = [ctx.Process(target=_receiver, args=(sender.spec, r, queue)) for r in range(1, n + 1)]
                for proc in procs:
                    proc.start()
                sender.wait_joined()
                before = _wchar(os.getpid())
                watch = _PeakRss()
                start = time.perf_counter()
                report = sender.send(iter(state))  # an iterator, as a sharded trainer's gathers come
                extra.append(watch.stop())
                peaks.append(report.peak_bucket_bytes)
                cpus.append(max(queue.get(timeout=600)[2] for _ in procs))
                times.append(time.perf_counter() - start)
                egress.append(_wchar(os.getpid()) - before)
                for proc in procs:
                    proc.join()
                sender.close()
            rows.append(
                {
                    "model": model,
                    "model_mib": model_bytes / 2**20,
                    "replicas": n,
                    "transport": "chain only",
                    "median_s": statistics.median(times[1:]),
                    "best_s": min(times[1:]),
                    "egress_x_model": statistics.median(egress[1:]) / model_bytes,
                    # CPU seconds (user + system) of the busiest receiver: what each replica's node spends
                    "receiver_cpu_s": statistics.median(cpus[1:]),
                    # the sender's resident memory above where it started, at its highest during the send
                    "sender_extra_mib": max(extra[1:]) / 2**20,
                    "largest_bucket_mib": max(peaks) / 2**20,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=sorted(MODELS))
    parser.add_argument("--replicas", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument(
        "--chain-only", action="store_true", help="time the chain between processes alone (no Ray, no engine)"
    )
    args = parser.parse_args()
    from harness import machine_summary

    if args.chain_only:
        print(machine_summary())
        _print_table(chain_only(args.models, args.replicas, args.repeats), args.json)
        return

    import ray
    from ray.cluster_utils import Cluster

    import twinkle_core as tw
    from twinkle_core import DeviceGroup, DeviceMesh
    from twinkle_core.transport import CollectiveOptions
    from twinkle_torch.sampler import TorchSampler

    most = max(args.replicas)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 2 << 30})
    for _ in range(most):
        cluster.add_node(num_cpus=1, object_store_memory=2 << 30)
    cluster.wait_for_nodes()
    raylet = cluster.head_node.all_processes["raylet"][0].process.pid
    print(machine_summary())
    print(f"cluster: a head node (this process, no CPUs) and {most} one-CPU nodes, one object store each")
    rows: list[dict[str, Any]] = []
    collective = CollectiveOptions()
    try:
        for model in args.models:
            model_dir = _model_dir(model)
            state = _state(model_dir)
            model_bytes = sum(t.numel() * t.element_size() for _, t in state)
            for n in args.replicas:
                group = f"{model}-{n}"
                tw.initialize(
                    "ray",
                    address=cluster.address,
                    placement_strategy="STRICT_SPREAD",
                    groups=[DeviceGroup(name=group, ranks=n, device_type="cpu")],
                )
                sampler = TorchSampler(model_dir, remote_group=group, device_mesh=DeviceMesh.from_sizes(dp_size=n))
                times: dict[str, list[float]] = {"object_store": [], "collective": []}
                egress: dict[str, list[int]] = {"object_store": [], "collective": []}
                for _ in range(args.repeats + 1):  # the first round warms up (connections, allocations)
                    for transport in ("object_store", "collective"):
                        sampler.weight_transport = collective if transport == "collective" else transport
                        before = _egress(raylet)
                        start = time.perf_counter()
                        sampler.update_weights(state, check_finite=False)
                        times[transport].append(time.perf_counter() - start)
                        egress[transport].append(_egress(raylet) - before)
                sampler.close()
                tw.shutdown()  # gives the group's CPUs back for the next replica count
                for transport in times:
                    t, e = times[transport][1:], egress[transport][1:]
                    rows.append(
                        {
                            "model": model,
                            "model_mib": model_bytes / 2**20,
                            "replicas": n,
                            "transport": transport,
                            "median_s": statistics.median(t),
                            "best_s": min(t),
                            "egress_x_model": statistics.median(e) / model_bytes,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        tw.shutdown()
        ray.shutdown()
        cluster.shutdown()

    _print_table(rows, args.json)


def _print_table(rows: list[dict[str, Any]], json_path: str | None) -> None:
    chain = any("receiver_cpu_s" in row for row in rows)
    print()
    print(
        f"{'model':8} {'MiB':>6} {'replicas':>8} {'transport':13} {'median s':>9} {'best s':>8}"
        f" {'egress x model':>15} {'time x 1 replica':>17}"
        + (f" {'receiver CPU s':>15} {'sender +MiB':>12} {'bucket MiB':>11}" if chain else "")
    )
    for row in rows:
        first = next(r for r in rows if r["model"] == row["model"] and r["transport"] == row["transport"])
        extra = (
            f" {row['receiver_cpu_s']:15.2f} {row['sender_extra_mib']:12.1f} {row['largest_bucket_mib']:11.1f}"
            if chain
            else ""
        )
        print(
            f"{row['model']:8} {row['model_mib']:6.1f} {row['replicas']:8d} {row['transport']:13}"
            f" {row['median_s']:9.3f} {row['best_s']:8.3f} {row['egress_x_model']:15.2f}"
            f" {row['median_s'] / first['median_s']:17.2f}" + extra
        )
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
