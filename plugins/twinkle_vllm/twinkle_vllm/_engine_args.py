"""Building vLLM's ``AsyncEngineArgs`` from what the user gave, and the env knobs.

Engine options are forwarded to vLLM *explicitly*: whatever the user sets is
passed as given, ``False`` and ``0`` included, and an option vLLM does not
know is an error (with the valid names), never dropped with a warning.
A few options belong to twinkle itself (it needs them to keep its contract)
and cannot be overridden.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError, did_you_mean
from twinkle_vllm import IPC_TIMEOUT_ENV
from twinkle_vllm._hybrid import hybrid_options, refuse_moe_lora_on_cpu

__all__ = [
    "DEFAULT_IPC_TIMEOUT_S",
    "EXTENSION_CLS",
    "KVCACHE_SPACE_ENV",
    "KV_CACHE_OPTIONS",
    "LOGITS_PROCESSOR",
    "RESERVED",
    "THREADS_BIND_ENV",
    "build_engine_args",
    "cpu_kv_cache_default",
    "cpu_threads_bind",
    "engine_option_names",
    "platform_defaults",
    "platform_environment",
    "read_ipc_timeout",
]

DEFAULT_IPC_TIMEOUT_S = 300.0

log = logging.getLogger("twinkle.vllm")

#: Our worker extension: weight sync, in-memory LoRA, debug hooks.
EXTENSION_CLS = "twinkle_vllm.extension.TwinkleWorkerExtension"
#: Our logits processor: temperatures vLLM's own range does not reach.
LOGITS_PROCESSOR = "twinkle_vllm._logits:TemperatureProcessor"
#: Our logits processor for a constraint continued from earlier tokens (vLLM's restarts at the first).
GRAMMAR_PROCESSOR = "twinkle_vllm._logits:GrammarProcessor"

#: Options twinkle sets itself, and why a user cannot override them.
RESERVED: dict[str, str] = {
    "model": "pass the model as vLLMSampler(model_id=...)",
    "tokenizer": "the tokenizer comes from the model folder (use template=... to change the chat template)",
    "worker_extension_cls": "twinkle installs its own worker extension for weight sync",
    "logprobs_mode": (
        "twinkle runs vLLM with processed log-probs and serves logprobs_mode='raw' per request"
        " (SamplingParams.logprobs_mode)"
    ),
}


def read_ipc_timeout(environ: dict[str, str] | None = None) -> float:
    """Parse ``TWINKLE_VLLM_IPC_TIMEOUT_S`` (seconds, a number > 0; default 300).

    Raises:
        ConfigError: the variable is set to anything but a finite number > 0.
    """
    env = os.environ if environ is None else environ
    raw = env.get(IPC_TIMEOUT_ENV)
    if raw is None or raw.strip() == "":
        return DEFAULT_IPC_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"{IPC_TIMEOUT_ENV}={raw!r} is invalid: expected a number of seconds > 0"
            f" (default {DEFAULT_IPC_TIMEOUT_S:g})."
        )
    return value


def engine_option_names() -> list[str]:
    """Every option ``vllm.AsyncEngineArgs`` accepts, sorted."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return sorted(f.name for f in dataclasses.fields(AsyncEngineArgs))


