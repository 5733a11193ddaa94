"""Worker methods only the benchmarks call, kept out of the shipped worker extension.

:class:`BenchWorkerExtension` adds them to twinkle's vLLM worker extension;
engines started inside :func:`bench_worker_hooks` load it instead of the
shipped one (vLLM imports the class by name in its worker processes, so this
folder goes on their ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from twinkle_vllm.extension import TwinkleWorkerExtension


class BenchWorkerExtension(TwinkleWorkerExtension):
    """twinkle's worker extension plus the floor ``bench_sync.py`` holds ``update_weights`` to."""

    def twinkle_bench_stage(self, path: str) -> int:
        """Read a safetensors file into this worker's memory, for :meth:`twinkle_bench_reload`.

        Returns:
            The number of tensors held.
        """
        from safetensors.torch import load_file

        self._twinkle_bench_tensors = {k: v.clone() for k, v in load_file(path).items()}
        return len(self._twinkle_bench_tensors)

    def twinkle_bench_reload(self, names: list[str]) -> float:
        """vLLM's own ``reload_weights`` of held tensors: no transport, no checksum.

        Only vLLM's layerwise reload (including the CPU backend's repacking)
        of exactly the tensors ``update_weights`` pushes.

        Returns:
            Seconds spent inside this worker.
        """
        held: dict[str, torch.Tensor] = getattr(self, "_twinkle_bench_tensors", {})
        clock = time.perf_counter()
        with torch.no_grad():
            self.reload_weights(weights_iterator=((name, held[name]) for name in names))  # type: ignore[attr-defined]
        return time.perf_counter() - clock


@contextmanager
def bench_worker_hooks() -> Iterator[None]:
    """vLLM engines started inside this block run :class:`BenchWorkerExtension`."""
    from twinkle_vllm import _engine_args

    here = str(Path(__file__).resolve().parent)
    saved = _engine_args.EXTENSION_CLS, os.environ.get("PYTHONPATH")
    _engine_args.EXTENSION_CLS = f"{BenchWorkerExtension.__module__}.{BenchWorkerExtension.__qualname__}"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, saved[1]) if p)
    try:
        yield
    finally:
        _engine_args.EXTENSION_CLS = saved[0]
        if saved[1] is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved[1]
