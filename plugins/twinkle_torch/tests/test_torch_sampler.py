"""TorchSampler against Hugging Face ``generate`` and hand computations, on the core's tiny models."""

from __future__ import annotations

import math
import shutil
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch_helpers import hf_greedy

from twinkle_core import DeviceMesh, SamplingParams, Trajectory
from twinkle_core.errors import AdapterError, ConfigError, InvalidMeshError, UnknownAdapterError, WeightUpdateError
from twinkle_torch.decoding import DecoderStats
from twinkle_torch.sampler import TorchSampler


@pytest.fixture(scope="module")
def sampler(tiny_llama: Path) -> Iterator[TorchSampler]:
    with TorchSampler(tiny_llama, device="cpu") as s:
        yield s


@pytest.fixture(scope="module")
def hf_model(tiny_llama: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval()


def greedy(max_tokens: int = 32, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def prompt_ids(sampler: TorchSampler, trajs: list[Trajectory]) -> list[list[int]]:
    return [sampler.template.encode(t).input_ids for t in trajs]


def tokens_of(responses: Any) -> list[list[int]]:
    return [r.sequences[0].tokens for r in responses]


Outputs = tuple[list[list[int]], list[float]]


def outputs_of(resps: list[Any]) -> Outputs:
    """Greedy tokens and their log-probs (adapters show in the log-probs even where the peaked
    tiny model keeps its greedy tokens)."""
    return [r.sequences[0].tokens for r in resps], [lp for r in resps for lp in r.sequences[0].logprobs]


def same(a: Outputs, b: Outputs) -> bool:
    """The same tokens, and log-probs equal up to float noise.

    Concurrent calls share the running batch, so a row's padding and its
    neighbours change the order of float sums: about 1e-5 on this model.
    """
    return a[0] == b[0] and all(abs(x - y) < 1e-4 for x, y in zip(a[1], b[1]))


def differ(a: Outputs, b: Outputs) -> bool:
    """Other tokens, or log-probs that differ by more than float noise."""
    return a[0] != b[0] or any(abs(x - y) > 1e-3 for x, y in zip(a[1], b[1]))


def outputs(sampler: TorchSampler, prompts: list[Trajectory], adapter: str = "", max_tokens: int = 16) -> Outputs:
    return outputs_of(sampler.sample(prompts, greedy(max_tokens, logprobs=0), adapter_name=adapter))


# -- greedy equals HF generate ----------------------------------------------------------------
def test_greedy_matches_hf_generate_batched(
    sampler: TorchSampler, hf_model: Any, chat_prompts: list[Trajectory]
) -> None:
    ids = prompt_ids(sampler, chat_prompts)
    expected = hf_greedy(hf_model, ids, 40, pad_id=0)
    assert tokens_of(sampler.sample(chat_prompts, greedy(40))) == expected
    # and prompt by prompt
    assert [tokens_of(sampler.sample(t, greedy(40)))[0] for t in chat_prompts[:3]] == expected[:3]


def test_greedy_matches_hf_generate_qwen2(tiny_qwen2: Path, chat_prompts: list[Trajectory]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2), dtype=torch.float32).eval()
    with TorchSampler(tiny_qwen2, device="cpu") as s:
        ids = prompt_ids(s, chat_prompts)
        assert tokens_of(s.sample(chat_prompts, greedy(32))) == hf_greedy(model, ids, 32, pad_id=0)


def test_repetition_penalty_matches_hf(sampler: TorchSampler, hf_model: Any, chat_prompts: list[Trajectory]) -> None:
    # one prompt per generate call: HF would also penalise the padding token of a batch
    for traj in chat_prompts[:4]:
        ids = prompt_ids(sampler, [traj])
        expected = hf_greedy(hf_model, ids, 24, pad_id=0, repetition_penalty=1.5)
        assert tokens_of(sampler.sample(traj, greedy(24, repetition_penalty=1.5))) == expected


def test_context_window_ends_with_length(sampler: TorchSampler) -> None:
    room = 5
    prompt = [5] * (sampler.max_model_len - room)
    seq = sampler.sample({"input_ids": prompt}, greedy(50, ignore_eos=True))[0].sequences[0]
    assert len(seq.tokens) == room and seq.stop_reason == "length"


# -- log-probs against a hand computation ---------------------------------------------------------
def _hand_processed(raw: torch.Tensor, seen: set[int], p: SamplingParams) -> torch.Tensor:
    """The processed log-probs of one position, computed the slow, obvious way."""
    x = raw.clone()
    for t in seen:
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    x = x / p.temperature
    order = torch.argsort(x, descending=True)
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[order[: p.top_k if p.top_k > 0 else len(order)]] = True
    probs = torch.softmax(x.masked_fill(~keep, -math.inf), -1)
    mass = 0.0
    nucleus = torch.zeros_like(keep)
    for t in order.tolist():
        if not keep[t] or mass >= p.top_p:
            break
        nucleus[t] = True
        mass += float(probs[t])
    keep &= nucleus
    if p.min_p > 0:
        keep &= x >= x.max() + math.log(p.min_p)
    return torch.log_softmax(x.masked_fill(~keep, -math.inf), -1)


@pytest.mark.parametrize(
    "truncation",
    [{"top_k": 12, "top_p": 0.9, "min_p": 0.02}, {"top_p": 0.9, "min_p": 0.02}, {"top_p": 0.8}, {"min_p": 0.05}],
    ids=["top-k+top-p+min-p", "top-p+min-p", "top-p", "min-p"],
)
def test_processed_and_raw_logprobs_match_hand_computation(
    sampler: TorchSampler, hf_model: Any, chat_prompts: list[Trajectory], truncation: dict[str, Any]
) -> None:
    params = SamplingParams(
        temperature=1.5, repetition_penalty=1.2, max_tokens=16, ignore_eos=True, seed=42, logprobs=4, **truncation
    )
    traj = chat_prompts[4]
    proc = sampler.sample(traj, params)[0]
    raw = sampler.sample(traj, params.replace(logprobs_mode="raw"))[0]
    plain = sampler.sample(traj, params.replace(logprobs=None))[0]
    seq, rseq = proc.sequences[0], raw.sequences[0]
    # log-prob options change what is reported, not what is drawn
    assert seq.tokens == rseq.tokens == plain.sequences[0].tokens
    prompt = proc.prompt_token_ids
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + seq.tokens])).logits[0].float()
    assert seq.logprobs is not None and seq.top_logprobs is not None and rseq.logprobs is not None
    for i, tok in enumerate(seq.tokens):
        position = logits[len(prompt) - 1 + i]
        expected = _hand_processed(position, set(prompt + seq.tokens[:i]), params)
        assert expected[tok] > -math.inf  # the token was drawn from the truncated distribution
        assert seq.logprobs[i] == pytest.approx(float(expected[tok]), abs=1e-4)
        want_top = torch.topk(expected, 4)
        got_top = seq.top_logprobs[i]
        finite = [(t, v) for t, v in zip(want_top.indices.tolist(), want_top.values.tolist()) if v > -math.inf]
        assert [t for t, _ in got_top[: len(finite)]] == [t for t, _ in finite]
        assert [v for _, v in got_top[: len(finite)]] == pytest.approx([v for _, v in finite], abs=1e-4)
        assert all(v == -math.inf for _, v in got_top[len(finite) :])
        raw_lp = torch.log_softmax(position, -1)
        assert rseq.logprobs[i] == pytest.approx(float(raw_lp[tok]), abs=1e-4)
        assert rseq.top_logprobs is not None
        assert [t for t, _ in rseq.top_logprobs[i]] == torch.topk(raw_lp, 4).indices.tolist()


