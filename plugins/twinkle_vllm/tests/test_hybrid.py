"""A hybrid linear-attention model on vLLM's CPU build: the tiny Qwen3.5, with nothing set by hand.

vLLM's CPU Gated DeltaNet kernels run bfloat16 only, so the engine resolves
the dtype to bfloat16 itself and refuses an explicit float32 before it
starts; its Qwen3.5 module imports a torchvision image processor, which
twinkle-vllm's ``vllm.general_plugins`` entry point replaces where
torchvision is missing (:mod:`twinkle_vllm._vllm_plugin`).

**Parity with the torch engine, in bfloat16**, and the shared suites
(contract, async, policy) on the module's one engine, held to tolerances
measured on this model, not picked (:mod:`hybrid_suites` says how).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.errors import ConfigError
from twinkle_core.testing import TINY_CHAT_PROMPTS
from twinkle_core.testing.parity import assert_greedy_parity
from twinkle_core.testing.policy import PolicyContractTests, random_lora, score_gap, transformers_scores
from twinkle_vllm._hybrid import hybrid_options

from . import test_async as vllm_async  # the module, not its class: a class imported here is collected twice
from .conftest import TEST_ENGINE_ARGS
from .hybrid_suites import DTYPES, ENGINE_ARGS, HybridContractSuite, HybridPolicySuite, rounding_of_bfloat16

PROMPTS = [Trajectory(messages=m) for m in TINY_CHAT_PROMPTS[:8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def tiny_qwen3_5() -> Path:
    from twinkle_core.testing import build_tiny_model

    return build_tiny_model("qwen3_5")


@pytest.fixture(scope="module")
def hybrid_model(tiny_qwen3_5: Path) -> Path:  # the module's engine (conftest's hybrid_sampler) serves it
    return tiny_qwen3_5


def _config(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return tmp_path


def test_the_cpu_dtype_of_a_hybrid_resolves_to_bfloat16_and_float32_is_refused(tiny_qwen3_5: Path) -> None:
    assert hybrid_options(tiny_qwen3_5, {}, cpu=True)["dtype"] == "bfloat16"
    assert hybrid_options(tiny_qwen3_5, {"dtype": "auto"}, cpu=True)["dtype"] == "bfloat16"
    assert "dtype" not in hybrid_options(tiny_qwen3_5, {"dtype": "bfloat16"}, cpu=True)
    assert hybrid_options(tiny_qwen3_5, {}, cpu=False) == {}  # other backends keep vLLM's choice
    with pytest.raises(ConfigError, match=r"dtype='float32'.*Qwen3_5ForCausalLM.*bfloat16 only"):
        hybrid_options(tiny_qwen3_5, {"dtype": "float32"}, cpu=True)


def test_a_plain_model_keeps_its_options(tiny_model: Path) -> None:
    assert hybrid_options(tiny_model, {"dtype": "float32"}, cpu=True) == {}


def test_the_vision_tower_of_a_checkpoint_is_skipped_unless_asked_for(tmp_path: Path) -> None:
    folder = _config(
        tmp_path,
        {
            "model_type": "qwen3_5",
            "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": {"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"]},
            "vision_config": {"depth": 2},
        },
    )
    assert hybrid_options(folder, {}, cpu=False) == {"language_model_only": True}
    assert hybrid_options(folder, {"language_model_only": False}, cpu=False) == {}


def test_prefix_caching_is_off_on_cpu_where_chunked_prefill_is(tiny_qwen3_5: Path) -> None:
    # vLLM's hybrid prefix cache needs chunked prefill, which twinkle turns off on CPU
    assert hybrid_options(tiny_qwen3_5, {}, cpu=True)["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in hybrid_options(tiny_qwen3_5, {"enable_prefix_caching": True}, cpu=True)


def test_prefix_caching_is_off_on_cpu_for_other_models_with_a_mamba_style_state(tmp_path: Path) -> None:
    # LFM2's convolution state, Falcon-H1's Mamba-2: vLLM checkpoints them per block too (bench/probe_vllm_families.py)
    folder = _config(tmp_path, {"model_type": "lfm2", "layer_types": ["conv", "full_attention"]})
    assert hybrid_options(folder, {}, cpu=True) == {"enable_prefix_caching": False}  # its dtype stays the user's
    assert hybrid_options(folder, {"enable_chunked_prefill": True}, cpu=True) == {}
    assert hybrid_options(folder, {}, cpu=False) == {}


def test_float32_is_refused_before_the_engine_starts(tiny_qwen3_5: Path) -> None:
    from twinkle_vllm.sampler import vLLMSampler

    with pytest.raises(ConfigError, match="bfloat16 only"):
        vLLMSampler(tiny_qwen3_5, engine_args=TEST_ENGINE_ARGS)


def test_it_samples_in_bfloat16_and_answers(hybrid_sampler: Any) -> None:
    assert str(hybrid_sampler.engine._facts.dtype) == "torch.bfloat16"
    out = hybrid_sampler.sample(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=16))
    assert "Paris" in (out[0].sequences[0].text or "")


@pytest.fixture(scope="module")
def greedy(hybrid_sampler: Any) -> list[Any]:
    """The engine's greedy answers to PROMPTS."""
    return list(hybrid_sampler.sample(PROMPTS, GREEDY))


