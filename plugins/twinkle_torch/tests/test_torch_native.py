"""The native kernels (`twinkle_torch.native`): decode attention against SDPA, the top-p nucleus against a
sort, both in the engine, and the engine without a compiler."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from twinkle_core import SamplingParams, Trajectory
from twinkle_core.errors import ConfigError
from twinkle_torch import native
from twinkle_torch.attention import ATTN_IMPLEMENTATION, NATIVE_ATTN_IMPLEMENTATION
from twinkle_torch.sampler import TorchSampler


@pytest.fixture(scope="module", autouse=True)
def kernel() -> None:
    native.load()  # this machine has a compiler: a build failure here is a bug


def _case(rows: int, heads: int, group: int, dim: int, tokens: int, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """Queries, and keys / values as views of a bigger preallocated buffer (as the engine's cache holds them)."""
    g = torch.Generator().manual_seed(seed)
    room = tokens + 5
    key = torch.randn(rows, heads, room, dim, generator=g).to(dtype)[:, :, :tokens]
    value = torch.randn(rows, heads, room, dim, generator=g).to(dtype)[:, :, :tokens]
    query = torch.randn(rows, heads, group, dim, generator=g).to(dtype)
    mask = torch.rand(rows, 1, 1, tokens, generator=g) > 0.4  # holes anywhere, not only leading padding
    mask[..., -1] = True  # the token itself, as in decoding
    return {"query": query, "key": key, "value": value, "mask": mask}


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, scale: Any) -> torch.Tensor:
    rows, heads, group, dim = query.shape
    out = F.scaled_dot_product_attention(query.float(), key.float(), value.float(), attn_mask=mask, scale=scale)
    return out.reshape(rows, heads * group, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "heads", "group", "dim", "tokens"),
    [(1, 1, 2, 64, 1), (6, 3, 3, 64, 150), (5, 2, 4, 128, 33), (4, 2, 5, 80, 17), (3, 1, 9, 32, 40), (2, 2, 1, 64, 9)],
)
def test_the_kernel_equals_sdpa(rows: int, heads: int, group: int, dim: int, tokens: int, dtype: torch.dtype) -> None:
    case = _case(rows, heads, group, dim, tokens, dtype, seed=rows * 100 + dim)
    q, k, v, mask = case["query"], case["key"], case["value"], case["mask"]
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding
    for m, scale in ((mask, None), (None, 0.3), (mask[:1], 0.05)):  # per-row mask, none, one row for all
        out = native.decode_attention(q, k, v, m, scale)
        assert out is not None and out.dtype == dtype and out.shape == (rows, heads * group, dim)
        expected = _reference(q, k, v, None if m is None else m.expand(rows, 1, 1, tokens), scale)
        assert torch.allclose(out.float(), expected, atol=tolerance, rtol=0), (m is None, scale)


