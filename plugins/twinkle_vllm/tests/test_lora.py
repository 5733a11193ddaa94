"""LoRA adapters on vLLMSampler: folders and in-memory tensors, the registry, concurrency.

The shared policy suite runs first on the module's engine (it leaves no adapter behind).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from twinkle_core.data_format import InputFeature, SamplingParams, Trajectory
from twinkle_core.errors import AdapterError, UnknownAdapterError, UnsupportedFeatureError
from twinkle_core.testing.policy import PolicyContractTests, checkpoint_weights

from .conftest import LORA_TARGETS, hf_logprobs, make_peft_adapter, make_sampler

PROMPTS = [
    Trajectory(messages=[{"role": "user", "content": "What is the capital of France?"}]),
    Trajectory(messages=[{"role": "user", "content": "Count to five."}]),
    Trajectory(messages=[{"role": "user", "content": "Tell me a short story about a cat."}]),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def sampler(tiny_model: Path) -> Iterator[Any]:
    with make_sampler(tiny_model, enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=3) as s:
        yield s


def tokens(sampler: Any, adapter: str = "", prompts: list[Trajectory] = PROMPTS) -> list[list[int]]:
    return [r.sequences[0].tokens for r in sampler.sample(prompts, GREEDY, adapter_name=adapter)]


def adapter_tensors(folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    return config, load_file(str(folder / "adapter_model.safetensors"))


class TestVLLMPolicy(PolicyContractTests):
    """Weight updates and adapters reach vLLM's samples, on the module's engine."""

    adapter_options = ({"merge": True},)
    fused_weights = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

    @pytest.fixture
    def sampler(self, sampler: Any) -> Any:
        return sampler

    @pytest.fixture(scope="class")
    @classmethod
    def base_weights(cls, tiny_model: Path) -> Mapping[str, Any]:
        return checkpoint_weights(tiny_model)


@pytest.fixture
def clean(sampler: Any) -> Iterator[Any]:
    yield sampler
    for name in list(sampler.adapters):
        sampler.remove_adapter(name)


def test_prompt_logprobs_on_an_engine_with_lora_match_transformers(
    clean: Any, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    # vLLM 0.32's CPU build killed the engine on a prompt_logprobs call of several prompts once LoRA
    # was enabled (its LoRA logits op got one index per request for one request's prompt rows); twinkle
    # skips that op while no adapter has lm_head LoRA. Scoring works for the base model and an adapter.
    sampler = clean
    sampler.add_adapter_to_model("a", adapters["a"])
    prompts = [InputFeature(input_ids=sampler.encode(p).input_ids) for p in PROMPTS]
    score = SamplingParams(max_tokens=0, prompt_logprobs=0, logprobs_mode="raw")
    for adapter, folder in (("", None), ("a", adapters["a"])):
        for prompt, out in zip(prompts, sampler.sample(prompts, score, adapter_name=adapter)):
            ids, got = prompt.input_ids, out.prompt_logprobs
            want = hf_logprobs(tiny_model, ids[:1], ids[1:], adapter=folder)
            assert got is not None and got[0] is None and len(got) == len(ids)
            assert max(abs(a - b) for a, b in zip(got[1:], want)) < 1e-3, adapter
    assert sampler.sample(PROMPTS[0], GREEDY, adapter_name="a")[0].sequences[0].tokens  # the engine lives on


def test_prompt_logprobs_under_an_lm_head_adapter_are_refused_and_the_engine_lives(
    clean: Any, tiny_model: Path, tmp_path: Path
) -> None:
    # With an lm_head LoRA loaded, vLLM 0.32's CPU build runs its LoRA logits op on prompt rows and
    # the worker dies (see the test above): such calls are refused before they reach the engine.
    sampler = clean
    folder = make_peft_adapter(tiny_model, tmp_path / "head", seed=5, targets=[*LORA_TARGETS, "lm_head"])
    sampler.add_adapter_to_model("head", folder)
    prompts = [InputFeature(input_ids=sampler.encode(p).input_ids) for p in PROMPTS]
    score = SamplingParams(max_tokens=0, prompt_logprobs=0)
    # Raw log-probs of a completion are computed by scoring prompt + completion as a prompt: refused too.
    raw = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0, logprobs_mode="raw")
    for adapter in ("", "head"):
        with pytest.raises(UnsupportedFeatureError, match=r"prompt_logprobs .*\['head'\] with lm_head LoRA"):
            sampler.sample(prompts, score, adapter_name=adapter)
        with pytest.raises(UnsupportedFeatureError, match=r"logprobs_mode='raw' .*\['head'\] with lm_head LoRA"):
            sampler.sample(prompts, raw, adapter_name=adapter)
    assert sampler.sample(PROMPTS[0], GREEDY, adapter_name="head")[0].sequences[0].tokens  # it still serves
    processed = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
    assert len(sampler.sample(PROMPTS[0], processed, adapter_name="head")[0].sequences[0].logprobs) == 3
    sampler.remove_adapter("head")
    assert all(r.prompt_logprobs is not None for r in sampler.sample(prompts, score))  # back once it is gone
    assert all(len(r.sequences[0].logprobs) == 3 for r in sampler.sample(prompts, raw))


def test_folder_adapter_matches_transformers_and_peft(clean: Any, tiny_model: Path, adapters: dict[str, Path]) -> None:
    sampler = clean
    # On CPU the workers serve LoRA with twinkle's per-adapter ops (vLLM's gather per token is far slower).
    workers = sampler.engine._process.workers
    assert all(w["cpu_lora_ops"] == ("grouped" if w["device"] == "cpu" else "") for w in workers)
    base = tokens(sampler)
    version = sampler.add_adapter_to_model("a", adapters["a"])
    assert version == sampler.weights_version
    out = sampler.sample(PROMPTS[0], GREEDY, adapter_name="a")[0]
    seq = out.sequences[0]
    assert seq.adapter_name == "a" and seq.weights_version == version
    assert tokens(sampler, "a") != base, "a random adapter must change greedy outputs"
    # vLLM's LoRA kernels agree with PEFT on the log-probs of what vLLM generated.
    reference = hf_logprobs(tiny_model, out.prompt_token_ids, seq.tokens, adapter=adapters["a"])
    assert seq.logprobs == pytest.approx(reference, abs=1e-3)
    # the base model is untouched
    assert tokens(sampler) == base


def test_in_memory_adapter_equals_folder(clean: Any, adapters: dict[str, Path]) -> None:
    sampler = clean
    sampler.add_adapter_to_model("folder", adapters["a"])
    config, weights = adapter_tensors(adapters["a"])
    sampler.add_adapter_to_model("memory", config, weights=weights)
    assert sampler.adapters["memory"].source == "<memory>"
    from_folder = sampler.sample(PROMPTS, GREEDY, adapter_name="folder")
    from_memory = sampler.sample(PROMPTS, GREEDY, adapter_name="memory")
    for a, b in zip(from_folder, from_memory):
        assert a.sequences[0].tokens == b.sequences[0].tokens
        assert a.sequences[0].logprobs == pytest.approx(b.sequences[0].logprobs, abs=1e-5)


def test_in_memory_adapter_from_a_live_peft_model(clean: Any, tiny_model: Path, adapters: dict[str, Path]) -> None:
    """The names of ``PeftModel.state_dict()`` (with the adapter's own name) and a ``LoraConfig`` work."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sampler = clean
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), adapters["b"]
    )
    weights = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert any(".default." in k for k in weights)
    sampler.add_adapter_to_model("live", model.peft_config["default"], weights=weights)
    sampler.add_adapter_to_model("b", adapters["b"])
    assert tokens(sampler, "live") == tokens(sampler, "b")


