"""Merged-LoRA sampling on the torch engine: ``add_adapter_to_model(..., merge=True)``.

A reference sampler serves the same adapters through PEFT's LoRA layers; the
merged sampler must give the same greedy tokens and log-probs within
``MERGE_TOL`` (float32: the merged weight rounds ``W + scale * B @ A`` once,
where the LoRA layer adds two rounded products).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from twinkle_core import SamplingParams, Trajectory
from twinkle_core.errors import AdapterError, MergedAdapterError
from twinkle_torch.sampler import TorchSampler

#: Documented tolerance of merged against unmerged log-probs, float32 (docs/concepts.md).
MERGE_TOL = 1e-4

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=0)

Outputs = tuple[list[list[int]], list[list[float]]]


def run(sampler: TorchSampler, prompts: list[Trajectory], adapter: str = "") -> Outputs:
    got = sampler.sample(prompts, GREEDY, adapter_name=adapter)
    assert all(r.sequences[0].adapter_name == adapter for r in got)
    return [r.sequences[0].tokens for r in got], [list(r.sequences[0].logprobs or []) for r in got]


def assert_close(merged: Outputs, unmerged: Outputs) -> None:
    assert merged[0] == unmerged[0]
    for a, b in zip(merged[1], unmerged[1]):
        assert a == pytest.approx(b, abs=MERGE_TOL)


def assert_differ(a: Outputs, b: Outputs) -> None:
    assert a[0] != b[0] or any(abs(x - y) > 1e-3 for xs, ys in zip(a[1], b[1]) for x, y in zip(xs, ys))


def clear(sampler: TorchSampler) -> None:
    for name in list(sampler.adapters):
        sampler.remove_adapter(name)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> Iterator[TorchSampler]:
    with TorchSampler(tiny_llama, device="cpu") as s:
        yield s


@pytest.fixture(scope="module")
def merging(tiny_llama: Path) -> Iterator[TorchSampler]:
    with TorchSampler(tiny_llama, device="cpu") as s:
        yield s


@pytest.fixture
def pair(reference: TorchSampler, merging: TorchSampler) -> Iterator[tuple[TorchSampler, TorchSampler]]:
    yield reference, merging
    clear(reference)
    clear(merging)


def state(sampler: TorchSampler) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in sampler.model.state_dict().items()}


def test_merged_adapter_matches_the_unmerged_one(
    pair: tuple[TorchSampler, TorchSampler], lora_dirs: dict[str, Path], chat_prompts: list[Trajectory]
) -> None:
    reference, merging = pair
    base = run(merging, chat_prompts)
    for name in ("a", "b", "c"):
        reference.add_adapter_to_model(name, lora_dirs[name])
    for name in ("a", "b", "c"):
        version = merging.add_adapter_to_model("m", lora_dirs[name], merge=True)
        merged = run(merging, chat_prompts, "m")
        assert_close(merged, run(reference, chat_prompts, name))
        assert_differ(merged, base)
        assert merging.sample(chat_prompts[0], GREEDY, adapter_name="m")[0].sequences[0].weights_version == version


def test_base_requests_and_other_adapters_are_refused_while_merged(
    pair: tuple[TorchSampler, TorchSampler], lora_dirs: dict[str, Path], chat_prompts: list[Trajectory]
) -> None:
    _, merging = pair
    merging.add_adapter_to_model("a", lora_dirs["a"], merge=True)
    with pytest.raises(MergedAdapterError, match="'a' is merged"):
        merging.sample(chat_prompts[0], GREEDY)
    with pytest.raises(AdapterError, match="'a' is merged"):
        merging.add_adapter_to_model("b", lora_dirs["b"])
    with pytest.raises(AdapterError, match=r"Cannot merge adapter 'b'"):
        merging.add_adapter_to_model("b", lora_dirs["b"], merge=True)
    assert list(merging.adapters) == ["a"]
    run(merging, chat_prompts, "a")  # the refusals changed nothing


def test_merge_is_refused_while_another_adapter_is_loaded(
    pair: tuple[TorchSampler, TorchSampler], lora_dirs: dict[str, Path], chat_prompts: list[Trajectory]
) -> None:
    _, merging = pair
    merging.add_adapter_to_model("a", lora_dirs["a"])
    before = run(merging, chat_prompts, "a")
    with pytest.raises(AdapterError, match=r"\['a'\] are loaded"):
        merging.add_adapter_to_model("b", lora_dirs["b"], merge=True)
    assert run(merging, chat_prompts, "a") == before


def test_remerge_serves_the_new_weights_and_restores_dropped_targets(
    pair: tuple[TorchSampler, TorchSampler], lora_dirs: dict[str, Path], chat_prompts: list[Trajectory]
) -> None:
    """A trainer re-adds one name each step; targets differ between a, b and c."""
    reference, merging = pair
    for name in ("a", "b", "c"):
        reference.add_adapter_to_model(name, lora_dirs[name])
    for step in ("b", "a", "c", "a"):
        merging.add_adapter_to_model("policy", lora_dirs[step], merge=True)
        assert_close(run(merging, chat_prompts, "policy"), run(reference, chat_prompts, step))


def test_remove_restores_the_base_model_exactly(
    pair: tuple[TorchSampler, TorchSampler], lora_dirs: dict[str, Path], chat_prompts: list[Trajectory]
) -> None:
    _, merging = pair
    weights = state(merging)
    base = run(merging, chat_prompts)
    merging.add_adapter_to_model("a", lora_dirs["a"], merge=True)
    merging.add_adapter_to_model("a", lora_dirs["b"], merge=True)
    merging.remove_adapter("a")
    after = state(merging)
    assert all(torch.equal(after[k], weights[k]) for k in weights)
    assert run(merging, chat_prompts) == base


def test_switching_a_merged_adapter_to_unmerged_restores_the_base(
    pair: tuple[TorchSampler, TorchSampler], lora_dirs: dict[str, Path], chat_prompts: list[Trajectory]
) -> None:
    reference, merging = pair
    base = run(merging, chat_prompts)
    reference.add_adapter_to_model("a", lora_dirs["a"])
    merging.add_adapter_to_model("a", lora_dirs["a"], merge=True)
    merging.add_adapter_to_model("a", lora_dirs["a"])  # merge=False: served by the LoRA layers again
    assert run(merging, chat_prompts) == base
    assert run(merging, chat_prompts, "a") == run(reference, chat_prompts, "a")


def test_update_weights_while_merged_keeps_the_merge_right(
    pair: tuple[TorchSampler, TorchSampler], lora_dirs: dict[str, Path], chat_prompts: list[Trajectory]
) -> None:
    """New base values of merged and unmerged weights: the merge is redone on the new base."""
    reference, merging = pair
    weights = state(merging)
    gen = torch.Generator().manual_seed(0)
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
    ]  # the first two are targets of adapter "a"
    update = {n: weights[n] + 0.05 * torch.randn(weights[n].shape, generator=gen) for n in names}
    try:
        reference.add_adapter_to_model("a", lora_dirs["a"])
        merging.add_adapter_to_model("a", lora_dirs["a"], merge=True)
        reference.update_weights(update)
        merging.update_weights(update)
        assert_close(run(merging, chat_prompts, "a"), run(reference, chat_prompts, "a"))
        merging.remove_adapter("a")
        after = state(merging)
        for name, value in update.items():
            assert torch.equal(after[name], value), f"{name}: the pushed base value must survive the unmerge"
    finally:
        clear(reference)
        clear(merging)
        reference.update_weights({n: weights[n] for n in names})
        merging.update_weights({n: weights[n] for n in names})


def test_merge_from_config_and_tensors_in_memory(
    pair: tuple[TorchSampler, TorchSampler], lora_dirs: dict[str, Path], chat_prompts: list[Trajectory]
) -> None:
    from safetensors.torch import load_file

    reference, merging = pair
    config = json.loads((lora_dirs["b"] / "adapter_config.json").read_text())
    tensors = load_file(str(lora_dirs["b"] / "adapter_model.safetensors"))
    reference.add_adapter_to_model("b", lora_dirs["b"])
    merging.add_adapter_to_model("b", config, weights=tensors, merge=True)
    assert merging.adapters["b"].source == "<memory>"
    assert_close(run(merging, chat_prompts, "b"), run(reference, chat_prompts, "b"))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"merge": "yes"}, r"merge='yes' is invalid"),
        ({"config": {"use_dora": True}}, "DoRA"),
        ({"extra": "model.norm.weight"}, "not a lora_A / lora_B weight"),
        ({"drop_b": True}, "needs lora_A and lora_B"),
        ({"scale": 1e30}, "holds NaN or infinity"),  # finite tensors whose product overflows float32
        ({"rank0": True}, r"with r >= 1"),
        ({"dtype": torch.int32}, "expected a floating-point tensor"),
    ],
)
def test_bad_merges_are_refused_and_change_nothing(
    pair: tuple[TorchSampler, TorchSampler],
    lora_dirs: dict[str, Path],
    chat_prompts: list[Trajectory],
    change: dict[str, Any],
    match: str,
) -> None:
    from safetensors.torch import load_file

    _, merging = pair
    weights = state(merging)
    config = {**json.loads((lora_dirs["a"] / "adapter_config.json").read_text()), **change.get("config", {})}
    tensors = dict(load_file(str(lora_dirs["a"] / "adapter_model.safetensors")))
    if "extra" in change:
        tensors[change["extra"]] = torch.ones(128)
    if change.get("drop_b"):
        tensors.pop(next(k for k in tensors if "lora_B" in k))
    if "scale" in change:
        tensors = {k: v * change["scale"] for k, v in tensors.items()}
    if change.get("rank0"):
        tensors = {k: v[:0] if "lora_A" in k else v[:, :0] for k, v in tensors.items()}
    if "dtype" in change:
        tensors = {k: v.to(change["dtype"]) for k, v in tensors.items()}
    with pytest.raises(AdapterError, match=match):
        merging.add_adapter_to_model("bad", config, weights=tensors, merge=change.get("merge", True))
    assert "bad" not in merging.adapters
    after = state(merging)
    assert all(torch.equal(after[k], weights[k]) for k in weights)


@pytest.mark.parametrize("merge", [True, False])
def test_a_folder_adapter_with_nan_is_refused_both_ways(
    pair: tuple[TorchSampler, TorchSampler], lora_dirs: dict[str, Path], tmp_path: Path, merge: bool
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    _, merging = pair
    weights = state(merging)
    folder = tmp_path / "nan"
    shutil.copytree(lora_dirs["a"], folder)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    next(v for k, v in tensors.items() if "lora_B" in k).view(-1)[0] = float("nan")
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"non-finite|NaN"):
        merging.add_adapter_to_model("bad", str(folder), merge=merge)
    assert "bad" not in merging.adapters
    after = state(merging)
    assert all(torch.equal(after[k], weights[k]) for k in weights)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_a_merge_that_fails_part_way_is_undone(
    pair: tuple[TorchSampler, TorchSampler],
    lora_dirs: dict[str, Path],
    chat_prompts: list[Trajectory],
    error: type[BaseException],
) -> None:
    """A merge whose copy into the weights fails after some layers were merged (Ctrl-C, a failing device copy)
    puts back what was there: the base model, or the adapter merged before, to the bit."""
    from safetensors.torch import load_file

    from twinkle_core.testing.faults import failing_when_copied

    _, merging = pair
    config = json.loads((lora_dirs["b"] / "adapter_config.json").read_text())
    tensors = dict(load_file(str(lora_dirs["b"] / "adapter_model.safetensors")))
    last = [k for k in tensors if "lora_B" in k][-1]
    failing = {**tensors, last: failing_when_copied(tensors[last], error("interrupted while merging"))}
    for merged_before in (None, "a"):
        if merged_before is not None:
            merging.add_adapter_to_model("policy", lora_dirs[merged_before], merge=True)
        adapter = "" if merged_before is None else "policy"
        weights, before, version = state(merging), run(merging, chat_prompts, adapter), merging.weights_version
        with pytest.raises(error, match="interrupted while merging"):
            merging.add_adapter_to_model("policy", config, weights=failing, merge=True)
        after = state(merging)
        changed = sorted(k for k in weights if not torch.equal(after[k], weights[k]))
        assert not changed, f"left part-merged: {changed[:3]}"
        assert merging.weights_version == version
        assert run(merging, chat_prompts, adapter) == before
    # and the engine merges the same adapter whole afterwards
    merging.add_adapter_to_model("policy", config, weights=tensors, merge=True)
    assert_differ(run(merging, chat_prompts, "policy"), before)


class _CopiesFail(torch.overrides.TorchFunctionMode):
    """Copies into tensors fail from the ``first``-th on, ``times`` times: a fault, then another while undoing it."""

    def __init__(self, first: int, errors: list[BaseException]) -> None:
        super().__init__()
        self.count, self.first, self.errors = 0, first, errors

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.Tensor.copy_:
            self.count += 1
            if self.count >= self.first and self.errors:
                raise self.errors.pop(0)
        return func(*args, **(kwargs or {}))


def test_a_merge_whose_undo_fails_too_refuses_to_sample_until_the_weights_are_pushed(
    pair: tuple[TorchSampler, TorchSampler], lora_dirs: dict[str, Path], chat_prompts: list[Trajectory]
) -> None:
    """A merge that fails part-way, and whose undo is interrupted too, leaves a mix of merged and base
    weights that no version names: sampling is refused, naming them, until update_weights pushes them."""
    from twinkle_core.errors import IncompleteUpdateError

    _, merging = pair
    weights, before, version = state(merging), run(merging, chat_prompts), merging.weights_version
    errors: list[BaseException] = [RuntimeError("copy failed"), KeyboardInterrupt()]
    undone = pytest.raises(IncompleteUpdateError, match=r"could not be undone \(KeyboardInterrupt")
    with undone as caught, _CopiesFail(3, errors):
        merging.add_adapter_to_model("policy", lora_dirs["a"], merge=True)
    assert not errors, "both faults were hit"
    in_doubt = caught.value.tensors
    assert in_doubt and all(name in weights for name in in_doubt)
    changed = [k for k in weights if not torch.equal(merging.model.state_dict()[k], weights[k])]
    assert changed and set(changed) <= set(in_doubt), "the first copies merged, and the undo did not run"
    assert "policy" not in merging.adapters and merging.weights_version == version
    with pytest.raises(IncompleteUpdateError, match=r"add_adapter_to_model\('policy'\).*pushes them again"):
        merging.sample(chat_prompts, GREEDY)
    # pushing the named tensors back settles it: the base model again, to the bit
    merging.update_weights({name: weights[name] for name in in_doubt})
    assert run(merging, chat_prompts) == before
    merging.add_adapter_to_model("policy", lora_dirs["a"], merge=True)
    assert_differ(run(merging, chat_prompts, "policy"), before)