def test_a_row_with_nothing_to_attend_to_gets_zeros_not_nan() -> None:
    case = _case(3, 1, 2, 64, 8, torch.float32, seed=0)
    mask = case["mask"].clone()
    mask[1] = False
    out = native.decode_attention(case["query"], case["key"], case["value"], mask, None)
    assert out is not None and torch.equal(out[1], torch.zeros_like(out[1]))
    expected = _reference(case["query"], case["key"], case["value"], mask, None)
    assert torch.allclose(out[[0, 2]], expected[[0, 2]], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_nan_in_the_cache_comes_out_as_nan(dtype: torch.dtype) -> None:
    case = _case(2, 1, 2, 64, 8, dtype, seed=2)
    value = case["value"].clone()
    value[0, 0, 3, 5] = float("nan")
    mask = torch.ones(2, 1, 1, 8, dtype=torch.bool)
    out = native.decode_attention(case["query"], case["key"], value, mask, None)
    assert out is not None and torch.isnan(out[0, :, 5]).all() and not torch.isinf(out).any()
    assert torch.isfinite(out[1]).all()


def test_what_the_kernel_does_not_take_is_left_to_sdpa() -> None:
    case = _case(2, 1, 2, 64, 8, torch.float32, seed=1)
    q, k, v, mask = case["query"], case["key"], case["value"], case["mask"]
    half = [t.half() for t in (q, k, v)]
    assert native.decode_attention(*half, mask, None) is None  # a dtype it has no code for
    assert native.decode_attention(q, k, v, torch.zeros(mask.shape), None) is None  # an additive float mask
    assert native.decode_attention(q, k, v, mask[..., :-1], None) is None  # a mask of other columns
    assert native.decode_attention(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, mask, None) is None
    with torch.enable_grad():  # autograd: the kernel has no backward
        assert native.decode_attention(q.clone().requires_grad_(), k, v, mask, None) is None
    assert native.decode_attention(q, k, v, mask, None) is not None


def _sorted_nucleus(probs: torch.Tensor, top_p: float, min_p: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's nucleus from a full sort: a value is kept when the mass of the values above it is below top_p."""
    masses, lowest = [], []
    for row in probs.double():
        values, counts = torch.unique_consecutive(row.sort(descending=True).values, return_counts=True)
        group = values * counts
        keep = (group.cumsum(0) - group) < top_p
        if min_p is not None:
            keep &= values.float() >= min_p * values[0].float()
        masses.append(group[keep].sum())
        lowest.append(values[keep].min())
    return torch.stack(masses).float(), torch.stack(lowest).float()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
@pytest.mark.parametrize(("top_p", "min_p"), [(0.95, None), (0.5, None), (0.9, 0.05), (0.999, None)])
def test_the_nucleus_equals_a_sort(temperature: float, top_p: float, min_p: float | None) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(24, 5003, generator=g) * 4 / temperature  # peaked to nearly flat rows
    wide = torch.softmax(torch.cat([logits, torch.zeros(24, 9)], dim=1), dim=-1)
    probs = wide[:, :5003] / wide[:, :5003].sum(-1, keepdim=True)
    probs = torch.cat([probs, torch.zeros(24, 9)], dim=1)[:, :5003]  # rows strided apart, as a view
    assert probs.stride(0) == 5012
    found = native.nucleus(probs, top_p, min_p)
    assert found is not None
    mass, threshold = found
    want_mass, want_threshold = _sorted_nucleus(probs, top_p, min_p)
    assert torch.allclose(mass.squeeze(1), want_mass, rtol=1e-6, atol=0)
    assert torch.equal(threshold.squeeze(1), want_threshold)


def test_the_nucleus_keeps_ties_together_and_flags_what_is_no_probability() -> None:
    probs = torch.full((3, 1000), 1e-3)
    probs[1, :10] = 0.05  # ten tied leaders hold half the mass: all ten are kept, and only they
    probs[1, 10:] = 0.5 / 990
    probs[2, 5] = float("nan")
    found = native.nucleus(probs, 0.3)
    assert found is not None
    mass, threshold = found
    assert mass[0].item() == pytest.approx(1.0) and threshold[0].item() == pytest.approx(1e-3)
    assert mass[1].item() == pytest.approx(0.5) and threshold[1].item() == pytest.approx(0.05)
    assert math.isnan(mass[2].item()) and math.isnan(threshold[2].item())


def test_what_the_nucleus_does_not_take_is_left_to_topk() -> None:
    probs = torch.softmax(torch.randn(4, 100), dim=-1)
    assert native.nucleus(probs.double(), 0.9) is None
    assert native.nucleus(probs.t().contiguous().t(), 0.9) is None  # columns strided
    assert native.nucleus(probs, float("nan")) is None
    assert native.nucleus(probs, 0.9, min_p=1.5) is None
    with torch.enable_grad():
        assert native.nucleus(probs.clone().requires_grad_(), 0.9) is None
    assert native.nucleus(probs, 0.9) is not None


# -- in the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_model(tiny_llama: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def sampler(tiny_llama: Path) -> Iterator[TorchSampler]:
    with TorchSampler(tiny_llama, device="cpu", dtype="float32") as s:
        yield s


def test_cpu_engines_decode_through_the_kernel_by_default(sampler: TorchSampler, tiny_llama: Path) -> None:
    assert sampler.model.config._attn_implementation == NATIVE_ATTN_IMPLEMENTATION
    with TorchSampler(tiny_llama, device="cpu", attention_kernel="sdpa") as s:
        assert s.model.config._attn_implementation == ATTN_IMPLEMENTATION


def test_sampled_logprobs_through_the_kernel_equal_the_models(
    sampler: TorchSampler, hf_model: Any, chat_prompts: list[Trajectory]
) -> None:
    """Prompts of different lengths share the batch (left padding: masked columns); every
    sampled token's log-prob is the model's own, scored by a plain forward over the whole sequence."""
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7, num_samples=3, logprobs=0)
    responses = sampler.sample(chat_prompts, params)
    checked = 0
    for response in responses:
        prompt = response.prompt_token_ids
        for seq in response.sequences:
            with torch.inference_mode():
                logits = hf_model(torch.tensor([prompt + seq.tokens])).logits[0].float()
            want = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
            assert seq.logprobs is not None
            got = torch.tensor(seq.logprobs)
            assert torch.allclose(got, want[torch.arange(len(seq.tokens)), seq.tokens], atol=1e-4, rtol=0)
            checked += len(seq.tokens)
    assert checked == len(chat_prompts) * 3 * 24


def test_processed_logprobs_under_top_p_and_min_p_are_the_renormalised_nucleus(
    sampler: TorchSampler, hf_model: Any, chat_prompts: list[Trajectory]
) -> None:
    """Through the native nucleus (the CPU engine's default): each sampled token's log-prob is its
    probability over the mass of its step's nucleus, found here by a sort of the model's own forward."""
    assert sampler.engine._decoder.native_kernels
    top_p, min_p, temperature = 0.8, 0.02, 1.3
    params = SamplingParams(
        temperature=temperature, top_p=top_p, min_p=min_p, max_tokens=12, ignore_eos=True, seed=5, logprobs=3
    )
    for response in sampler.sample(chat_prompts[:3], params):
        prompt = response.prompt_token_ids
        (seq,) = response.sequences
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + seq.tokens])).logits[0].float()
        probs = torch.softmax(logits[len(prompt) - 1 : -1] / temperature, -1)
        mass, lowest = _sorted_nucleus(probs, top_p, min_p)
        chosen = probs[torch.arange(len(seq.tokens)), seq.tokens]
        assert bool((chosen >= lowest * (1 - 1e-5)).all())  # every drawn token is in its nucleus
        assert seq.logprobs is not None
        want = torch.log(chosen) - torch.log(mass)
        assert torch.allclose(torch.tensor(seq.logprobs), want, atol=1e-4, rtol=0)
        assert seq.top_logprobs is not None
        for step, alternatives in enumerate(seq.top_logprobs):
            for token, logprob in alternatives:
                p = probs[step, token]
                expected = float(torch.log(p) - torch.log(mass[step])) if p >= lowest[step] else -math.inf
                assert logprob == pytest.approx(expected, abs=1e-4)