def test_greedy_processed_logprobs_apply_only_the_penalty(
    sampler: TorchSampler, hf_model: Any, chat_prompts: list[Trajectory]
) -> None:
    params = greedy(8, ignore_eos=True, repetition_penalty=1.3, logprobs=0, top_k=2, top_p=0.5)
    resp = sampler.sample(chat_prompts[0], params)[0]
    seq, prompt = resp.sequences[0], resp.prompt_token_ids
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + seq.tokens])).logits[0].float()
    assert seq.logprobs is not None
    for i, tok in enumerate(seq.tokens):
        x = logits[len(prompt) - 1 + i].clone()
        for t in set(prompt + seq.tokens[:i]):
            x[t] = x[t] / 1.3 if x[t] > 0 else x[t] * 1.3
        assert seq.logprobs[i] == pytest.approx(float(torch.log_softmax(x, -1)[tok]), abs=1e-4)


def test_prompt_logprobs_match_model(sampler: TorchSampler, hf_model: Any, chat_prompts: list[Trajectory]) -> None:
    resps = sampler.sample(chat_prompts[:3], SamplingParams(max_tokens=0, prompt_logprobs=3))
    for resp in resps:
        ids = resp.prompt_token_ids
        with torch.inference_mode():
            lp = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
        want = [None] + [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
        assert resp.prompt_logprobs is not None and resp.prompt_logprobs[0] is None
        assert resp.prompt_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
        assert resp.prompt_top_logprobs is not None
        assert [t for t, _ in resp.prompt_top_logprobs[5]] == torch.topk(lp[4], 3).indices.tolist()
        assert [len(s.tokens) for s in resp.sequences] == [0]


# -- seeds, batching and the token budget -----------------------------------------------------
def test_seeded_samples_do_not_depend_on_the_batch(sampler: TorchSampler, chat_prompts: list[Trajectory]) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, seed=123, num_samples=3)
    alone = sampler.sample(chat_prompts[2], params)[0]
    batched = sampler.sample(chat_prompts[:6], params)[2]
    assert [s.tokens for s in batched.sequences] == [s.tokens for s in alone.sequences]
    assert len({tuple(s.tokens) for s in alone.sequences}) > 1  # the samples of one request differ
    # rows that end early (EOS) are pruned from the batch; the survivors keep their streams
    budget = sampler.max_batch_tokens
    try:
        sampler.max_batch_tokens = 1  # one row per batch
        one_by_one = sampler.sample(chat_prompts[:6], params)[2]
    finally:
        sampler.max_batch_tokens = budget
    assert [s.tokens for s in one_by_one.sequences] == [s.tokens for s in alone.sequences]