def test_concurrent_adapters_never_mix(clean: Any, adapters: dict[str, Path]) -> None:
    sampler = clean
    sampler.add_adapter_to_model("a", adapters["a"])
    sampler.add_adapter_to_model("b", adapters["b"])
    expected = {name: tokens(sampler, name) for name in ("", "a", "b")}
    assert len({json.dumps(v) for v in expected.values()}) == 3
    errors: list[BaseException] = []
    results: dict[tuple[str, int], list[list[int]]] = {}

    def worker(name: str, i: int) -> None:
        try:
            results[(name, i)] = tokens(sampler, name)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(name, i)) for i in range(3) for name in ("", "a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for (name, _), got in results.items():
        assert got == expected[name], f"adapter {name!r} served the wrong weights"


def test_replace_in_place_serves_the_new_weights(clean: Any, adapters: dict[str, Path]) -> None:
    sampler = clean
    sampler.add_adapter_to_model("b", adapters["b"])
    want_b = tokens(sampler, "b")
    sampler.add_adapter_to_model("x", adapters["a"])
    want_a = tokens(sampler, "x")
    adapter_id = sampler.adapters["x"].adapter_id
    v1 = sampler.adapters["x"].version
    # same name, other weights (in memory this time): the new ones are served, no stale copy
    config, weights = adapter_tensors(adapters["b"])
    v2 = sampler.add_adapter_to_model("x", config, weights=weights)
    assert v2 > v1 and sampler.adapters["x"].adapter_id == adapter_id
    assert tokens(sampler, "x") == want_b
    seq = sampler.sample(PROMPTS[0], GREEDY, adapter_name="x")[0].sequences[0]
    assert seq.weights_version == v2
    # and back again, from the folder
    sampler.add_adapter_to_model("x", adapters["a"])
    assert tokens(sampler, "x") == want_a


def test_remove_adapter(clean: Any, adapters: dict[str, Path]) -> None:
    sampler = clean
    base = tokens(sampler)
    sampler.add_adapter_to_model("a", adapters["a"])
    sampler.add_adapter_to_model("b", adapters["b"])
    want_b = tokens(sampler, "b")
    sampler.remove_adapter("a")
    assert "a" not in sampler.adapters
    with pytest.raises(UnknownAdapterError, match="'a'"):
        sampler.sample(PROMPTS[0], GREEDY, adapter_name="a")
    assert tokens(sampler, "b") == want_b
    assert tokens(sampler) == base


def test_capacity_names_the_engine_option(clean: Any, adapters: dict[str, Path]) -> None:
    sampler = clean
    for name, folder in (("a", adapters["a"]), ("b", adapters["b"]), ("c", adapters["a"])):
        sampler.add_adapter_to_model(name, folder)
    with pytest.raises(AdapterError, match="max_cpu_loras"):
        sampler.add_adapter_to_model("d", adapters["b"])
    # replacing one of the loaded adapters still works at full capacity
    assert tokens(sampler, "c") == tokens(sampler, "a")
    sampler.add_adapter_to_model("c", adapters["b"])
    assert tokens(sampler, "c") == tokens(sampler, "b")


def test_bad_adapters_are_typed_errors(clean: Any, tiny_model: Path, adapters: dict[str, Path], tmp_path: Path) -> None:
    sampler = clean
    with pytest.raises(AdapterError, match=r"adapter_config\.json"):
        sampler.add_adapter_to_model("missing", tmp_path / "nowhere")
    big = make_peft_adapter(tiny_model, tmp_path / "big", seed=3, rank=16)
    with pytest.raises(AdapterError, match="max_lora_rank"):
        sampler.add_adapter_to_model("big", big)
    config, weights = adapter_tensors(adapters["a"])
    with pytest.raises(AdapterError, match=r"target_modules|'r'"):
        sampler.add_adapter_to_model("noconfig", {"lora_alpha": 8}, weights=weights)
    bad_weights = {k.replace("q_proj", "nonexistent_proj"): v for k, v in weights.items()}
    with pytest.raises(AdapterError, match="nonexistent_proj"):
        sampler.add_adapter_to_model("badnames", config, weights=bad_weights)
    assert not sampler.adapters
    # nothing is broken
    sampler.add_adapter_to_model("a", adapters["a"])
    assert len(tokens(sampler, "a")) == len(PROMPTS)


def test_per_module_ranks_and_alphas_load_and_merge(clean: Any, tiny_model: Path, tmp_path: Path) -> None:
    """PEFT's rank_pattern / alpha_pattern: the shape check reads each module's own rank (it refused these before)."""
    folder = make_peft_adapter(
        tiny_model, tmp_path / "patterns", seed=3, rank=4, rank_pattern={"v_proj": 2}, alpha_pattern={"down_proj": 1}
    )
    sampler = clean
    base = tokens(sampler)
    sampler.add_adapter_to_model("p", folder)
    out = sampler.sample(PROMPTS[0], GREEDY, adapter_name="p")[0]
    seq = out.sequences[0]
    assert tokens(sampler, "p") != base
    reference = hf_logprobs(tiny_model, out.prompt_token_ids, seq.tokens, adapter=folder)
    assert seq.logprobs == pytest.approx(reference, abs=1e-3)
    unmerged = tokens(sampler, "p")
    sampler.add_adapter_to_model("p", folder, merge=True)
    assert tokens(sampler, "p") == unmerged
    sampler.remove_adapter("p")
    assert tokens(sampler) == base