def test_native_conflicts_with_a_chosen_attention(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="attention_kernel='native' and attn_implementation='eager'"):
        TorchSampler(tiny_llama, device="cpu", attention_kernel="native", attn_implementation="eager")


_PROBE = """
import json, logging, sys
from twinkle_torch.sampler import TorchSampler
from twinkle_core.errors import ConfigError
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
out = {}
try:
    TorchSampler(sys.argv[1], device="cpu", attention_kernel="native").close()
except ConfigError as exc:
    out["native"] = str(exc)
with TorchSampler(sys.argv[1], device="cpu") as s:
    out["auto"] = s.model.config._attn_implementation
    params = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    out["tokens"] = len(s.sample({"messages": [{"role": "user", "content": "hi"}]}, params)[0].sequences[0].tokens)
print(json.dumps(out))
"""


def _probe(tiny_llama: Path, cache: Path, compiler: str | None) -> tuple[dict[str, Any], str]:
    env = {**os.environ, "TWINKLE_CACHE": str(cache)}
    env.pop("CXX", None)
    if compiler is not None:
        env["CXX"] = compiler
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tiny_llama)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("why", ["no compiler", "no cache folder"])
def test_where_it_cannot_be_built_auto_keeps_sdpa_and_native_refuses(
    tiny_llama: Path, tmp_path: Path, why: str
) -> None:
    if why == "no compiler":
        cache, compiler, reason = tmp_path, str(tmp_path / "no-such-c++"), "no-such-c++"
    else:
        (tmp_path / "a-file").write_text("")
        cache, compiler, reason = tmp_path / "a-file", None, "cannot write the kernel cache"
    out, log = _probe(tiny_llama, cache, compiler)
    assert "attention_kernel='native' is not available" in out["native"] and reason in out["native"]
    assert out["auto"] == ATTN_IMPLEMENTATION and out["tokens"] == 4
    assert "decode-attention kernel is unavailable" in log
    assert not list(tmp_path.glob("**/*.so"))


def test_the_build_is_cached_by_source_compiler_and_cpu(tiny_llama: Path, tmp_path: Path) -> None:
    out, _ = _probe(tiny_llama, tmp_path, None)
    assert "native" not in out and out["auto"] == NATIVE_ATTN_IMPLEMENTATION and out["tokens"] == 4
    (built,) = tmp_path.glob("kernels/kernels-*.so")
    stamp = built.stat().st_mtime_ns
    _probe(tiny_llama, tmp_path, None)  # a second process loads the same file, no rebuild
    assert [p.name for p in tmp_path.glob("kernels/*")] == [built.name] and built.stat().st_mtime_ns == stamp