def test_token_budget_splits_batches_without_changing_results(
    sampler: TorchSampler, chat_prompts: list[Trajectory]
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=20, num_samples=2)
    full = sampler.sample(chat_prompts, params)
    budget = sampler.max_batch_tokens
    try:
        sampler.max_batch_tokens = 100  # a few rows per batch, and prompts split across batches
        split = sampler.sample(chat_prompts, params)
    finally:
        sampler.max_batch_tokens = budget
    assert [[s.tokens for s in r.sequences] for r in split] == [[s.tokens for s in r.sequences] for r in full]


# -- stop strings ----------------------------------------------------------------------------------
def test_stop_strings_across_tokens(sampler: TorchSampler, chat_prompts: list[Trajectory]) -> None:
    base = sampler.sample(chat_prompts[0], greedy(20))[0].sequences[0]
    text = base.text
    words = text.split()
    assert len(words) >= 3 and len(text) >= 12, f"the greedy answer is too short to cut: {text!r}"
    # stop strings taken from the engine's own answer: inside a word across tokens, across a space,
    # its last word, and its first word
    inside, across = text[2:9], words[1][1:] + " " + words[2][:2]
    decoded = [sampler.template.decode(base.tokens[:k]) for k in range(len(base.tokens) + 1)]
    for stop in (inside, across, words[-1], words[0]):
        seq = sampler.sample(chat_prompts[0], greedy(20, stop=[stop, "never appears"]))[0].sequences[0]
        cut = text.index(stop)
        assert (seq.text, seq.stop, seq.stop_reason) == (text[:cut], stop, "stop")
        # tokens end with the one that completed the stop string
        done = next(k for k, t in enumerate(decoded) if stop in t)
        assert seq.tokens == base.tokens[:done]
    # the earliest stop string wins, whatever order they are given in
    later, earlier = words[-1], words[1]
    assert text.index(earlier) < text.index(later)
    seq = sampler.sample(chat_prompts[0], greedy(20, stop=[later, earlier]))[0].sequences[0]
    assert (seq.text, seq.stop) == (text[: text.index(earlier)], earlier)


