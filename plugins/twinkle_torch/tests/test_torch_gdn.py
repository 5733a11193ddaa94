"""The Gated DeltaNet decode step twinkle runs (:mod:`twinkle_torch.gdn`): transformers' recurrence, reordered.

Held to ``transformers``' own ``torch_recurrent_gated_delta_rule`` on random inputs, state included, to float32
rounding (the reordered sums differ in the last bits); a wrong decay, a missed normalisation or the output read
from the wrong state moves them by orders of magnitude more. The engine-level checks (every sampled log-prob
equal to the full forward's) are in ``test_torch_hybrid.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from twinkle_torch.gdn import decode_kernels, modeling_modules, recurrent_gated_delta_rule

_OWN = modeling_qwen3_5.torch_recurrent_gated_delta_rule


def _inputs(batch: int, tokens: int, heads: int, dim: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "query": torch.randn(batch, tokens, heads, dim, generator=gen).to(torch.bfloat16),
        "key": torch.randn(batch, tokens, heads, dim, generator=gen).to(torch.bfloat16),
        "value": torch.randn(batch, tokens, heads, dim, generator=gen).to(torch.bfloat16),
        "g": -torch.rand(batch, tokens, heads, generator=gen),
        "beta": torch.rand(batch, tokens, heads, generator=gen).to(torch.bfloat16),
    }


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("start", ["zeros", "a state"])
@pytest.mark.parametrize("normalise", [True, False])
def test_it_is_transformers_recurrence(tokens: int, start: str, normalise: bool) -> None:
    inputs = _inputs(3, tokens, 4, 64, seed=tokens)
    state = None if start == "zeros" else torch.randn(3, 4, 64, 64, generator=torch.Generator().manual_seed(7))
    kept = None if state is None else state.clone()
    options = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=normalise)
    want_out, want_state = _OWN(**inputs, **options)
    got_out, got_state = recurrent_gated_delta_rule(**inputs, **options)
    assert got_out.dtype == want_out.dtype == torch.bfloat16 and got_state.dtype == torch.float32
    scale = float(want_state.abs().max())
    assert float((got_state - want_state).abs().max()) < 1e-5 * scale
    # the outputs are rounded to bfloat16 by both: within one unit of its precision at their size
    assert float((got_out.float() - want_out.float()).abs().max()) <= 2**-7 * float(want_out.float().abs().max())
    if kept is not None:
        assert torch.equal(state, kept)  # the caller's state (the cache's) is read, never written


def test_it_stands_in_only_while_a_step_runs_and_threads_share_it() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from twinkle_core.testing import build_tiny_model

    hybrid = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(build_tiny_model("qwen3_5")))
    names = modeling_modules(hybrid)
    assert names == ["transformers.models.qwen3_5.modeling_qwen3_5"]
    assert modeling_modules(AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=1, hidden_size=64))) == []
    inside, release = threading.Event(), threading.Event()

    def step() -> None:
        with decode_kernels(names):
            inside.set()
            release.wait(10)

    other = threading.Thread(target=step)
    other.start()
    inside.wait(10)
    with decode_kernels(names):
        assert modeling_qwen3_5.torch_recurrent_gated_delta_rule is recurrent_gated_delta_rule
    assert modeling_qwen3_5.torch_recurrent_gated_delta_rule is recurrent_gated_delta_rule  # the other step runs on
    release.set()
    other.join(10)
    assert modeling_qwen3_5.torch_recurrent_gated_delta_rule is _OWN
