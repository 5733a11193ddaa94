"""The engine-independent pieces: bucket planning, buffers, weight validation, the loop thread, the logits processor."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from twinkle_core.data_format import SamplingParams
from twinkle_core.errors import InvalidSamplingParams, UnsupportedFeatureError, WeightUpdateError
from twinkle_vllm._convert import make_plan, vllm_seed
from twinkle_vllm._loop import LoopThread
from twinkle_vllm._sync import plan_buckets
from twinkle_vllm._weights import WeightSpec
from twinkle_vllm._wire import ALIGN, ShmBuffer


def test_buckets_pack_in_order_and_split_large_tensors() -> None:
    tensors = [
        ("a", torch.zeros(10, dtype=torch.float32)),  # 40 bytes
        ("b", torch.zeros(100, dtype=torch.float32)),  # 400 bytes
        ("big", torch.zeros(300, dtype=torch.float32)),  # 1200 bytes > bucket
        ("c", torch.zeros(2, dtype=torch.bfloat16)),
    ]
    buckets = plan_buckets(tensors, 512)
    flat = [item for bucket in buckets for item in bucket]
    assert [i.name for i in flat][:2] == ["a", "b"]
    for bucket in buckets:
        end = max(i.offset + i.nbytes for i in bucket)
        assert end <= 512
        assert all(i.offset % ALIGN == 0 for i in bucket)
    pieces = [i for i in flat if i.name == "big"]
    assert len(pieces) >= 3 and sum(p.nbytes for p in pieces) == 1200
    assert [p.start for p in pieces] == [sum(q.nbytes for q in pieces[:k]) for k in range(len(pieces))]
    assert all(p.total == 1200 and p.shape == (300,) for p in pieces)
    assert flat[-1].name == "c" and flat[-1].whole and flat[-1].dtype == "bfloat16"


def test_shm_buffer_roundtrip_and_checksum(tmp_path: Path) -> None:
    owner = ShmBuffer(str(tmp_path / "buf"), 4096, create=True)
    reader = ShmBuffer(str(tmp_path / "buf"), 4096, create=False)
    try:
        data = torch.arange(256, dtype=torch.float32)
        owner.view(64, 1024).copy_(data.view(torch.uint8))
        assert torch.equal(reader.view(64, 1024).view(torch.float32), data)
        assert owner.checksum(64, 1024) == reader.checksum(64, 1024)
        before = reader.checksum(64, 1024)
        owner.view(64, 1)[0] ^= 1  # one flipped bit
        assert reader.checksum(64, 1024) != before
    finally:
        reader.close()
        owner.close()
    assert not (tmp_path / "buf").exists()


def _spec(tied: bool = False) -> WeightSpec:
    shapes = {
        "model.embed_tokens.weight": (8, 4),
        "model.layers.0.self_attn.q_proj.weight": (4, 4),
        "model.layers.0.self_attn.k_proj.weight": (2, 4),
        "model.layers.0.self_attn.v_proj.weight": (2, 4),
        "model.layers.0.mlp.experts.0.up_proj.weight": (4, 4),
        "model.layers.0.mlp.experts.1.up_proj.weight": (4, 4),
        "model.norm.weight": (4,),
    }
    return WeightSpec(
        shapes,
        dict.fromkeys(shapes, "float32"),
        "float32",
        {"qkv_proj": ["q_proj", "k_proj", "v_proj"]},
        tied_embeddings=tied,
    )


def test_weight_spec_validation() -> None:
    spec = _spec()
    full = {k: torch.zeros(v) for k, v in spec.shapes.items()}
    assert len(spec.validate(list(full.items()))) == len(full)
    assert spec.validate([("model.norm.weight", torch.zeros(4))])  # a whole layer alone is fine
    with pytest.raises(WeightUpdateError, match="k_proj"):
        spec.validate([("model.layers.0.self_attn.q_proj.weight", torch.zeros(4, 4))])
    with pytest.raises(WeightUpdateError, match=r"experts\.1"):
        spec.validate([("model.layers.0.mlp.experts.0.up_proj.weight", torch.zeros(4, 4))])
    with pytest.raises(WeightUpdateError, match=r"Did you mean 'model\.norm\.weight'"):
        spec.validate([("model.nrom.weight", torch.zeros(4))])
    with pytest.raises(WeightUpdateError, match=r"bfloat16.*float32"):
        spec.validate([("model.norm.weight", torch.zeros(4, dtype=torch.bfloat16))])
    with pytest.raises(WeightUpdateError, match="shape"):
        spec.validate([("model.norm.weight", torch.zeros(5))])


def test_tied_lm_head_is_folded_into_the_embedding() -> None:
    spec = _spec(tied=True)
    head = torch.ones(8, 4)
    assert spec.validate([("lm_head.weight", head)]) == [("model.embed_tokens.weight", head)]
    embed = torch.zeros(8, 4)
    both = spec.validate([("model.embed_tokens.weight", embed), ("lm_head.weight", head)])
    assert both == [("model.embed_tokens.weight", embed)]
    with pytest.raises(WeightUpdateError, match="lm_head"):
        _spec(tied=False).validate([("lm_head.weight", head)])


def test_spec_from_a_model_folder(tiny_model: Path) -> None:
    spec = WeightSpec.from_model_dir(tiny_model, "float32", {"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    assert spec.shapes["model.embed_tokens.weight"] == (768, 128)
    assert spec.dtypes["model.norm.weight"] == "float32"
    with pytest.raises(UnsupportedFeatureError, match="safetensors"):
        WeightSpec.from_model_dir(Path("/nonexistent"), "float32", {})


def test_plan_maps_every_field() -> None:
    params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        seed=-3,
        stop=["x"],
        stop_token_ids=[7],
        ignore_eos=True,
        logprobs=2,
        prompt_logprobs=1,
        num_samples=3,
        max_tokens=9,
    )
    plan = make_plan(params, max_logprobs=20, vocab_size=100, temperature_processor=True)
    kw = plan.vllm
    # min-p with top-p: the processor truncates, in twinkle's order (min-p last)
    assert kw["n"] == 3 and kw["temperature"] == 1.0 and kw["top_p"] == 1.0 and kw["top_k"] == 0
    assert kw["extra_args"] == {"twinkle_temperature": [0.7, 0.1, 5, 0.9]}
    native = make_plan(params.replace(min_p=0.0), max_logprobs=20, vocab_size=100, temperature_processor=True).vllm
    assert native["temperature"] == 0.7 and native["top_p"] == 0.9 and native["top_k"] == 5
    assert "extra_args" not in native
    kw = make_plan(params.replace(top_p=1.0), max_logprobs=20, vocab_size=100, temperature_processor=True).vllm
    assert kw["min_p"] == 0.1 and kw["repetition_penalty"] == 1.2 and kw["seed"] == vllm_seed(-3)
    assert kw["stop"] == ["x"] and kw["stop_token_ids"] == [7] and kw["ignore_eos"] is True
    assert kw["logprobs"] == 2 and kw["prompt_logprobs"] == 1 and kw["max_tokens"] == 9 and kw["detokenize"]
    greedy = make_plan(params.replace(temperature=0.0), max_logprobs=20, vocab_size=100, temperature_processor=True)
    assert greedy.vllm["n"] == 1 and greedy.copies == 3
    scoring = make_plan(SamplingParams(max_tokens=0), max_logprobs=20, vocab_size=100, temperature_processor=True)
    assert scoring.scoring and scoring.vllm["max_tokens"] == 1
    scoring = make_plan(
        SamplingParams(max_tokens=0, num_samples=3), max_logprobs=20, vocab_size=100, temperature_processor=True
    )
    assert scoring.vllm["n"] == 1 and scoring.copies == 3
    raw = make_plan(params.replace(logprobs_mode="raw"), max_logprobs=20, vocab_size=100, temperature_processor=True)
    assert raw.rescore_raw and raw.vllm["logprobs"] == 0  # the drawn tokens', to catch NaN logits
    assert raw.for_prompt(500, 512) == {**raw.vllm, "max_tokens": 9}
    assert raw.for_prompt(505, 512)["max_tokens"] == 6
    assert raw.for_prompt(511, 512) is None
    hot = make_plan(params.replace(temperature=3.0), max_logprobs=20, vocab_size=100, temperature_processor=True)
    assert hot.vllm["temperature"] == 1.0 and hot.vllm["min_p"] == 0.0
    assert hot.vllm["extra_args"] == {"twinkle_temperature": [3.0, 0.1, 5, 0.9]}
    hot = make_plan(
        params.replace(temperature=3.0, top_p=1.0), max_logprobs=20, vocab_size=100, temperature_processor=True
    )
    assert hot.vllm["extra_args"] == {"twinkle_temperature": [3.0, 0.1]} and hot.vllm["top_k"] == 5
    with pytest.raises(UnsupportedFeatureError, match="min_p"):
        make_plan(params, max_logprobs=20, vocab_size=100, temperature_processor=False)
    with pytest.raises(UnsupportedFeatureError, match="temperature"):
        make_plan(params.replace(temperature=3.0), max_logprobs=20, vocab_size=100, temperature_processor=False)
    with pytest.raises(UnsupportedFeatureError, match="max_logprobs"):
        make_plan(params.replace(logprobs=21), max_logprobs=20, vocab_size=100, temperature_processor=True)
    with pytest.raises(InvalidSamplingParams, match="stop_token_ids"):
        make_plan(params.replace(stop_token_ids=[100]), max_logprobs=20, vocab_size=100, temperature_processor=True)


def test_temperature_processor_tracks_batch_rows() -> None:
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from twinkle_vllm._logits import EXTRA_ARG, TemperatureProcessor

    proc = TemperatureProcessor(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    hot = SimpleNamespace(extra_args={EXTRA_ARG: [4.0, 0.0]})
    plain = SimpleNamespace(extra_args=None)
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[(0, plain, None, []), (2, hot, None, [])], moved=[]))
    logits = torch.ones(3, 5)
    out = proc.apply(logits.clone())
    assert torch.equal(out[0], logits[0]) and torch.allclose(out[2], logits[2] / 4)
    proc.update_state(
        BatchUpdate(batch_size=3, removed=[], added=[], moved=[(2, 1, MoveDirectionality.UNIDIRECTIONAL)])
    )
    out = proc.apply(logits.clone())
    assert torch.allclose(out[1], logits[1] / 4) and torch.equal(out[2], logits[2])
    proc.update_state(BatchUpdate(batch_size=2, removed=[1], added=[], moved=[]))
    assert torch.equal(proc.apply(logits.clone()), logits)
    # min-p after the temperature: only tokens within min_p of the best survive
    proc.update_state(
        BatchUpdate(
            batch_size=1,
            removed=[],
            added=[(0, SimpleNamespace(extra_args={EXTRA_ARG: [1.0, 0.5]}), None, [])],
            moved=[],
        )
    )
    out = proc.apply(torch.tensor([[0.0, -0.1, -5.0]]))
    assert out[0, 2] == float("-inf") and torch.isfinite(out[0, :2]).all()
    # with top-p, min-p comes after it: the nucleus is measured before min-p removes anything
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    proc.update_state(
        BatchUpdate(
            batch_size=1,
            removed=[],
            added=[(0, SimpleNamespace(extra_args={EXTRA_ARG: [1.0, 0.3, 0, 0.75]}), None, [])],
            moved=[],
        )
    )
    out = proc.apply(probs.log())
    # top-p 0.75 keeps 0.4, 0.3, 0.2 (the mass above 0.1 is 0.9), and min-p 0.3 x 0.4 keeps those;
    # min-p first (vLLM's order) would drop 0.1, and the nucleus of the rest would drop 0.2
    assert torch.isfinite(out[0, :3]).all() and out[0, 3] == float("-inf")
    proc.update_state(
        BatchUpdate(
            batch_size=1,
            removed=[],
            added=[(0, SimpleNamespace(extra_args={EXTRA_ARG: [1.0, 0.0, 1, 1.0]}), None, [])],
            moved=[],
        )
    )
    out = proc.apply(probs.log())
    assert torch.isfinite(out[0, 0]) and (out[0, 1:] == float("-inf")).all()


def test_loop_thread_runs_and_cancels() -> None:
    import asyncio

    loop = LoopThread()
    try:

        async def add(a: int, b: int) -> int:
            await asyncio.sleep(0)
            return a + b

        assert loop.run(add(1, 2)) == 3

        async def forever() -> None:
            await asyncio.sleep(3600)

        with pytest.raises(TimeoutError):
            loop.run(forever(), timeout=0.1)
    finally:
        loop.stop()
    assert not loop.alive


def test_a_seed_is_refused_where_it_would_crash_the_engine() -> None:
    why = "chunked prefill on CPU"
    with pytest.raises(UnsupportedFeatureError, match=r"seed=5 cannot be used here: chunked prefill on CPU"):
        make_plan(SamplingParams(seed=5), max_logprobs=20, vocab_size=100, temperature_processor=True, seeds_crash=why)
    unseeded = make_plan(SamplingParams(), max_logprobs=20, vocab_size=100, temperature_processor=True, seeds_crash=why)
    assert unseeded.vllm["seed"] is None


def test_cpu_engines_default_to_whole_prompt_prefills(tiny_model: Path) -> None:
    """vLLM's CPU backend cannot rewind a seeded request after a partial prefill, so twinkle turns chunking off."""
    from vllm.platforms import current_platform

    from twinkle_vllm._engine_args import build_engine_args

    if not current_platform.is_cpu():
        pytest.skip("vLLM's GPU backends keep chunked prefill")
    assert build_engine_args(tiny_model, 1, {}).enable_chunked_prefill is False
    assert build_engine_args(tiny_model, 1, {"enable_chunked_prefill": True}).enable_chunked_prefill is True


