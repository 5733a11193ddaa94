"""Every causal-LM family ``transformers`` ships: the torch engine samples its own log-probs, or refuses it at load.

``test_torch_architectures`` checks chosen families closely. This sweep
holds the rule for all the others, including families added by a newer
``transformers``: each is built as a random tiny model from a generic
config (families whose config or forward cannot take it are skipped, as are
composite ones with vision or audio towers) and sampled. The engine must
either give every sampled and prompt log-prob of a plain eager forward of
the same model, or refuse the model at construction with a ``ConfigError``
that says why (a recurrent state, not causal, padding or cache ignored).
What it must never do is sample silently from something else, or fail
only once a call runs.

The tolerance is wider than the chosen families' (0.05 nats against 1e-3):
a few families run their layers many times over (HRM-style recurrent
depth), which multiplies float32 rounding; reading the wrong keys or
positions moves log-probs by far more (0.6 to 50 nats in the sweep that
wrote this).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_torch_architectures import eager, gap, prompts, save_random
from test_torch_routes import assert_routes_are_own

from twinkle_core.data_format import SamplingParams
from twinkle_core.errors import ConfigError
from twinkle_core.rl import find_routers
from twinkle_torch import TorchSampler

_GENERIC: dict[str, Any] = dict(
    vocab_size=768, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=512, pad_token_id=0, n_embd=128, n_layer=2, n_head=2,
    d_model=128, n_positions=512, num_layers=2, ffn_dim=256,
    # mixtures of experts: a few small ones
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, moe_topk=2, n_group=1, topk_group=1,
)  # fmt: skip

_TOLERANCE = 0.05

#: Families whose generic config still makes a big model (a byte-level model's hash tables...) are skipped.
_MAX_PARAMETERS = 40_000_000

#: What a refusal says (twinkle_torch.engine's load checks).
_REASONS = ("recurrent state", "not a causal language model", "left padding", "KV cache")

PARAMS = SamplingParams(
    temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0, num_samples=2, seed=3
)


def _families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _build(model_type: str, out: Path) -> Any:
    """The random tiny model of ``model_type`` in ``out``, and its eager reference; skips what cannot be built."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.for_model(model_type, **_GENERIC)
        if hasattr(config, "get_text_config") and config.get_text_config() is not config:
            pytest.skip(f"{model_type}: a composite model (towers beside the text model)")
        with torch.device("meta"):  # counted before anything is allocated: some configs ask for huge tables
            size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except Exception as exc:  # the generic config does not fit this family
        pytest.skip(f"{model_type}: not buildable from a generic tiny config ({type(exc).__name__})")
    if size > _MAX_PARAMETERS:
        pytest.skip(f"{model_type}: {size:,} parameters from the generic config, not a tiny model")
    try:
        save_random(config, out)
        reference = eager(out)
        with torch.no_grad():
            reference(torch.tensor([[1, 2, 3, 4, 5, 6]]))
    except Exception as exc:  # its own forward fails on the generic config
        pytest.skip(f"{model_type}: its own forward fails on a generic tiny config ({type(exc).__name__})")
    return reference


# "onednn-packed" runs each plain linear layer on a copy of its weight: every family must still read as itself
@pytest.mark.parametrize("linear_kernel", ["auto", "onednn-packed"])
@pytest.mark.parametrize("model_type", _families())
def test_each_family_is_sampled_as_itself_or_refused_at_load(
    model_type: str, linear_kernel: str, tmp_path: Path
) -> None:
    reference = _build(model_type, tmp_path / model_type)
    try:
        sampler = TorchSampler(tmp_path / model_type, device="cpu", linear_kernel=linear_kernel)
    except ConfigError as exc:  # refused: the error must say which of the engine's limits the model hits
        assert any(why in str(exc) for why in _REASONS), str(exc)
        return
    # a mixture of experts records its routes (once per family: the linear kernel does not route)
    routed = bool(find_routers(reference)) and linear_kernel == "auto"
    with sampler:
        results = sampler.sample(prompts(), PARAMS)
        routes = sampler.sample(prompts()[:2], PARAMS.replace(return_routed_experts=True)) if routed else []
    worst, compared = gap(results, reference)
    assert compared > 0
    if routed:
        assert assert_routes_are_own(routes, reference) > 0
    assert worst < _TOLERANCE, f"{model_type}: a log-prob is {worst:.3g} nats from the model's own forward"