# -- weights ---------------------------------------------------------------------------------------
def _perturbed(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    names = ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.o_proj.weight", "lm_head.weight"]
    return {n: state[n] + 0.05 * torch.randn(state[n].shape, generator=gen) for n in names}


def test_update_weights_equals_a_fresh_model(
    tiny_llama: Path, tmp_path: Path, chat_prompts: list[Trajectory], lora_dirs: dict[str, Path]
) -> None:
    from safetensors.torch import load_file, save_file

    new = _perturbed(tiny_llama)
    saved = tmp_path / "perturbed"
    shutil.copytree(tiny_llama, saved)
    state = load_file(str(tiny_llama / "model.safetensors"))
    state.update(new)
    save_file(state, str(saved / "model.safetensors"), metadata={"format": "pt"})

    with TorchSampler(tiny_llama, device="cpu") as s, TorchSampler(saved, device="cpu") as fresh:
        s.add_adapter_to_model("a", lora_dirs["a"])  # names resolve through injected LoRA layers too
        before = outputs(s, chat_prompts, max_tokens=24)
        version = s.update_weights(new)
        assert version == s.weights_version == 2
        after = s.sample(chat_prompts, greedy(24, logprobs=0))
        assert all(r.sequences[0].weights_version == 2 for r in after)
        assert same(outputs_of(after), outputs(fresh, chat_prompts, max_tokens=24))
        assert differ(outputs_of(after), before)
        fresh.add_adapter_to_model("a", lora_dirs["a"])
        assert same(outputs(s, chat_prompts, "a", 24), outputs(fresh, chat_prompts, "a", 24))


def test_bad_weight_updates_change_nothing(tiny_llama: Path, chat_prompts: list[Trajectory]) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        before = tokens_of(s.sample(chat_prompts[:4], greedy(16)))
        good = ("model.norm.weight", torch.zeros(128))
        bad_cases = [
            ([good, ("model.layers.9.mlp.down_proj.weight", torch.zeros(1))], "not a weight of this model"),
            ([good, ("model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3))], "shape"),
            ([good, ("model.layers.0.input_layernorm.weight", torch.zeros(128, dtype=torch.int64))], "dtype"),
            ([good, good], "twice"),
            ([good, ("model.layers.0.input_layernorm.weight", [0.0] * 128)], "torch.Tensor"),
            ([good, ("model.layers.0.input_layernorm.weight", torch.full((128,), math.nan))], "non-finite"),
            ([good, ("model.layers.0.input_layernorm.weight", torch.full((128,), -math.inf))], "non-finite"),
            # fails only when the data is read: refused before the first copy, so nothing is half-applied
            ([good, ("model.layers.0.input_layernorm.weight", torch.zeros(128, device="meta"))], "meta"),
        ]
        for update, message in bad_cases:
            with pytest.raises(WeightUpdateError, match=message):
                s.update_weights(update)
        assert s.weights_version == 0
        assert tokens_of(s.sample(chat_prompts[:4], greedy(16))) == before
        # a bfloat16 update of a float32 model is cast
        s.update_weights({"model.norm.weight": torch.ones(128, dtype=torch.bfloat16)})
        assert s.weights_version == 1
        # a trainer's own parameter (requires_grad) goes in as it is, without autograd warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            s.update_weights({"model.norm.weight": torch.nn.Parameter(torch.ones(128))})
        assert s.weights_version == 2


# -- adapters --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapted(tiny_llama: Path, lora_dirs: dict[str, Path]) -> Iterator[TorchSampler]:
    with TorchSampler(tiny_llama, device="cpu") as s:
        s.add_adapter_to_model("a", lora_dirs["a"])
        s.add_adapter_to_model("b", lora_dirs["b"])
        yield s


def _peft_hf(tiny_llama: Path, adapter: Path) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter)).eval()


def test_adapter_greedy_matches_hf_peft(
    adapted: TorchSampler, tiny_llama: Path, lora_dirs: dict[str, Path], chat_prompts: list[Trajectory]
) -> None:
    ids = prompt_ids(adapted, chat_prompts)
    base = outputs(adapted, chat_prompts, max_tokens=24)
    for name in ("a", "b"):
        expected = hf_greedy(_peft_hf(tiny_llama, lora_dirs[name]), ids, 24, pad_id=0)
        got = adapted.sample(chat_prompts, greedy(24, logprobs=0), adapter_name=name)
        assert tokens_of(got) == expected
        assert differ(outputs_of(got), base)
        assert all(r.sequences[0].adapter_name == name for r in got)


def test_concurrent_calls_with_different_adapters_never_mix(
    adapted: TorchSampler, chat_prompts: list[Trajectory]
) -> None:
    names = ["", "a", "b"]
    expected = {n: outputs(adapted, chat_prompts[:5], n) for n in names}
    assert differ(expected[""], expected["a"]) and differ(expected[""], expected["b"])
    assert differ(expected["a"], expected["b"])
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        try:
            for _ in range(3):
                got = adapted.sample(chat_prompts[:5], greedy(16, logprobs=0), adapter_name=name)
                assert same(outputs_of(got), expected[name])
                assert all(r.sequences[0].adapter_name == name for r in got)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in names * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def test_adapter_from_config_and_weights_in_memory(
    adapted: TorchSampler, lora_dirs: dict[str, Path], chat_prompts: list[Trajectory]
) -> None:
    import json

    from safetensors.torch import load_file

    config = json.loads((lora_dirs["b"] / "adapter_config.json").read_text())
    weights = load_file(str(lora_dirs["b"] / "adapter_model.safetensors"))
    from peft import LoraConfig

    adapted.add_adapter_to_model("b-mem", config, weights=weights)  # the config as a dict
    adapted.add_adapter_to_model("b-obj", LoraConfig.from_pretrained(str(lora_dirs["b"])), weights=weights)
    try:
        expected = outputs(adapted, chat_prompts, "b")
        assert same(outputs(adapted, chat_prompts, "b-mem"), expected)
        assert same(outputs(adapted, chat_prompts, "b-obj"), expected)
        assert adapted.adapters["b-mem"].source == "<memory>"
        # a key this PEFT does not take would be dropped, and the adapter run as another: refused, named
        for key, hint in (("lora_alph", "Did you mean 'lora_alpha'?"), ("use_shiny_lora", "install the peft")):
            with pytest.raises(AdapterError, match=rf"key\(s\) \['{key}'\] that LoraConfig .*{hint}"):
                adapted.add_adapter_to_model("b-typo", {**config, key: 3}, weights=weights)
        assert "b-typo" not in adapted.adapters
    finally:
        adapted.remove_adapter("b-mem")
        adapted.remove_adapter("b-obj")


def test_replace_remove_and_bad_adapters(
    tiny_llama: Path, lora_dirs: dict[str, Path], chat_prompts: list[Trajectory], tmp_path: Path
) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        base = outputs(s, chat_prompts)
        s.add_adapter_to_model("x", lora_dirs["a"])
        s.add_adapter_to_model("y", lora_dirs["c"])
        out_a = outputs(s, chat_prompts, "x")
        out_c = outputs(s, chat_prompts, "y")
        assert differ(out_a, base) and differ(out_c, base)

        # replacing keeps the name and id, bumps the version, and serves the new weights
        adapter_id = s.adapter_id("x")
        version = s.add_adapter_to_model("x", lora_dirs["b"])
        assert s.adapter_id("x") == adapter_id and s.adapters["x"].version == version == 3
        out_b = outputs(s, chat_prompts, "x")
        assert differ(out_b, out_a)
        assert same(outputs(s, chat_prompts, "y"), out_c)

        # bad folders: a clear error, and everything loaded keeps working
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "adapter_config.json").write_text("{not json")
        wrong_shape = tmp_path / "wrong-shape"
        shutil.copytree(lora_dirs["a"], wrong_shape)
        from safetensors.torch import load_file, save_file

        weights = load_file(str(wrong_shape / "adapter_model.safetensors"))
        save_file({k: torch.zeros(3, 3) for k in weights}, str(wrong_shape / "adapter_model.safetensors"))
        no_weights = tmp_path / "no-weights"
        no_weights.mkdir()
        shutil.copy(lora_dirs["a"] / "adapter_config.json", no_weights)
        for bad in (tmp_path / "missing", broken, wrong_shape, no_weights):
            with pytest.raises(AdapterError, match=str(bad.name)):
                s.add_adapter_to_model("x", bad)
            assert same(outputs(s, chat_prompts, "x"), out_b)
            assert same(outputs(s, chat_prompts), base)
        with pytest.raises(AdapterError):
            s.add_adapter_to_model("z", {"r": 4, "target_modules": ["q_proj"]})  # no weights
        with pytest.raises(AdapterError, match=r"unexpected|missing"):
            s.add_adapter_to_model(
                "z", {"r": 8, "target_modules": ["q_proj"]}, weights={"nope.lora_A.weight": torch.zeros(8, 128)}
            )
        assert "z" not in s.adapters

        s.remove_adapter("x")
        with pytest.raises(UnknownAdapterError):
            s.sample(chat_prompts[0], greedy(4), "x")
        assert same(outputs(s, chat_prompts, "y"), out_c)
        s.remove_adapter("y")
        # with no adapter left the model is back to its own modules
        assert not any("lora" in n for n, _ in s.model.named_parameters())
        assert same(outputs(s, chat_prompts), base)


# -- construction -----------------------------------------------------------------------------------
def test_parallel_meshes_point_at_remote_execution(tiny_llama: Path) -> None:
    with pytest.raises(InvalidMeshError, match="remote_group"):
        TorchSampler(tiny_llama, DeviceMesh.from_sizes(dp_size=2))
    with pytest.raises(InvalidMeshError, match="tensor parallelism"):
        TorchSampler(tiny_llama, DeviceMesh.from_sizes(tp_size=2))
    with pytest.raises(InvalidMeshError, match=r"unknown size\(s\) \['dp'\]"):
        TorchSampler(tiny_llama, {"dp": 2})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu:0"}, "device"),
        ({"max_batch_tokens": 0}, "max_batch_tokens"),
        ({"linear_kernel": "fast"}, "linear_kernel='fast'.*'auto', 'onednn', 'onednn-packed', 'torch'"),
        ({"attention_kernel": "flash"}, "attention_kernel='flash'.*'auto', 'native', 'sdpa'"),
        # a device torch knows but the engine does not run on: named, with what it runs on
        ({"device": "meta"}, "device='meta' is not supported by the torch engine: expected 'cpu', 'cuda'"),
        ({"device": "mps"}, "device='mps' is not supported"),
        ({"trust_remote_code": "false"}, "trust_remote_code='false' is invalid: expected True or False"),
        ({"dtype": torch.int8}, "dtype=torch.int8 is invalid: expected a floating-point dtype"),
        # an option neither the engine nor from_pretrained takes: named, with the engine's options
        ({"max_batch_token": 100}, "max_batch_token=100 is unknown.*max_batch_tokens.*Did you mean 'max_batch_tokens'"),
        ({"colour": "red"}, "colour='red' is unknown: the torch engine takes model_id, device_mesh"),
    ],
)
def test_bad_constructor_arguments(tiny_llama: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TorchSampler(tiny_llama, **kwargs)


def test_cpu_only_kernels_are_refused_on_a_cuda_device() -> None:
    """Asked for on CUDA, the oneDNN linears and the native attention are a ConfigError, never silently PyTorch's.

    The construction checks run on the resolved device; no CUDA is needed to call them with one.
    """
    from twinkle_torch.loading import attention_for as _attention_for
    from twinkle_torch.loading import check_linear_kernel as _check_linear_kernel

    cuda = torch.device("cuda", 0)
    for kernel in ("onednn", "onednn-packed"):
        with pytest.raises(ConfigError, match=f"linear_kernel='{kernel}' runs on CPU only, not on cuda:0"):
            _check_linear_kernel(kernel, cuda)
    for kernel in ("auto", "torch"):  # these mean PyTorch's matmul off the CPU
        _check_linear_kernel(kernel, cuda)
    with pytest.raises(ConfigError, match="attention_kernel='native' runs on CPU only, not on cuda:0"):
        _attention_for("native", cuda, {})
    assert _attention_for("auto", cuda, {}) is None  # transformers' choice on CUDA


def test_a_folder_that_holds_no_loadable_model_is_a_config_error(tiny_llama: Path, tmp_path: Path) -> None:
    """Each way a local folder can fail to be a model is named, not a traceback from transformers."""
    import json

    empty = tmp_path / "empty"
    empty.mkdir()
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    shutil.copy(tiny_llama / "config.json", config_only)
    bad_value = tmp_path / "bad-value"
    shutil.copytree(tiny_llama, bad_value)
    config = json.loads((bad_value / "config.json").read_text())
    (bad_value / "config.json").write_text(json.dumps({**config, "hidden_size": "x"}))
    bad_weights = tmp_path / "bad-weights"
    shutil.copytree(tiny_llama, bad_weights)
    (bad_weights / "model.safetensors").write_bytes(b"not safetensors")
    for folder, why in (
        (empty, "can read: Unrecognized model"),
        (config_only, "can load: .*no file named model.safetensors"),
        (bad_value, "can read: .*hidden_size"),
        (bad_weights, "can load: .*header"),
    ):
        with pytest.raises(ConfigError, match=f"{folder.name}' holds no model transformers {why}"):
            TorchSampler(folder, device="cpu")


def test_registered_as_torch(tiny_llama: Path) -> None:
    from twinkle_core import create_sampler

    with create_sampler("torch", model_id=str(tiny_llama), device="cpu", dtype="float32") as s:
        assert isinstance(s, TorchSampler) and s.engine_name == "torch"
        assert s.max_model_len == 512 and s.vocab_size == 768
        assert s.sample(Trajectory(messages=[{"role": "user", "content": "Hello!"}]), greedy(4))[0].sequences


# -- CUDA -------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="out-of-memory splitting needs CUDA")
def test_cuda_out_of_memory_shrinks_the_batch(tiny_llama: Path, chat_prompts: list[Trajectory]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, num_samples=64)
    with TorchSampler(tiny_llama, device="cuda", max_batch_tokens=10**9) as s:
        expected = tokens_of(s.sample(chat_prompts[:2], params.replace(num_samples=1)))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the fraction caps reserved memory: start from what is allocated
        total = torch.cuda.get_device_properties(0).total_memory
        used = torch.cuda.memory_allocated()
        # leave room for the model and a few rows, not for 128 rows of 450 tokens
        torch.cuda.set_per_process_memory_fraction(min(1.0, (used + 48 * 2**20) / total))
        stats = s.engine._decoder.stats = DecoderStats()
        try:
            out = s.sample(chat_prompts[:2], params)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        # the batch did not fit: rows went back to the queue and ran in a smaller batch
        assert stats.out_of_memory > 0 and stats.peak_rows < 128
        assert all(len(r.sequences) == 64 for r in out)
        assert [[seq.tokens for seq in r.sequences] for r in out] == [[e] * 64 for e in expected]


def test_constraints_that_empty_later_fail_every_run_batched_with_them(sampler: TorchSampler) -> None:
    """allowed_token_ids=[t] and a bad word tokenized [t, t]: the second token has nothing left to draw."""
    from twinkle_core.data_format import bad_word_token_ids
    from twinkle_core.errors import InvalidSamplingParams

    vocab = sampler.vocab_size
    assert vocab is not None
    token = next(
        t
        for t in range(3, vocab)
        if sampler.template.decode([t]).strip()
        and [t, t] in bad_word_token_ids(sampler.tokenizer, [sampler.template.decode([t]) * 2], vocab)
        and [t] not in bad_word_token_ids(sampler.tokenizer, [sampler.template.decode([t]) * 2], vocab)
    )
    word = sampler.template.decode([token]) * 2
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, allowed_token_ids=[token], bad_words=[word])
    handles = [sampler.submit([{"messages": [{"role": "user", "content": f"hi {i}"}]}], params) for i in range(3)]
    for handle in handles:  # each run with rows in the batch fails with the typed error, none hangs
        with pytest.raises(InvalidSamplingParams, match="no token to draw"):
            handle.result(timeout=60)
    out = sampler.sample([{"messages": [{"role": "user", "content": "hi"}]}], {"max_tokens": 3, "temperature": 0})
    assert len(out[0].sequences[0].tokens) == 3