def platform_defaults(options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Engine options twinkle defaults differently from vLLM on this platform (the user's own win).

    On vLLM's CPU backend: the KV cache's size where ``options`` (the user's)
    choose none (see :func:`cpu_kv_cache_default`), and no chunked prefill.

    On vLLM's CPU backend, a seeded request whose prompt is prefilled in chunks
    kills the engine: vLLM rewinds the request's random generator after a
    partial prefill with ``Generator.set_offset``, which CPU generators do not
    have ("CPU Generator does not use offset", vLLM 0.32). A call with many
    prompts (or samples) fills the step's token budget and gets chunked, so any
    seeded call could hit it. Without chunked prefill every prompt is prefilled
    whole (a prompt that waits goes in a later step), and seeds work at any size.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    kv_bytes = cpu_kv_cache_default(options or {})
    return {"enable_chunked_prefill": False, **({} if kv_bytes is None else {"kv_cache_memory_bytes": kv_bytes})}


#: vLLM's own variable (GiB): on CPU it sizes the KV cache, over any engine option.
KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
#: The engine options by which a user sizes vLLM's KV cache (on CPU, the first is a share of the RAM).
KV_CACHE_OPTIONS = ("gpu_memory_utilization", "kv_cache_memory_bytes", "num_gpu_blocks_override")
_GiB = 1 << 30
_MiB = 1 << 20


def cpu_kv_cache_default(
    options: Mapping[str, Any], environ: Mapping[str, str] | None = None, available: int | None = None
) -> int | None:
    """The KV-cache size twinkle picks on vLLM's CPU backend when the user picked none, in bytes.

    vLLM's default there reserves ``gpu_memory_utilization`` (0.92) of the
    machine's RAM for one engine: a second engine, a trainer or Ray's object
    store on the same machine then cannot start ("Available memory ... is less
    than desired CPU memory utilization"). twinkle gives the cache a quarter of
    the memory available when the engine starts, between 512 MiB and 4 GiB
    (whole MiB): enough for several SmolLM2-sized engines' full context, and
    room left for the rest. Any of :data:`KV_CACHE_OPTIONS` or
    ``VLLM_CPU_KVCACHE_SPACE`` set by the user turns this off.

    Args:
        options: the user's engine options.
        environ: the environment (default ``os.environ``).
        available: the memory available now, in bytes (default: read by psutil).

    Returns:
        The size, or ``None`` where the user chose one.
    """
    env = os.environ if environ is None else environ
    if any(options.get(name) is not None for name in KV_CACHE_OPTIONS) or env.get(KVCACHE_SPACE_ENV, "").strip():
        return None
    if available is None:
        import psutil

        available = int(psutil.virtual_memory().available)
    quarter = available // 4 // _MiB * _MiB
    return min(4 * _GiB, max(512 * _MiB, quarter))


#: vLLM's CPU backend: which cores each worker's OpenMP threads are bound to, '|' between workers.
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_threads_bind(tp_size: int, cores: Iterable[int]) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value giving each of ``tp_size`` workers its own cores.

    vLLM's default (``auto``) binds one NUMA node per worker, so on a machine
    with one node any ``tp_size > 1`` fails at engine start ("Not enough
    allowed NUMA nodes"). This splits the cores the process may run on into
    ``tp_size`` contiguous groups as even as they can be (``"0|1"``,
    ``"0,1|2,3"``); the first groups take one core more when they do not divide.

    Raises:
        ConfigError: fewer cores than workers (a worker per core at least).
    """
    ids = sorted(set(cores))
    if tp_size > len(ids):
        raise ConfigError(
            f"tensor_parallel_size={tp_size} needs a core per worker on vLLM's CPU backend, but this process may"
            f" run on {len(ids)} core(s) ({', '.join(map(str, ids))}): use a smaller tp_size, or set"
            f" {THREADS_BIND_ENV} yourself (cores per worker, '|' between workers, e.g. '0-3|4-7'; 'nobind' to"
            " leave threads unbound)."
        )
    base, extra = divmod(len(ids), tp_size)
    groups: list[str] = []
    start = 0
    for rank in range(tp_size):
        size = base + (1 if rank < extra else 0)
        groups.append(",".join(map(str, ids[start : start + size])))
        start += size
    return "|".join(groups)


def platform_environment(tp_size: int, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables the engine's processes need on this platform (what the user set wins).

    On vLLM's CPU backend with ``tp_size > 1``: a thread binding with a core
    set per worker (see :func:`cpu_threads_bind`), unless the user set one.
    """
    env = os.environ if environ is None else environ
    if tp_size <= 1 or env.get(THREADS_BIND_ENV, "").strip() not in ("", "auto"):
        return {}
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    return {THREADS_BIND_ENV: cpu_threads_bind(tp_size, os.sched_getaffinity(0))}


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` while the engine's processes are spawned, then restore it."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def build_engine_args(model_dir: Path, tp_size: int, options: dict[str, Any]) -> Any:
    """Return ``AsyncEngineArgs`` for ``model_dir`` with the user's ``options``.

    Args:
        model_dir: the local model folder.
        tp_size: tensor-parallel size (from the device mesh).
        options: engine options as the user gave them (``engine_args`` merged
            with extra keyword arguments of the sampler).

    Raises:
        ConfigError: an unknown or reserved option, a ``tensor_parallel_size``
            that contradicts the mesh, a dtype the model cannot run in on this
            platform or LoRA slots for a mixture of experts on CPU
            (:mod:`twinkle_vllm._hybrid`), or a value vLLM rejects.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    valid = engine_option_names()
    for name in options:
        if not isinstance(name, str) or name not in valid:
            raise ConfigError(
                f"Unknown vLLM engine option {name!r}.{did_you_mean(str(name), valid, n=3)}"
                f" Valid options (vllm.AsyncEngineArgs): {', '.join(valid)}."
            )
        if name in RESERVED:
            raise ConfigError(f"Engine option {name!r} cannot be set: {RESERVED[name]}.")
    if "tensor_parallel_size" in options and options["tensor_parallel_size"] != tp_size:
        raise ConfigError(
            f"Engine option tensor_parallel_size={options['tensor_parallel_size']!r} contradicts"
            f" device_mesh.tp_size={tp_size}: set it through DeviceMesh.from_sizes(tp_size=...)."
        )

    custom_procs = options.get("logits_processors") or []
    if not isinstance(custom_procs, (list, tuple)):
        raise ConfigError(
            f"Engine option logits_processors={custom_procs!r} is invalid: expected a list of"
            " 'pkg.module:Class' strings or classes."
        )
    refuse_moe_lora_on_cpu(model_dir, options, cpu=current_platform.is_cpu())
    # vLLM refuses custom logits processors with speculative decoding; without ours,
    # temperatures outside [0.01, 2] are then refused per request instead.
    ours = [] if options.get("speculative_config") else [LOGITS_PROCESSOR, GRAMMAR_PROCESSOR]
    defaults = platform_defaults(options)
    if defaults.get("kv_cache_memory_bytes") is not None:
        chosen = defaults["kv_cache_memory_bytes"]
        log.info(
            "vLLM on CPU: a KV cache of %.2f GiB (a quarter of the memory available now, between 0.5 and 4 GiB;"
            " vLLM's own default would reserve 92%% of the RAM). To choose: engine option kv_cache_memory_bytes,"
            " gpu_memory_utilization (a share of the RAM on CPU) or %s (GiB).",
            chosen / _GiB,
            KVCACHE_SPACE_ENV,
        )
    kwargs: dict[str, Any] = {
        "disable_log_stats": True,
        **defaults,
        # The user's options go last so they win over our defaults, False included; a hybrid
        # model's dtype on CPU is the exception: one it cannot run in is refused above, "auto" resolved.
        **options,
        **hybrid_options(model_dir, options, cpu=current_platform.is_cpu()),
        "model": str(model_dir),
        "tensor_parallel_size": tp_size,
        "worker_extension_cls": EXTENSION_CLS,
        "logprobs_mode": "processed_logprobs",
        "logits_processors": [*ours, *custom_procs],
    }
    try:
        return AsyncEngineArgs(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"vLLM rejected the engine options {sorted(options)}: {exc}") from exc