@pytest.fixture(scope="module")
def parity_tolerance(greedy: list[Any], tiny_qwen3_5: Path) -> float:
    """Twice the rounding one bfloat16 computation of this model carries over the greedy tokens."""
    return 2 * rounding_of_bfloat16(tiny_qwen3_5, [(r.prompt_token_ids, r.sequences[0].tokens) for r in greedy])


def test_greedy_parity_with_the_torch_engine_in_bfloat16(
    greedy: list[Any], tiny_qwen3_5: Path, parity_tolerance: float
) -> None:
    from twinkle_torch.sampler import TorchSampler

    with TorchSampler(tiny_qwen3_5, dtype="bfloat16") as torch_sampler:
        torch_out = torch_sampler.sample(PROMPTS, GREEDY)
    assert_greedy_parity([r.sequences[0] for r in greedy], [r.sequences[0] for r in torch_out], atol=parity_tolerance)


def test_the_reference_id_in_the_checkpoints_layout_samples_the_text_model(
    greedy: list[Any], parity_tolerance: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``ms://Qwen/Qwen3.5-4B`` as Qwen3.5 ships (VL config, nested names, tower, MTP block), offline.

    vLLM runs it as ``Qwen3_5ForConditionalGeneration`` with its tower skipped, not as the
    text class: the same weights in another class may round differently, never by more
    than one bfloat16 computation's rounding twice. An update to the tower or the MTP
    block, which this engine did not load, is refused by name instead of being skipped;
    one in a trainer's ``AutoModelForCausalLM`` names (``model.layers.*``) is served.
    """
    import torch
    from safetensors.torch import load_file

    from twinkle_core.errors import WeightUpdateError
    from twinkle_core.testing.tiny_layouts import build_tiny_checkpoint_layout, modelscope_snapshot
    from twinkle_vllm.sampler import vLLMSampler

    layout = build_tiny_checkpoint_layout()
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path))
    monkeypatch.setenv("TWINKLE_OFFLINE", "1")
    modelscope_snapshot(layout, "Qwen/Qwen3.5-4B", tmp_path)
    weights = load_file(str(layout / "model.safetensors"))
    with vLLMSampler(model_id="ms://Qwen/Qwen3.5-4B", engine_args=ENGINE_ARGS) as sampler:
        got = sampler.sample(PROMPTS, GREEDY)
        for name, part in (("mtp.fc.weight", "multi-token-prediction"), ("model.visual.pos_embed.weight", "tower")):
            with pytest.raises(WeightUpdateError, match=part):
                sampler.update_weights({name: weights[name].to(torch.bfloat16)})
        first = sampler.sample(PROMPTS[:1], GREEDY)[0].sequences[0]
        assert first.tokens == got[0].sequences[0].tokens
        # a trainer's AutoModelForCausalLM names reach the nested weights this engine holds, and back
        nested = "model.language_model.layers.3.self_attn.o_proj.weight"
        sampler.update_weights({"model.layers.3.self_attn.o_proj.weight": 4 * weights[nested].to(torch.bfloat16)})
        moved = sampler.sample(PROMPTS[:1], GREEDY)[0].sequences[0]
        sampler.update_weights({nested: weights[nested].to(torch.bfloat16)})
        again = sampler.sample(PROMPTS[:1], GREEDY)[0].sequences[0]
        assert max(abs(a - b) for a, b in zip(moved.logprobs, first.logprobs)) > 0.1
        assert (again.tokens, again.logprobs) == (first.tokens, first.logprobs)
    assert_greedy_parity([r.sequences[0] for r in got], [r.sequences[0] for r in greedy], atol=parity_tolerance)


def test_a_trainers_names_reach_a_nested_checkpoint_with_its_tied_head_folded() -> None:
    """A VL checkpoint nests the language model; a trainer pushes AutoModelForCausalLM's names (twinkle_core.names)."""
    import torch

    from twinkle_core.errors import WeightUpdateError
    from twinkle_vllm._weights import WeightSpec

    nested = {
        "model.language_model.embed_tokens.weight": (8, 4),
        "model.language_model.layers.0.mlp.up_proj.weight": (6, 4),
    }
    spec = WeightSpec(nested, dict.fromkeys(nested, "bfloat16"), "bfloat16", {}, tied_embeddings=True)
    up, head = torch.zeros(6, 4, dtype=torch.bfloat16), torch.ones(8, 4, dtype=torch.bfloat16)
    sent = dict(spec.validate([("model.layers.0.mlp.up_proj.weight", up), ("lm_head.weight", head)]))
    assert sorted(sent) == sorted(nested)
    assert sent["model.language_model.embed_tokens.weight"] is head  # the tied head folded into the nested embedding
    with pytest.raises(WeightUpdateError, match=r"model\.layers\.0\.mlp\.nope"):
        spec.validate([("model.layers.0.mlp.nope.weight", up)])


#: One Gated DeltaNet projection at a time (Qwen3.5's in_proj_z with in_proj_qkv adapted by zeros: see below).
GDN_ADAPTERS = {
    "in_proj_qkv": {},
    "in_proj_z": {"zero": ("in_proj_qkv",)},
    "in_proj_b": {},
    "in_proj_a": {"scale": 0.2},  # the decay's input: at 0.05 it moves scores less than rounding does
    "out_proj": {},
}


@pytest.mark.parametrize("module", list(GDN_ADAPTERS))
def test_unmerged_lora_on_each_gdn_projection_scores_what_peft_does(
    hybrid_sampler: Any, tiny_qwen3_5: Path, hybrid_weights: Mapping[str, Any], module: str
) -> None:
    """vLLM packs the GDN projections (``in_proj_qkvz``: q, k, v, z; ``in_proj_ba``) and splits an adapter over
    their slices: one applied to the wrong slice, not at all or scaled wrong is a whole adapter's effect away
    from ``transformers`` + ``peft`` in float32. bfloat16 rounding is not: held to twice what ``peft`` itself
    carries in bfloat16 over the same tokens (two computations, each rounded). An adapter not applied would
    score the base model, its effect away from the truth give or take one rounding: the effect must exceed
    the tolerance plus that rounding, or the test could not fail.
    """
    options = GDN_ADAPTERS[module]
    zero = options.get("zero", ())
    adapter = random_lora(hybrid_weights, (module, *zero), seed=11, scale=options.get("scale", 0.05), zero=zero)
    suite = PolicyContractTests()
    prompts = [list(f.input_ids) for f in suite.policy_prompts(hybrid_sampler)]
    hybrid_sampler.add_adapter_to_model("gdn-probe", adapter[0], weights=adapter[1])
    try:
        got = suite.scores(hybrid_sampler, "gdn-probe")
    finally:
        hybrid_sampler.remove_adapter("gdn-probe")
    low, truth = (transformers_scores(tiny_qwen3_5, prompts, got, dtype=d, adapter=adapter) for d in DTYPES)
    tolerance = 2 * score_gap(low, truth)
    effect = score_gap(transformers_scores(tiny_qwen3_5, prompts, got), truth)
    assert effect > 1.5 * tolerance, f"the {module} adapter moves scores by {effect:.3f}: too little to check"
    assert score_gap(got, truth) <= tolerance, f"LoRA on {module} unmerged: {score_gap(got, truth):.3f} from peft"


def test_lora_on_in_proj_z_without_in_proj_qkv_is_refused_unmerged_and_served_merged(
    hybrid_sampler: Any, hybrid_weights: Mapping[str, Any]
) -> None:
    """vLLM 0.32 loads it and then dies at the first request that uses it (its packed-LoRA split gives the
    absent in_proj_qkv all four slices of in_proj_qkvz); twinkle refuses it at load, naming the module, and
    the engine serves on. Merged (no LoRA layers) it is served."""
    from twinkle_core.errors import UnsupportedFeatureError

    config, tensors = random_lora(hybrid_weights, ("in_proj_z",), seed=7)
    suite = PolicyContractTests()
    base, version = suite.scores(hybrid_sampler), hybrid_sampler.weights_version
    with pytest.raises(UnsupportedFeatureError, match=r"in_proj_z.*without 'in_proj_qkv'.*merge=True"):
        hybrid_sampler.add_adapter_to_model("z-only", config, weights=tensors)
    assert "z-only" not in hybrid_sampler.adapters and hybrid_sampler.weights_version == version
    assert score_gap(base, suite.scores(hybrid_sampler)) <= suite.policy_atol  # the engine serves on, unchanged
    hybrid_sampler.add_adapter_to_model("z-only", config, weights=tensors, merge=True)
    try:
        assert score_gap(base, suite.scores(hybrid_sampler, "z-only")) > suite.policy_min_change
    finally:
        hybrid_sampler.remove_adapter("z-only")


class TestHybridContract(HybridContractSuite):
    """The shared contract on vLLM's Qwen3.5."""


class TestHybridPolicy(HybridPolicySuite):
    """Weight updates and adapters reach vLLM's Qwen3.5 samples."""

    lora_targets = ("out_proj", "q_proj", "down_proj")
    # vLLM loads these together into one layer (in_proj_qkvz, in_proj_ba, qkv_proj, gate_up_proj)
    fused_weights = (
        ("in_proj_qkv", "in_proj_z"),
        ("in_proj_b", "in_proj_a"),
        ("q_proj", "k_proj", "v_proj"),
        ("gate_proj", "up_proj"),
        ("A_log", "dt_bias"),
    )


class TestHybridAsync(vllm_async.TestVllmAsync):
    """Submit, stream, abort, resume and updates in flight on vLLM's Qwen3.5: rows carrying a recurrent state.

    A continuation re-prefills its tokens (a state is never rewound). The same tokens scored in two calls
    (alone, or beside another row) are two bfloat16 computations: held to twice one's rounding over the top
    8 (``rounding_over_the_top``), as the contract suite's comparisons are.
    """

    @pytest.fixture
    def sampler(self, hybrid_sampler: Any, top_rounding: float) -> Any:
        self.async_logprob_atol = 2 * top_rounding
        return hybrid_sampler

    @pytest.fixture(scope="class")
    @classmethod
    def weights_a(cls, hybrid_weights: Mapping[str, Any], hybrid_sampler: Any) -> Iterator[Mapping[str, Any]]:
        yield hybrid_weights
        hybrid_sampler.update_weights(dict(hybrid_weights))  # the updates in flight leave weights_b served