def test_the_onednn_linear_kernel_scores_as_f_linear_does(tiny_llama: Path, chat_prompts: list[Trajectory]) -> None:
    """CPU models run their linear layers through oneDNN by default; ``linear_kernel='torch'`` keeps F.linear."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=2)
    scores = {}
    for kernel in ("torch", "auto", "onednn-packed"):
        with TorchSampler(tiny_llama, device="cpu", dtype="float32", linear_kernel=kernel) as s:
            own = [m for m in s.model.modules() if type(m) is torch.nn.Linear and "forward" in vars(m)]
            assert bool(own) == (kernel != "torch")
            scores[kernel] = [r.prompt_logprobs[1:] for r in s.sample(chat_prompts[:3], params)]
    for kernel in ("auto", "onednn-packed"):
        for plain, fast in zip(scores["torch"], scores[kernel]):
            assert fast == pytest.approx(plain, abs=1e-4)


def test_packed_weights_follow_every_weight_change(
    tiny_llama: Path, lora_dirs: dict[str, Path], chat_prompts: list[Trajectory]
) -> None:
    """``linear_kernel='onednn-packed'`` scores with the weights as they are: LoRA, a merge, an update, an unmerge."""
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)

    def scores(s: TorchSampler, adapter: str = "") -> list[float]:
        return [x for r in s.sample(chat_prompts[:3], params, adapter_name=adapter) for x in r.prompt_logprobs[1:]]

    def differ(a: list[float], b: list[float]) -> bool:
        return any(abs(x - y) > 1e-3 for x, y in zip(a, b))

    with (
        TorchSampler(tiny_llama, device="cpu", linear_kernel="onednn-packed") as packed,
        TorchSampler(tiny_llama, device="cpu") as dense,
    ):
        held = [m for m in packed.model.modules() if "_twinkle_packed" in vars(m)]
        assert len(held) == sum(type(m) is torch.nn.Linear for m in packed.model.modules())  # packed at load
        base = scores(packed)
        assert base == pytest.approx(scores(dense), abs=1e-4)
        changes: list[tuple[Any, str]] = [
            (lambda s: s.add_adapter_to_model("a", lora_dirs["a"]), "a"),  # PEFT's layers call the packed base
            (lambda s: (s.remove_adapter("a"), s.add_adapter_to_model("m", lora_dirs["b"], merge=True)), "m"),
            (lambda s: s.update_weights(_perturbed(tiny_llama)), "m"),  # pushed while merged
            (lambda s: s.remove_adapter("m"), ""),  # back to the pushed base
        ]
        last = base
        for change, adapter in changes:
            change(packed)
            change(dense)
            now = scores(packed, adapter)
            assert now == pytest.approx(scores(dense, adapter), abs=1e-4)
            assert differ(now, last)
            last = now


def test_a_bfloat16_model_with_large_logits_loads_and_samples(tiny_llama: Path, tmp_path: Path) -> None:
    """The load check allows for bfloat16's rounding, which grows with the logits (up to ~1000 here).

    Its prefill (SDPA) and decode steps (the native kernel, float32 inside)
    round differently: 4-8 nats apart at such logits, where a model reading
    the wrong keys is ~1000 apart. A fixed 1-nat tolerance refused it.
    """
    from safetensors.torch import load_file, save_file

    scaled = tmp_path / "large-logits"
    shutil.copytree(tiny_llama, scaled)
    state = load_file(str(scaled / "model.safetensors"))
    state["lm_head.weight"] = state["lm_head.weight"] * 100
    save_file(state, str(scaled / "model.safetensors"), metadata={"format": "pt"})
    with TorchSampler(scaled, device="cpu", dtype="bfloat16") as s:
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=1, logprobs=0, ignore_eos=True)
        out = s.sample([{"messages": [{"role": "user", "content": "hi"}]}], params)
        assert len(out[0].sequences[0].tokens) == 4
        assert all(math.isfinite(x) for x in out[0].sequences[0].logprobs or [])


def test_a_packed_linear_sees_its_weight_change() -> None:
    """A packed copy is remade after an in-place write, a ``.data =`` swap, a new parameter; drop_packed frees it."""
    from twinkle_torch.linear import drop_packed, use_onednn

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    model = torch.nn.Sequential(layer)
    assert use_onednn(model, packed=True) == 1
    x = torch.randn(5, 16)

    def check() -> None:
        with torch.inference_mode():
            got = layer(x)
        assert torch.allclose(got, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)

    check()
    with torch.no_grad():
        layer.weight.mul_(-2)
    check()
    with torch.inference_mode():
        layer.weight.copy_(torch.randn(8, 16))
    check()
    layer.weight.data = torch.randn(8, 16)
    check()
    layer.weight = torch.nn.Parameter(torch.randn(8, 16))
    check()
    layer.weight.data += 1  # bumps no version counter: not seen until the copy is dropped
    assert drop_packed(model) == 1 and drop_packed(model) == 0
    check()
    with torch.inference_mode():  # an inference tensor has no version counter: the dense weight runs
        layer.weight = torch.nn.Parameter(torch.randn(8, 16))
        check()
        assert drop_packed(model) == 0  # the copy of the weight it replaced is gone too
        layer.weight.mul_(3)
        check()


def test_the_onednn_linear_falls_back_where_it_does_not_apply() -> None:
    from twinkle_torch.linear import use_onednn

    layer = torch.nn.Linear(16, 8)
    assert use_onednn(torch.nn.Sequential(layer)) == 1
    x = torch.randn(3, 16, requires_grad=True)
    out = layer(x)  # autograd: the kernel has no backward, F.linear runs
    assert torch.equal(out, torch.nn.functional.linear(x, layer.weight, layer.bias))
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    with torch.inference_mode():
        half = torch.randn(3, 16, dtype=torch.float16)
        with pytest.raises(RuntimeError):  # mixed dtypes fail as F.linear fails, not silently
            layer(half)
        fast = layer(x.detach())
    assert torch.allclose(fast, torch.nn.functional.linear(x.detach(), layer.weight, layer.bias), atol=1e-6)
