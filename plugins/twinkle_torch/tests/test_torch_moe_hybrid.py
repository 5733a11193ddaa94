"""The MoE hybrids on the torch engine: the tiny Qwen3.5-MoE and Qwen3-Next.

Both are the tiny Qwen3.5's Gated DeltaNet and attention layers with a
mixture of experts (four routed, top two, and a shared expert) in place of
every MLP; Qwen3-Next fuses the GDN input projections. The state layer and
the decode loop are :mod:`test_torch_hybrid`'s, checked there at length on
the dense model; here each family is held, once, to what a trainer sees:
``transformers``' own float32 full forward of the same model (the same
float32 tolerance, 1e-4 nats), with its routes, its adapters and new
weights pushed the way a trainer pushes them (``transformers`` 5 holds the
routed experts fused as 3-D tensors, a checkpoint one tensor per expert).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# the modules, not their classes: a class imported here would be collected twice
import test_torch_contract as torch_contract
import test_torch_hybrid as torch_hybrid
import torch
from test_torch_architectures import eager, prompts
from test_torch_hybrid import _FLOAT32_NOISE
from test_torch_routes import assert_routes_are_own
from torch_helpers import forward_gap, make_lora

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.testing import build_tiny_model
from twinkle_core.testing.policy import checkpoint_weights
from twinkle_core.testing.tiny_model import perturbed_tiny_model
from twinkle_torch import TorchSampler

#: The GDN projections of each family (Qwen3-Next fuses them), plus attention and the shared expert.
LORA_TARGETS = {
    "qwen3_5_moe": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "gate_proj"],
    "qwen3_next": ["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}


@pytest.fixture(scope="module", params=sorted(LORA_TARGETS))
def arch(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def folder(arch: str) -> Path:
    return build_tiny_model(arch)


@pytest.fixture(scope="module")
def sampler(folder: Path) -> Iterator[TorchSampler]:
    with TorchSampler(folder, device="cpu") as s:
        yield s


def test_greedy_tokens_logprobs_and_routes_are_the_full_forwards(
    sampler: TorchSampler, folder: Path, chat_prompts: list[Trajectory]
) -> None:
    """Prompts of many lengths, left-padded in one prefill shared by two samples each, with their routes."""
    params = SamplingParams(
        temperature=0.0, max_tokens=16, logprobs=0, prompt_logprobs=0, num_samples=2, return_routed_experts=True
    )
    results = sampler.sample(chat_prompts[:4], params)
    reference = eager(folder)
    worst, compared, greedy = forward_gap(results, reference)
    assert compared > 100
    assert greedy, "a greedy token is not the full forward's argmax"
    assert worst < _FLOAT32_NOISE, f"a log-prob is {worst:.2e} nats from the full forward"
    assert "Paris" in (results[0].sequences[0].text or "")
    assert assert_routes_are_own(results, reference) > 0
    routes = results[0].sequences[0].routed_experts
    assert routes is not None and routes.shape[1:] == (4, 2)  # every layer is MoE, top two


def test_an_adapter_on_the_delta_net_and_the_experts_mlp_is_served(arch: str, folder: Path, tmp_path: Path) -> None:
    from peft import PeftModel

    adapter = make_lora(folder, tmp_path / "lora", seed=1, targets=LORA_TARGETS[arch])
    with_adapter = PeftModel.from_pretrained(eager(folder), str(adapter)).eval()
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=0, num_samples=2, seed=5)
    with TorchSampler(folder, device="cpu") as sampler:
        sampler.add_adapter_to_model("a", str(adapter))
        gap = forward_gap(sampler.sample(prompts(), params, adapter_name="a"), with_adapter)[0]
    assert gap < _FLOAT32_NOISE, gap
    ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
    with torch.no_grad():
        moved = (eager(folder)(ids).logits - with_adapter(ids).logits).abs().max()
    assert moved > 0.1  # the adapter changes the model: serving the base would fail above


def test_a_trainers_fused_experts_and_a_checkpoints_per_expert_tensors_both_update(
    arch: str, folder: Path, sampler: TorchSampler
) -> None:
    """The trainer's ``state_dict`` (3-D experts) and the saved checkpoint (one tensor per expert): each the model."""
    perturbed = perturbed_tiny_model(arch)
    trainer: Any = eager(perturbed)
    fused = trainer.state_dict()
    assert any(name.endswith("mlp.experts.gate_up_proj") and t.dim() == 3 for name, t in fused.items())
    per_expert = checkpoint_weights(perturbed)
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in per_expert
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=0, num_samples=2, seed=3)
    base = eager(folder)
    gaps = {}
    try:
        sampler.update_weights(fused)
        gaps["fused"] = forward_gap(sampler.sample(prompts(), params), trainer)[0]
        sampler.update_weights(checkpoint_weights(folder))  # back to the base, one expert at a time
        gaps["base"] = forward_gap(sampler.sample(prompts(), params), base)[0]
        sampler.update_weights(per_expert)
        gaps["per expert"] = forward_gap(sampler.sample(prompts(), params), trainer)[0]
    finally:
        sampler.update_weights(base.state_dict())
    assert max(gaps.values()) < _FLOAT32_NOISE, gaps
    ids = torch.tensor([[5, 17, 99, 3, 250, 41]])
    with torch.no_grad():
        assert (base(ids).logits - trainer(ids).logits).abs().max() > 0.01  # the update is visible


class TestQwen3NextPolicy(torch_contract.TestTorchSamplerPolicy):
    """The policy suite on Qwen3-Next, the GDN family furthest from the dense Qwen3.5 (fused projections, MoE).

    Qwen3.5-MoE is Qwen3.5's mixer (the suites run on it in test_torch_hybrid) with this MoE: nothing new for it.
    """

    logit_scale_weight = torch_hybrid.TestHybridPolicy.logit_scale_weight  # its RMSNorm multiplies by (1 + weight)
    # the same threshold, on the same grounds: its GDN layers are the trained Qwen3.5's, carried over and kept
    # as they were while the experts trained (tiny_moe.warm_start), so its A_log and dt_bias move log-probs alike
    policy_min_change = torch_hybrid.TestHybridPolicy.policy_min_change
    # the fused GDN projections and attention: PEFT refuses gate_proj alone (it maps onto the experts' fused
    # gate_up_proj); LoRA on the shared expert is test_an_adapter_on_the_delta_net_and_the_experts_mlp_is_served's
    lora_targets = ("in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj")

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_llama(cls) -> Path:
        return build_tiny_model("qwen3_next")
