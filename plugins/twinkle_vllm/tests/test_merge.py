"""Merged-LoRA sampling on vLLMSampler: ``add_adapter_to_model(..., merge=True)``.

One engine for the module, with LoRA on so the same adapter can be served
both ways. Merged log-probs must match the LoRA kernels' within ``MERGE_TOL``
(float32; the kernels and the merged matmul round differently).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.errors import AdapterError, MergedAdapterError

from .conftest import make_sampler

#: Documented tolerance of merged against unmerged log-probs on the vLLM engine (float32).
MERGE_TOL = 1e-3

PROMPTS = [
    Trajectory(messages=[{"role": "user", "content": "What is the capital of France?"}]),
    Trajectory(messages=[{"role": "user", "content": "Count to five."}]),
    Trajectory(messages=[{"role": "user", "content": "Tell me a short story about a cat."}]),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)

Outputs = tuple[list[list[int]], list[list[float]]]


@pytest.fixture(scope="module")
def sampler(tiny_model: Path) -> Iterator[Any]:
    with make_sampler(tiny_model, enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=2) as s:
        yield s


@pytest.fixture
def clean(sampler: Any) -> Iterator[Any]:
    yield sampler
    for name in list(sampler.adapters):
        sampler.remove_adapter(name)


def run(sampler: Any, adapter: str = "") -> Outputs:
    got = sampler.sample(PROMPTS, GREEDY, adapter_name=adapter)
    assert all(r.sequences[0].adapter_name == adapter for r in got)
    return [r.sequences[0].tokens for r in got], [list(r.sequences[0].logprobs) for r in got]


def assert_close(merged: Outputs, unmerged: Outputs) -> None:
    assert merged[0] == unmerged[0]
    for a, b in zip(merged[1], unmerged[1]):
        assert a == pytest.approx(b, abs=MERGE_TOL)


def test_merged_adapter_matches_the_lora_kernels(clean: Any, adapters: dict[str, Path]) -> None:
    sampler = clean
    base = run(sampler)
    sampler.add_adapter_to_model("a", adapters["a"])
    unmerged = run(sampler, "a")
    assert unmerged[0] != base[0]
    version = sampler.add_adapter_to_model("a", adapters["a"], merge=True)
    merged = run(sampler, "a")
    assert_close(merged, unmerged)
    assert sampler.sample(PROMPTS[0], GREEDY, adapter_name="a")[0].sequences[0].weights_version == version


def test_base_requests_are_refused_and_remove_restores_the_base_exactly(clean: Any, adapters: dict[str, Path]) -> None:
    sampler = clean
    base = run(sampler)
    sampler.add_adapter_to_model("a", adapters["a"], merge=True)
    with pytest.raises(MergedAdapterError, match="'a' is merged"):
        sampler.sample(PROMPTS, GREEDY)
    with pytest.raises(AdapterError, match="'a' is merged"):
        sampler.add_adapter_to_model("b", adapters["b"])
    assert list(sampler.adapters) == ["a"]
    sampler.remove_adapter("a")
    assert run(sampler) == base


def test_remerge_after_re_adding_serves_the_new_weights(clean: Any, adapters: dict[str, Path]) -> None:
    """A trainer re-adds one name each step, in memory; each step must serve that step's weights."""
    from safetensors.torch import load_file

    sampler = clean
    expected = {}
    for name in ("a", "b"):
        sampler.add_adapter_to_model(name, adapters[name])
        expected[name] = run(sampler, name)
        sampler.remove_adapter(name)
    assert expected["a"][0] != expected["b"][0]
    for step in ("a", "b", "a"):
        config = json.loads((adapters[step] / "adapter_config.json").read_text())
        weights = load_file(str(adapters[step] / "adapter_model.safetensors"))
        sampler.add_adapter_to_model("policy", config, weights=weights, merge=True)
        assert_close(run(sampler, "policy"), expected[step])


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_merge_that_fails_part_way_is_undone(
    clean: Any, adapters: dict[str, Path], error: type[BaseException]
) -> None:
    """A merge whose push fails part-way puts back what was there: the adapter merged before. (Here the failure
    comes after the workers applied every layer, while the engine kept its copies for a restart.)"""
    from safetensors.torch import load_file

    from twinkle_core.testing.faults import failing_when_copied

    sampler = clean
    config = json.loads((adapters["b"] / "adapter_config.json").read_text())
    tensors = dict(load_file(str(adapters["b"] / "adapter_model.safetensors")))
    last = [k for k in tensors if "lora_B" in k][-1]
    failing = {**tensors, last: failing_when_copied(tensors[last], error("interrupted while merging"))}
    sampler.add_adapter_to_model("policy", adapters["a"], merge=True)
    before, version = run(sampler, "policy"), sampler.weights_version
    with pytest.raises(error, match="interrupted while merging"):
        sampler.add_adapter_to_model("policy", config, weights=failing, merge=True)
    assert sampler.weights_version == version
    assert run(sampler, "policy") == before
    sampler.remove_adapter("policy")
    sampler.add_adapter_to_model("policy", config, weights=tensors, merge=True)
    assert run(sampler, "policy")[0] != before[0]


def test_update_weights_while_merged_keeps_the_merge_right(
    clean: Any, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    """Runs last: it leaves pushed base weights."""
    import torch
    from safetensors.torch import load_file

    sampler = clean
    state = load_file(str(tiny_model / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    layer = "model.layers.0.self_attn."
    names = [f"{layer}{m}_proj.weight" for m in ("q", "k", "v")]  # one fused layer: sent together
    update = {n: state[n] + 0.05 * torch.randn(state[n].shape, generator=gen) for n in names}
    sampler.add_adapter_to_model("a", adapters["a"], merge=True)
    sampler.update_weights(update)
    merged = run(sampler, "a")
    sampler.add_adapter_to_model("a", adapters["a"])  # merge=False: the kept (updated) base goes back
    assert_close(merged, run(sampler, "a"))
    unmerged = run(sampler, "a")
    sampler.remove_adapter("a")
    # Merging again after the update starts from the pushed base values (the replay copies).
    sampler.add_adapter_to_model("a", adapters["a"], merge=True)
    assert_close(run(sampler, "a"), unmerged)
    sampler.remove_adapter("a")
    # Without replay copies of the pushed base values the merge is refused: test_faults.py (an engine
    # built with replay_weights=False).
