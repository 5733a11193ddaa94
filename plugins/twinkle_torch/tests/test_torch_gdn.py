"""The Gated DeltaNet kernels twinkle runs (:mod:`twinkle_torch.gdn`): transformers' recurrence and chunked prefill.

Held to ``transformers``' own ``torch_recurrent_gated_delta_rule`` and ``torch_chunk_gated_delta_rule`` on random
inputs, state included, to float32 rounding (the reordered sums differ in the last bits); a wrong decay, a missed
normalisation, a mis-solved block or the output read from the wrong state moves them by orders of magnitude more.
The engine-level checks (every sampled log-prob equal to the full forward's) are in ``test_torch_hybrid.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from twinkle_torch.gdn import decode_step, gdn_kernels, kernel_sites, recurrent_gated_delta_rule
from twinkle_torch.gdn_chunk import chunk_gated_delta_rule

_OWN = modeling_qwen3_5.torch_recurrent_gated_delta_rule
_OWN_CHUNK = modeling_qwen3_5.torch_chunk_gated_delta_rule


def _inputs(
    batch: int, tokens: int, heads: int, dim: int, seed: int, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "query": torch.randn(batch, tokens, heads, dim, generator=gen).to(dtype),
        "key": torch.randn(batch, tokens, heads, dim, generator=gen).to(dtype),
        "value": torch.randn(batch, tokens, heads, dim, generator=gen).to(dtype),
        "g": -torch.rand(batch, tokens, heads, generator=gen),
        "beta": torch.rand(batch, tokens, heads, generator=gen).to(dtype),
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


def test_the_engines_decode_step_updates_the_given_state_in_place() -> None:
    inputs = _inputs(3, 1, 4, 64, seed=3)
    state = torch.randn(3, 4, 64, 64, generator=torch.Generator().manual_seed(7))
    options = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    want_out, want_state = _OWN(**inputs, initial_state=state.clone(), **options)
    kept = state.clone()
    recurrent_gated_delta_rule(**inputs, initial_state=state, output_final_state=False, in_place=True)
    assert torch.equal(state, kept)  # a state not asked for back is not written
    got_out, got_state = decode_step(**inputs, initial_state=state, **options)
    assert got_state is state  # the layer's copy into its cache copies it onto itself
    assert float((state - want_state).abs().max()) < 1e-5 * float(want_state.abs().max())
    assert float((got_out.float() - want_out.float()).abs().max()) <= 2**-7 * float(want_out.float().abs().max())


# 1 token; 7 (one short chunk); 64 (exactly one); 100 (a full chunk and a part: more than one block and chunk)
@pytest.mark.parametrize(
    ("tokens", "start", "normalise", "dtype"),
    [
        (1, "zeros", True, torch.float32),
        (7, "a state", True, torch.bfloat16),
        (64, "zeros", True, torch.float32),
        (100, "zeros", True, torch.float32),
        (100, "a state", True, torch.float32),
        (100, "a state", False, torch.float32),
    ],
)
def test_it_is_transformers_chunked_prefill(tokens: int, start: str, normalise: bool, dtype: torch.dtype) -> None:
    inputs = _inputs(2, tokens, 3, 32, seed=tokens, dtype=dtype)
    inputs["g"] = inputs["g"] * 2  # decays down to e^-2 a token: a chunk spans e^-64 of them
    state = None if start == "zeros" else torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    kept = {name: x.clone() for name, x in inputs.items()} | ({} if state is None else {"state": state.clone()})
    options = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=normalise)
    want_out, want_state = _OWN_CHUNK(**inputs, **options)
    got_out, got_state = chunk_gated_delta_rule(**inputs, **options)
    assert got_out.dtype == want_out.dtype == dtype and got_out.shape == want_out.shape
    assert got_state.dtype == torch.float32 and got_state.shape == want_state.shape
    assert float((got_state - want_state).abs().max()) < 1e-5 * float(want_state.abs().max())
    # float32 outputs agree to float32 rounding; bfloat16 ones (both rounded last) within one unit of bfloat16's
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    assert float((got_out.float() - want_out.float()).abs().max()) <= tolerance * float(want_out.float().abs().max())
    assert chunk_gated_delta_rule(**inputs, initial_state=state, use_qk_l2norm_in_kernel=normalise)[1] is None
    assert all(torch.equal(x, kept[name]) for name, x in (inputs | ({} if state is None else {"state": state})).items())


def test_it_stands_in_only_while_a_step_runs_and_threads_share_it() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from twinkle_core.testing import build_tiny_model

    hybrid = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(build_tiny_model("qwen3_5")))
    sites = kernel_sites(hybrid)
    module = "transformers.models.qwen3_5.modeling_qwen3_5"
    assert sites == [(module, "torch_chunk_gated_delta_rule"), (module, "torch_recurrent_gated_delta_rule")]
    assert kernel_sites(AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=1, hidden_size=64))) == []
    inside, release = threading.Event(), threading.Event()

    def step() -> None:
        with gdn_kernels(sites):
            inside.set()
            release.wait(10)

    other = threading.Thread(target=step)
    other.start()
    inside.wait(10)
    with gdn_kernels(sites):
        assert modeling_qwen3_5.torch_recurrent_gated_delta_rule is decode_step
        assert modeling_qwen3_5.torch_chunk_gated_delta_rule is chunk_gated_delta_rule
    assert modeling_qwen3_5.torch_recurrent_gated_delta_rule is decode_step  # the other step runs on
    release.set()
    other.join(10)
    assert modeling_qwen3_5.torch_recurrent_gated_delta_rule is _OWN
    assert modeling_qwen3_5.torch_chunk_gated_delta_rule is _OWN_CHUNK
