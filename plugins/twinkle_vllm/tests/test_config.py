"""Construction errors and engine-option forwarding (no engine is started here)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from twinkle_core.errors import ConfigError, UnsupportedFeatureError
from twinkle_core.mesh import DeviceMesh
from twinkle_vllm import IPC_TIMEOUT_ENV
from twinkle_vllm._engine_args import (
    DEFAULT_IPC_TIMEOUT_S,
    THREADS_BIND_ENV,
    build_engine_args,
    cpu_threads_bind,
    platform_environment,
    read_ipc_timeout,
)


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf", "-0.5"])
def test_invalid_ipc_timeout_fails_at_construction(
    value: str, monkeypatch: pytest.MonkeyPatch, tiny_model: Path
) -> None:
    from twinkle_vllm.sampler import vLLMSampler

    monkeypatch.setenv(IPC_TIMEOUT_ENV, value)
    with pytest.raises(ConfigError, match=IPC_TIMEOUT_ENV) as info:
        vLLMSampler(tiny_model)
    assert repr(value) in str(info.value)


def test_ipc_timeout_parsing() -> None:
    assert read_ipc_timeout({}) == DEFAULT_IPC_TIMEOUT_S == 300
    assert read_ipc_timeout({IPC_TIMEOUT_ENV: ""}) == 300
    assert read_ipc_timeout({IPC_TIMEOUT_ENV: "2.5"}) == 2.5
    assert read_ipc_timeout({IPC_TIMEOUT_ENV: " 10 "}) == 10


def test_unknown_engine_option_lists_the_valid_ones(tiny_model: Path) -> None:
    from twinkle_vllm.sampler import vLLMSampler

    with pytest.raises(ConfigError) as info:
        vLLMSampler(tiny_model, engine_args={"enable_prefix_cachin": False})
    message = str(info.value)
    assert "'enable_prefix_cachin'" in message and "Did you mean 'enable_prefix_caching'" in message
    assert "gpu_memory_utilization" in message and "max_model_len" in message
    with pytest.raises(ConfigError, match="no_such_option"):
        vLLMSampler(tiny_model, no_such_option=1)


@pytest.mark.parametrize("option", ["worker_extension_cls", "logprobs_mode", "model"])
def test_reserved_engine_options(option: str, tiny_model: Path) -> None:
    from twinkle_vllm.sampler import vLLMSampler

    with pytest.raises(ConfigError, match=option):
        vLLMSampler(tiny_model, engine_args={option: "x"})


def test_mesh_and_options_conflicts(tiny_model: Path) -> None:
    from twinkle_vllm.sampler import vLLMSampler

    with pytest.raises(ConfigError, match="tp_size"):
        vLLMSampler(tiny_model, DeviceMesh.from_sizes(tp_size=1), engine_args={"tensor_parallel_size": 2})
    with pytest.raises(UnsupportedFeatureError, match="remote_group"):
        vLLMSampler(tiny_model, DeviceMesh.from_sizes(dp_size=2))
    with pytest.raises(ConfigError, match="given twice"):
        vLLMSampler(tiny_model, engine_args={"max_num_seqs": 4}, max_num_seqs=8)
    with pytest.raises(ConfigError, match="engine_args"):
        vLLMSampler(tiny_model, engine_args=["enforce_eager"])  # type: ignore[arg-type]


def test_options_are_forwarded_explicitly_false_included(tiny_model: Path) -> None:
    args = build_engine_args(
        tiny_model, 2, {"enable_prefix_caching": False, "enforce_eager": False, "max_num_seqs": 3, "seed": 0}
    )
    assert args.enable_prefix_caching is False
    assert args.enforce_eager is False
    assert args.max_num_seqs == 3 and args.seed == 0
    assert args.tensor_parallel_size == 2
    assert args.model == str(tiny_model)
    assert args.worker_extension_cls == "twinkle_vllm.extension.TwinkleWorkerExtension"
    assert args.logprobs_mode == "processed_logprobs"
    args = build_engine_args(tiny_model, 1, {"logits_processors": ["my.pkg:Proc"]})
    assert args.logits_processors == [
        "twinkle_vllm._logits:TemperatureProcessor",
        "twinkle_vllm._logits:GrammarProcessor",
        "my.pkg:Proc",
    ]


def test_cpu_thread_binding_gives_each_worker_its_own_cores() -> None:
    assert cpu_threads_bind(2, [0, 1]) == "0|1"
    assert cpu_threads_bind(2, {3, 0, 1, 2}) == "0,1|2,3"
    assert cpu_threads_bind(2, [4, 5, 6]) == "4,5|6"  # uneven: the first worker takes the extra core
    assert cpu_threads_bind(1, [0, 1]) == "0,1"
    with pytest.raises(ConfigError, match=THREADS_BIND_ENV) as info:
        cpu_threads_bind(3, [0, 1])
    assert "tensor_parallel_size=3" in str(info.value) and "2 core(s)" in str(info.value)


def test_thread_binding_is_chosen_only_when_the_user_did_not(monkeypatch: pytest.MonkeyPatch) -> None:
    cores = len(os.sched_getaffinity(0))
    assert platform_environment(1, {}) == {}
    assert platform_environment(2, {THREADS_BIND_ENV: "0-1|2-3"}) == {}  # the user's own binding wins
    assert platform_environment(2, {THREADS_BIND_ENV: "nobind"}) == {}
    if cores >= 2:
        assert platform_environment(2, {}) == {THREADS_BIND_ENV: cpu_threads_bind(2, os.sched_getaffinity(0))}
        assert platform_environment(2, {THREADS_BIND_ENV: "auto"}) == platform_environment(2, {})


def test_more_tp_workers_than_cores_is_a_config_error_before_any_engine_starts(tiny_model: Path) -> None:
    from twinkle_vllm.sampler import vLLMSampler

    too_many = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match=THREADS_BIND_ENV):
        vLLMSampler(tiny_model, DeviceMesh.from_sizes(tp_size=too_many))


def test_on_cpu_the_kv_cache_default_leaves_room_for_other_engines() -> None:
    from twinkle_vllm._engine_args import cpu_kv_cache_default

    gib, mib = 1 << 30, 1 << 20
    # a quarter of what is available, between 512 MiB and 4 GiB
    assert cpu_kv_cache_default({}, {}, available=8 * gib) == 2 * gib
    assert cpu_kv_cache_default({}, {}, available=64 * gib) == 4 * gib
    assert cpu_kv_cache_default({}, {}, available=1 * gib) == 512 * mib
    # whatever the user chose wins: an engine option or vLLM's own variable
    assert cpu_kv_cache_default({"gpu_memory_utilization": 0.5}, {}, available=8 * gib) is None
    assert cpu_kv_cache_default({"kv_cache_memory_bytes": gib}, {}, available=8 * gib) is None
    assert cpu_kv_cache_default({}, {"VLLM_CPU_KVCACHE_SPACE": "2"}, available=8 * gib) is None


def test_the_engine_arguments_carry_the_kv_cache_twinkle_picked_and_say_so(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    with caplog.at_level("INFO", logger="twinkle.vllm"):
        picked = build_engine_args(tiny_model, 1, {}).kv_cache_memory_bytes
    assert 512 << 20 <= picked <= 4 << 30
    assert f"a KV cache of {picked / (1 << 30):.2f} GiB" in caplog.text and "gpu_memory_utilization" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="twinkle.vllm"):
        args = build_engine_args(tiny_model, 1, {"gpu_memory_utilization": 0.3})
    assert args.kv_cache_memory_bytes is None and args.gpu_memory_utilization == 0.3 and not caplog.text
