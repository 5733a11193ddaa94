"""Two vLLMSampler replicas (the CPU build of vLLM) through Ray: sampling and weight sync, both transports.

vLLM runs inside the Ray actor unchanged: it starts its engine-core process
with ``spawn`` on its own. The engine options and environment are the vLLM
plugin tests' (eager mode, a 1 GiB KV cache, float32).
"""

from __future__ import annotations

import os
from typing import Any

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
try:
    import twinkle_vllm  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"twinkle_vllm is not importable ({exc}); install plugins/twinkle_vllm[cpu]", allow_module_level=True)
pytest.importorskip("twinkle_torch")

import twinkle_core as tw  # noqa: E402
from twinkle_core import DeviceGroup, DeviceMesh, SampleResponse, Trajectory  # noqa: E402
from twinkle_core.errors import WeightUpdateError  # noqa: E402
from twinkle_core.testing import TINY_CHAT_PROMPTS, build_tiny_model  # noqa: E402

ENGINE_ARGS: dict[str, Any] = {
    "enforce_eager": True,
    "kv_cache_memory_bytes": 1 << 30,
    "dtype": "float32",
    "max_num_seqs": 64,
}
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
GREEDY = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(build_tiny_model("llama"))


@pytest.fixture(scope="module")
def remote(model_dir):
    tw.initialize(
        "ray", groups=[DeviceGroup(name="vllm", ranks=2, device_type="cpu")], num_cpus=2, runtime_env={"env_vars": ENV}
    )
    try:
        from twinkle_vllm.sampler import vLLMSampler

        mesh = DeviceMesh.from_sizes(dp_size=2)
        with vLLMSampler(model_dir, engine_args=ENGINE_ARGS, remote_group="vllm", device_mesh=mesh) as s:
            yield s
    finally:
        tw.shutdown()


@pytest.fixture(scope="module")
def local(model_dir):
    from twinkle_torch.sampler import TorchSampler

    with TorchSampler(model_dir) as s:
        yield s


def chats() -> list[Trajectory]:
    return [Trajectory(messages=m) for m in TINY_CHAT_PROMPTS] * 2  # each prompt on both replicas


def tokens(responses: list[SampleResponse]) -> list[list[int]]:
    return [r.sequences[0].tokens for r in responses]


def test_vllm_replica_samples_like_the_torch_engine(remote, local):
    assert remote.engine_name == "vllm" and remote.num_replicas == 2
    out = remote.sample(chats(), GREEDY)
    assert all(r.sequences[0].text for r in out)
    assert tokens(out) == tokens(local.sample(chats(), GREEDY))
    seeded = {"temperature": 1.0, "max_tokens": 16, "seed": 3}
    assert tokens(remote.sample(chats()[:3], seeded, num_samples=2)) == tokens(
        remote.sample(chats()[:3], seeded, num_samples=2)
    )


def test_update_weights_through_ray(remote, local, model_dir):
    from safetensors.torch import load_file

    state = load_file(os.path.join(model_dir, "model.safetensors"))
    before = tokens(remote.sample(chats(), GREEDY))
    gen = torch.Generator().manual_seed(0)
    names = ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"]
    new = [(n, state[n] + 2.0 * state[n].std() * torch.randn(state[n].shape, generator=gen)) for n in names]
    with pytest.raises(WeightUpdateError):
        remote.update_weights({"no_such.weight": torch.zeros(3)})
    assert remote.update_weights(new) == 1
    local.update_weights(new)
    after = remote.sample(chats(), GREEDY)
    assert tokens(after) != before
    assert tokens(after) == tokens(local.sample(chats(), GREEDY))
    assert {r.sequences[0].weights_version for r in after} == {1}


def test_the_collective_transport_updates_both_replicas_like_the_object_store(remote, local, model_dir):
    from safetensors.torch import load_file

    from twinkle_core.transport import CollectiveOptions

    state = load_file(os.path.join(model_dir, "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    qkv = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]  # vLLM loads them as one layer
    names = [*qkv, "lm_head.weight"]
    new = [(n, state[n] + 2.0 * state[n].std() * torch.randn(state[n].shape, generator=gen)) for n in names]
    remote.update_weights(list(state.items()))  # from the model as saved (earlier tests changed it)
    local.update_weights(list(state.items()))
    v = remote.weights_version
    remote.update_weights(new)  # the object store
    by_store = tokens(remote.sample(chats(), GREEDY))
    remote.update_weights(list(state.items()))
    base = tokens(remote.sample(chats(), GREEDY))
    remote.weight_transport = CollectiveOptions(bucket_bytes=64 << 10, chunk_bytes=16 << 10, timeout_s=60)
    try:
        assert remote.update_weights(iter(new)) == v + 3  # a one-shot stream, read as it goes
        got = remote.sample(chats(), GREEDY)
        assert tokens(got) == by_store != base
        assert {s.weights_version for r in got for s in r.sequences} == {v + 3}
        local.update_weights(new)
        assert tokens(got) == tokens(local.sample(chats(), GREEDY))
        with pytest.raises(WeightUpdateError, match=r"no_such\.weight"):  # both replicas refuse it: nothing changes
            remote.update_weights([("no_such.weight", torch.zeros(3))])
        assert remote.weights_version == v + 3
        remote.update_weights(list(state.items()))
        local.update_weights(list(state.items()))
        assert tokens(remote.sample(chats(), GREEDY)) == base
    finally:
        remote.weight_transport = "object_store"
