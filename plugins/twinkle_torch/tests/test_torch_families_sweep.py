"""Every causal-LM family ``transformers`` ships: the torch engine samples its own log-probs, or refuses it at load.

``test_torch_architectures`` checks chosen families closely. This sweep
holds the rule for all the others, including families added by a newer
``transformers``: each is built as a random tiny model from a generic
config, with the few fields its own forward needs beside it declared in
``twinkle_core.testing.tiny_families.OVERRIDES`` (a hybrid's layer types, a
latent attention's heads, an encoder-decoder's decoder sizes...), and
sampled. A composite (a language model with vision or audio towers) is built
as its checkpoint is, with its text config sized like its text family and
tiny towers, and sampled through what ``AutoModelForCausalLM`` loads of it:
its language model, or the whole model where the mapping names that. A
family that no longer builds, or grows past a tiny model, fails here: the
table needs an entry, not a skip. Only families with no language model of
their own (``OUTSIDE``) are skipped. The engine must either give every
sampled and prompt log-prob of a plain eager forward of the same model, or
refuse the model at construction with a ``ConfigError`` that says why (a
recurrent state, not causal, padding or cache ignored).
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
from test_torch_architectures import eager, gap, prompts
from test_torch_routes import assert_routes_are_own

from twinkle_core.data_format import SamplingParams
from twinkle_core.errors import ConfigError
from twinkle_core.rl import find_routers
from twinkle_core.testing.tiny_families import (
    MAX_PARAMETERS,
    OUTSIDE,
    families,
    family_config,
    language_model,
)
from twinkle_core.testing.tiny_random import save_random_model
from twinkle_torch import TorchSampler
from twinkle_torch.loading import brief

_TOLERANCE = 0.05

#: What a refusal says (twinkle_torch.engine's load checks).
_REASONS = ("recurrent state", "not a causal language model", "left padding", "KV cache")

PARAMS = SamplingParams(
    temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0, num_samples=2, seed=3
)


def _build(model_type: str, out: Path) -> Any:
    """The random tiny model of ``model_type`` in ``out`` and its eager reference; fails if it cannot be built."""
    if model_type in OUTSIDE:
        pytest.skip(f"{model_type}: {OUTSIDE[model_type]}")
    try:
        config, model = language_model(family_config(model_type))
        size = sum(p.numel() for p in model.parameters())
    except Exception as exc:  # the config does not fit this family
        pytest.fail(f"{model_type}: not buildable from its tiny config: {type(exc).__name__}: {brief(exc)}")
    assert size <= MAX_PARAMETERS, f"{model_type}: {size:,} parameters from its tiny config, not a tiny model"
    save_random_model(config, out)
    if config.get_text_config() is not config:  # a composite checkpoint's config, over the language model's own
        config.save_pretrained(out)
    reference = eager(out)
    with torch.no_grad():  # its own forward runs on the tiny config (else the override table is wrong)
        reference(torch.tensor([[1, 2, 3, 4, 5, 6]]))
    return reference


# "onednn-packed" runs each plain linear layer on a copy of its weight: every family must still read as itself
@pytest.mark.parametrize("linear_kernel", ["auto", "onednn-packed"])
@pytest.mark.parametrize("model_type", families())
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
