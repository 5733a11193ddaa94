"""A Mamba-2 hybrid on the torch engine: Granite 4.0 hybrid (``granitemoehybrid``), Mamba-2 layers beside attention.

Each Mamba-2 layer keeps, per row, a convolution state and an SSM state in a
``transformers`` ``LinearAttentionLayer``, as a Gated DeltaNet layer does, so
the engine's :class:`~twinkle_torch.state.StateLayer` carries it through
everything the decode loop does to rows (:mod:`test_torch_hybrid` holds the
same checks on Qwen3.5; the ones that do not depend on the family are
collected again here). The model is random and tiny (three Mamba-2 layers and
one attention layer, hidden size 64), built from its config with a fixed
seed; on CPU ``transformers`` runs its pure-PyTorch Mamba-2 kernels. What the
engine samples is held to ``transformers``' own full forward over the same
tokens, in float32, within the same 1e-4 nats as the Qwen3.5 tests
(measured here up to about 3e-5: the prefill's chunked scan and the decode
steps' recurrence sum in another order than the full forward's scan), while a
state carried to the wrong row or folded twice moves log-probs by whole nats.

The policy suite runs here too (updates, and LoRA on the Mamba-2 mixer's
``in_proj`` / ``out_proj`` and on attention, plain and merged, each against
the weights merged by hand); the contract and async suites pass on this
model too but are not run here: their cost (docs/hybrid-models.md).

Families the engine still cannot carry are refused at load, each with the
reason: Falcon-H1 (a state and keys and values in one layer), Nemotron-H (its
Mamba-2 fields spelled otherwise: not known here, and ``transformers``' own
cached decode of it drifts from its full forward), and a Granite whose
Mamba-2 input projection has a bias (left padding would not be exact).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# the modules, not their classes: a class imported here would be collected twice
import test_torch_contract as torch_contract
import torch
from test_torch_architectures import eager, prompts
from test_torch_batching import fresh_stats
from test_torch_hybrid import (
    test_a_large_batch_prefilled_in_chunks_equals_its_solo_results,
    test_a_row_that_joins_a_running_batch_gets_its_solo_result,
)
from torch_helpers import forward_gap, state_bytes_per_row

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.errors import ConfigError
from twinkle_core.testing.tiny_random import TINY_GRANITE_HYBRID, TINY_RANDOM_BASE, save_random_model
from twinkle_torch import TorchSampler
from twinkle_torch.state import kv_bytes_per_token, row_state_bytes

__all__ = [  # the checks that do not depend on the family, collected again on the Mamba-2 hybrid
    "test_a_large_batch_prefilled_in_chunks_equals_its_solo_results",
    "test_a_row_that_joins_a_running_batch_gets_its_solo_result",
]

_FLOAT32_NOISE = 1e-4

_SMALL = TINY_RANDOM_BASE
#: Granite 4.0 hybrid, tiny: 4 Mamba-2 heads of 32, state size 16, one group, kernel 4; scan chunks
#: of 16 tokens, so prompts span several chunks and chunk boundaries fall inside them.
_GRANITE = TINY_GRANITE_HYBRID


def _model(out: Path, model_type: str, **config: Any) -> Path:
    from transformers import AutoConfig

    save_random_model(AutoConfig.for_model(model_type, **config), out)
    return out


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from safetensors.torch import load_file, save_file

    path = _model(tmp_path_factory.mktemp("granite"), "granitemoehybrid", **_GRANITE)
    # transformers starts the convolutions' biases at zero, as a trained model's are not, and a zero bias would
    # stay zero under the policy suite's nudges (each tensor scaled by 1 + noise): random, like the other weights
    weights = load_file(str(path / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    for name in [n for n, t in weights.items() if n.endswith("conv1d.bias") and not t.any()]:
        weights[name] = 0.3 * torch.randn(weights[name].shape, generator=gen)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def sampler(granite: Path) -> Iterator[TorchSampler]:
    with TorchSampler(granite, device="cpu") as s:
        yield s


def test_the_cache_and_the_budget_carry_each_mamba_layers_state(sampler: TorchSampler, granite: Path) -> None:
    """One state layer per Mamba-2 layer (none holds a state and keys together), its size what a row holds.

    The budget charges each row that size in KV tokens (how the admission
    uses the charge is the hybrid tests' ``test_the_batch_budget_counts_each_rows_state``).
    """
    from transformers import AutoModelForCausalLM

    from twinkle_torch.cache import make_cache

    decoder = sampler.engine._decoder
    config = decoder.model.config
    kinds = [type(layer).__name__ for layer in make_cache(config, 8).layers]
    assert kinds == ["StateLayer", "StateLayer", "PreallocatedLayer", "StateLayer"]
    # 3 Mamba-2 layers: conv (4 x 32 + 2 x 16) x 4 in the model's dtype, SSM 4 x 32 x 16 in float32
    assert row_state_bytes(config, torch.float32) == 3 * (160 * 4 * 4 + 4 * 32 * 16 * 4)
    assert row_state_bytes(config, torch.bfloat16) == 3 * (160 * 4 * 2 + 4 * 32 * 16 * 4)
    assert state_bytes_per_row(decoder.model) == row_state_bytes(config, torch.float32)
    bf16 = AutoModelForCausalLM.from_pretrained(str(granite), dtype=torch.bfloat16)
    assert state_bytes_per_row(bf16) == row_state_bytes(config, torch.bfloat16)
    # one attention layer of one KV head of 32, float32: 256 bytes a token
    assert decoder.state_tokens == -(
        -row_state_bytes(config, torch.float32) // kv_bytes_per_token(config, torch.float32)
    )
    assert decoder.state_tokens == 126


def test_greedy_and_seeded_samples_are_the_full_forwards(
    sampler: TorchSampler, chat_prompts: list[Trajectory], granite: Path
) -> None:
    """Prompts of many lengths left-padded in one prefill, each shared by its samples; then seeded sampling."""
    reference = eager(granite)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, logprobs=0, prompt_logprobs=0, num_samples=2)
    worst, compared, held = forward_gap(sampler.sample(chat_prompts[:5], greedy), reference)
    assert compared > 200
    assert held, "a greedy token is not the full forward's argmax"
    assert worst < _FLOAT32_NOISE, f"a log-prob is {worst:.2e} nats from the full forward"
    seeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=0, num_samples=2, seed=4)
    worst, compared, _ = forward_gap(sampler.sample(prompts(), seeded), reference)
    assert compared > 100 and worst < _FLOAT32_NOISE, worst


def test_samples_share_their_prompts_one_prefill(sampler: TorchSampler, chat_prompts: list[Trajectory]) -> None:
    """Four greedy samples of one prompt: one prefill, its state repeated into four rows that decode alike."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    solo = sampler.sample(chat_prompts[1], params)[0].sequences[0]
    stats = fresh_stats(sampler)
    shared = sampler.sample(chat_prompts[1], params, num_samples=4)[0].sequences
    assert stats.prefills == 1 and stats.peak_rows == 4
    for seq in shared:
        assert seq.tokens == solo.tokens
        assert seq.logprobs == pytest.approx(solo.logprobs, abs=_FLOAT32_NOISE)


def test_bamba_samples_as_itself_too(tmp_path: Path) -> None:
    """Bamba's Mamba-2 layers are Granite's (the same config fields, the same cache calls): carried alike."""
    config = dict(
        _SMALL, attn_layer_indices=[2], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16
    )
    path = _model(tmp_path, "bamba", **config)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    with TorchSampler(path, device="cpu") as bamba:
        results = bamba.sample(prompts(), params)
    worst, compared, held = forward_gap(results, eager(path))
    assert compared == 48 and held and worst < _FLOAT32_NOISE, worst


_REFUSED: dict[str, tuple[str, dict[str, Any], str]] = {
    "falcon-h1": (
        "falcon_h1",
        dict(_SMALL, head_dim=32, mamba_n_heads=4, mamba_d_head=32, mamba_d_ssm=128, mamba_d_state=16),
        "LinearAttentionAndFullAttentionLayer",
    ),
    "nemotron-h": (
        "nemotron_h",
        dict(
            _SMALL,
            head_dim=32,
            layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"],
            mamba_num_heads=4,
            mamba_head_dim=32,
            ssm_state_size=16,
            n_groups=1,
        ),
        "does not know the shape",
    ),
    "granite-proj-bias": ("granitemoehybrid", dict(_GRANITE, mamba_proj_bias=True), "mamba_proj_bias"),
}


@pytest.mark.parametrize("name", list(_REFUSED))
def test_mamba_hybrids_it_cannot_carry_are_refused_with_the_reason(name: str, tmp_path: Path) -> None:
    model_type, config, reason = _REFUSED[name]
    path = _model(tmp_path, model_type, **config)
    with pytest.raises(ConfigError, match="recurrent state") as caught:
        TorchSampler(path, device="cpu")
    assert reason in str(caught.value)


class TestMambaHybridPolicy(torch_contract.TestTorchSamplerPolicy):  # its default thresholds hold here
    """Updates and adapters really served; LoRA on the Mamba-2 mixer's projections and attention, plain and merged."""

    lora_targets = ("in_proj", "out_proj", "q_proj", "v_proj")

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_llama(cls, granite: Path) -> Path:
        return granite