def _vllm_lora_ops() -> dict[str, Any]:
    """vLLM's CPU LoRA ops as vLLM ships them (unwrapped), with the rows without an adapter zeroed (its bug fixed)."""
    from vllm.lora.ops.torch_ops import lora_ops

    from twinkle_vllm._cpu_lora_ops import _LORA_OPS, _zero_rows_without_lora

    reference = {}
    for name in _LORA_OPS:
        op = getattr(lora_ops, name)
        while hasattr(op, "__wrapped__"):
            op = op.__wrapped__
        reference[name] = _zero_rows_without_lora(op)
    return reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["one slot", "mixed", "none"])
def test_grouped_lora_ops_compute_what_vllms_ops_do(dtype: torch.dtype, pattern: str) -> None:
    """The CPU LoRA ops twinkle installs (one product per adapter slot) against vLLM's own gather-and-multiply."""
    from twinkle_vllm._cpu_lora_ops import _grouped_lora_ops

    reference = _vllm_lora_ops()
    grouped = _grouped_lora_ops(reference)
    gen = torch.Generator().manual_seed(1)
    tokens, width, rank, out = 33, 40, 4, 24
    indices = {
        "one slot": torch.full((tokens,), 2),
        "mixed": torch.randint(-1, 3, (tokens,), generator=gen),
        "none": torch.full((tokens,), -1),
    }[pattern]
    x = torch.randn(tokens, width, generator=gen)
    a = torch.randn(3, 1, rank, width, generator=gen).to(dtype)
    b = torch.randn(3, 1, out, rank, generator=gen).to(dtype)
    mid = torch.randn(tokens, rank, generator=gen)
    for add in (True, False):
        for name, args in (
            ("bgmv_shrink", (x, a, torch.zeros(tokens, rank), indices, 0.25)),
            ("bgmv_expand", (mid, b, torch.randn(tokens, out, generator=gen), indices, add)),
            ("bgmv_expand_slice", (mid, b, torch.randn(tokens, 2 * out, generator=gen), indices, out // 2, out, add)),
        ):
            mine, theirs = args[2].clone(), args[2].clone()
            grouped[name](args[0], args[1], mine, *args[3:])
            reference[name](args[0], args[1], theirs, *args[3:])
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_the_lora_ops_probe_refuses_ops_that_compute_something_else() -> None:
    from twinkle_vllm._cpu_lora_ops import _grouped_lora_ops, _lora_ops_agree

    reference = _vllm_lora_ops()
    grouped = _grouped_lora_ops(reference)
    assert _lora_ops_agree(grouped, reference)
    unscaled = dict(grouped, bgmv_shrink=lambda x, w, out, idx, scaling=1.0: grouped["bgmv_shrink"](x, w, out, idx))
    assert not _lora_ops_agree(unscaled, reference)
    base_gets_adapter = dict(grouped, bgmv_expand=reference["bgmv_expand"].__wrapped__)  # vLLM's -1 bug
    assert not _lora_ops_agree(base_gets_adapter, reference)
