"""The engine's own CPU kernels: built on this machine, called through ``ctypes``.

Two sources make one library: ``decode_attention.cpp`` (:func:`decode_attention`)
and ``nucleus.cpp`` (:func:`nucleus`, the sampler's top-p mass without a sort).

One decode step of grouped-query attention is, for PyTorch on CPU, many tiny
matrix products, and ``scaled_dot_product_attention`` spends most of its time
on their overhead rather than on reading the cache: at SmolLM2's shapes and
256 rows it takes 3.4-3.8x the time of a plain read of the keys and values
(``bench/bench_attention.py``). The kernel streams each (row, key head)'s keys
and values once for all the query heads of its group and skips the columns a
row masks.

The library is compiled on first use with the machine's C++ compiler (``$CXX``, else
``c++``, ``g++`` or ``clang++``; ``-O3 -march=native -fopenmp``) into
``$TWINKLE_CACHE/kernels`` (default ``~/.cache/twinkle/kernels``), under
a name that hashes the sources, the compiler, the flags and the CPU, so a
cache shared by different machines never loads a binary built for another.
Without a compiler, or when the build fails, :func:`load` says why and the
engine keeps PyTorch's attention (``attention_kernel="auto"``) or refuses to
start (``attention_kernel="native"``).

:func:`decode_attention` takes float32 and bfloat16 CPU tensors; anything else
(another device or dtype, a float mask, a layout it does not read) returns
``None`` and the caller runs PyTorch's attention instead; :func:`nucleus`
does the same for what it does not take.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from twinkle_core.hub import cache_root
from twinkle_torch import openmp

__all__ = ["KernelUnavailable", "decode_attention", "load", "nucleus"]

_SOURCES = tuple(Path(__file__).with_name(name) for name in ("decode_attention.cpp", "nucleus.cpp"))
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
_NAMES = " and ".join(path.name for path in _SOURCES)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
#: seconds a build may take before it counts as failed
_BUILD_TIMEOUT = 300

_lock = threading.Lock()
_loaded: ctypes.CDLL | KernelUnavailable | None = None


class KernelUnavailable(RuntimeError):
    """The kernel could not be built or loaded on this machine; the message says why."""


def _compiler() -> str | None:
    named = os.environ.get("CXX")
    if named:
        return shutil.which(named) or named
    return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def _cache_dir() -> Path:
    return cache_root() / "kernels"  # under twinkle's one cache variable, TWINKLE_CACHE


def _cpu() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _build(compiler: str) -> Path:
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelUnavailable(f"the C++ compiler {compiler!r} does not run: {exc}") from exc
    sources = [path.read_bytes() for path in _SOURCES]
    digest = hashlib.sha256(b"\0".join([*sources, " ".join(_FLAGS).encode(), version.encode(), _cpu().encode()]))
    target = _cache_dir() / f"kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # build beside the target and rename: processes building at once never load a half-written file
        fd, partial = tempfile.mkstemp(prefix=target.stem, suffix=".so.partial", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        where = target.parent
        raise KernelUnavailable(f"cannot write the kernel cache {where} (set TWINKLE_CACHE): {exc}") from exc
    try:
        done = subprocess.run(
            [compiler, *_FLAGS, "-o", partial, *map(str, _SOURCES)],
            capture_output=True,
            text=True,
            timeout=_BUILD_TIMEOUT,
        )
        if done.returncode != 0:
            raise KernelUnavailable(f"building {_NAMES} with {compiler} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    except subprocess.TimeoutExpired as exc:
        raise KernelUnavailable(f"building {_NAMES} with {compiler} took over {_BUILD_TIMEOUT} s") from exc
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def load() -> ctypes.CDLL:
    """The kernel, built on the first call; :class:`KernelUnavailable` (on every call, same reason) if it cannot be."""
    global _loaded
    with _lock:
        if _loaded is None:
            compiler = _compiler()
            try:
                if compiler is None:
                    raise KernelUnavailable("no C++ compiler found (set CXX, or install g++ or clang++)")
                library = ctypes.CDLL(str(_build(compiler)))
                function = library.twinkle_decode_attention
                nucleus_function = library.twinkle_nucleus
            except KernelUnavailable as exc:
                _loaded = exc
            except (OSError, AttributeError) as exc:
                _loaded = KernelUnavailable(f"loading the built kernel failed: {exc}")
            else:
                i64 = ctypes.c_int64
                function.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 5 + [i64] * 13 + [ctypes.c_float, ctypes.c_int]
                function.restype = ctypes.c_int
                nucleus_function.argtypes = [ctypes.c_void_p, i64, i64, i64, ctypes.c_double, ctypes.c_double]
                nucleus_function.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
                nucleus_function.restype = ctypes.c_int
                _loaded = library
                openmp.rescan()  # built with -fopenmp: it may have brought an OpenMP runtime of its own
        if isinstance(_loaded, KernelUnavailable):
            raise KernelUnavailable(str(_loaded))
        return _loaded


def _library() -> ctypes.CDLL | None:
    library = _loaded
    if isinstance(library, ctypes.CDLL):
        return library
    try:
        return load()
    except KernelUnavailable:
        return None


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor | None:
    """One decode step's attention.

    ``query``: ``[rows, kv_heads, group, dim]``; ``key``, ``value``: ``[rows, kv_heads, tokens, dim]``.

    ``mask``: ``None`` or a boolean ``[rows or 1, 1, 1, tokens]`` (``True``: attend).
    Returns ``[rows, kv_heads * group, dim]`` (the query heads in order), or
    ``None`` where the kernel does not apply or cannot be built.
    """
    library = _library()
    if library is None:
        return None
    rows, heads, group, dim = query.shape
    tokens = key.shape[2]
    dtype = _DTYPES.get(query.dtype)
    if (
        dtype is None
        or not (query.dtype == key.dtype == value.dtype)
        or any(t.device.type != "cpu" for t in (query, key, value))
        or key.shape != (rows, heads, tokens, dim)
        or value.shape != key.shape
        or key.stride(-1) != 1
        or value.stride(-1) != 1
        or tokens == 0
        or (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))
    ):
        return None
    mask_row = 0
    if mask is not None:
        if (
            mask.dtype != torch.bool
            or mask.device.type != "cpu"
            or mask.dim() != 4
            or mask.shape[1:] != (1, 1, tokens)
            or mask.shape[0] not in (1, rows)
        ):
            return None
        mask = mask.reshape(mask.shape[0], tokens)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mask_row = mask.stride(0) if mask.shape[0] == rows else 0  # one row for all: broadcast
    if query.stride() != (query.stride(0), group * dim, dim, 1):
        query = query.contiguous()
    out = query.new_empty(rows, heads * group, dim)
    if rows == 0:
        return out
    status = library.twinkle_decode_attention(
        dtype, query.data_ptr(), key.data_ptr(), value.data_ptr(),
        None if mask is None else mask.data_ptr(), out.data_ptr(),
        rows, heads, group, dim, tokens, query.stride(0),
        key.stride(0), key.stride(1), key.stride(2), value.stride(0), value.stride(1), value.stride(2),
        mask_row, dim**-0.5 if scale is None else float(scale), torch.get_num_threads(),
    )  # fmt: skip
    if status == -2:
        raise MemoryError("decode attention: no memory for the kernel's scratch buffers")
    return out if status == 0 else None


def nucleus(probs: torch.Tensor, top_p: float, min_p: float | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's top-p nucleus (with the min-p rule when ``min_p`` is given), without sorting.

    ``probs``: ``[rows, vocab]`` float32 probabilities on the CPU. A token is
    kept when the mass of the tokens strictly more likely than it is below
    ``top_p`` (ties are kept together), and, with ``min_p``, when it is at
    least ``min_p`` times the row's largest probability. Returns ``(mass,
    threshold)``, each ``[rows, 1]``: the kept tokens' total probability
    (summed in double) and the lowest kept probability, NaN both for a row
    that holds a value no probability has (NaN, negative, infinite). ``None``
    where the kernel does not apply or cannot be built.
    """
    if (
        probs.dtype != torch.float32
        or probs.device.type != "cpu"
        or probs.dim() != 2
        or probs.shape[1] == 0
        or probs.stride(1) != 1
        or probs.stride(0) < probs.shape[1]
        or not top_p > 0.0
        or (min_p is not None and not 0.0 <= min_p <= 1.0)
        or (torch.is_grad_enabled() and probs.requires_grad)
    ):
        return None
    library = _library()
    if library is None:
        return None
    rows, vocab = probs.shape
    mass = probs.new_empty(rows, 1)
    threshold = probs.new_empty(rows, 1)
    if rows == 0:
        return mass, threshold
    status = library.twinkle_nucleus(
        probs.data_ptr(), rows, vocab, probs.stride(0), float(top_p), -1.0 if min_p is None else float(min_p),
        mass.data_ptr(), threshold.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return (mass, threshold) if status == 0 else None
