"""Faults and bad input on the torch engine: nothing wrong is ever returned, nothing is lost."""

from __future__ import annotations

import asyncio
import math
import signal
import time
from pathlib import Path

import attrs
import pytest
import torch
from safetensors.torch import load_file

from twinkle_core import InputFeature, SamplingParams, Trajectory
from twinkle_core.errors import (
    IncompleteUpdateError,
    InvalidInputError,
    InvalidSamplingParams,
    NumericalError,
    TemplateError,
    WeightUpdateError,
)
from twinkle_core.testing.faults import check_refused_changes, failing_when_copied, run_soak, soak_seconds
from twinkle_torch import TorchSampler
from twinkle_torch.decoding import DecoderStats


def _states(model_dir: Path) -> list[dict[str, torch.Tensor]]:
    state = load_file(str(model_dir / "model.safetensors"))
    head = state["lm_head.weight"] if "lm_head.weight" in state else state["model.embed_tokens.weight"]
    swapped = head.clone()
    top = torch.arange(head.shape[0])
    swapped[top] = head[top.flip(0)]  # a permuted output layer: every greedy choice moves
    key = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"
    return [state, {**state, key: swapped}]


def test_refused_weights_and_adapters_change_nothing(
    tiny_llama: Path, chat_prompts: list[Trajectory], lora_dirs: dict[str, Path]
) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        check_refused_changes(s, chat_prompts[:3], _states(tiny_llama)[0], lora_dirs["a"])


def test_one_bad_input_does_not_lose_the_batch(tiny_llama: Path, chat_prompts: list[Trajectory]) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        good = chat_prompts[0]
        bad = [
            {"messages": [{"role": "user", "content": "\ud800"}]},  # a lone surrogate no tokenizer can encode
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": 1}]},
            {"messages": [{"role": "wizard", "content": "hi"}]},
            {"messages": [{"content": "no role"}]},
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", "parameters": {"d": "\ud800"}}]},
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f", "parameters": {"d": object()}}]},
            42,
        ]
        out = s.sample([good, *bad, good], {"max_tokens": 3, "temperature": 0}, on_invalid="skip")
        assert len(out) == len(bad) + 2
        assert out[0].sequences and out[-1].sequences and out[0].sequences[0].tokens == out[-1].sequences[0].tokens
        for k, resp in enumerate(out[1:-1], start=1):
            assert resp.error and f"inputs[{k}]" in resp.error and not resp.sequences, resp
        for item in bad:
            with pytest.raises(InvalidInputError):
                s.sample([good, item], {"max_tokens": 1})
        for template, options in ((5, {}), ("chatml", {"no_such_option": 1})):
            with pytest.raises(TemplateError):
                s.set_template(template, **options)  # type: ignore[arg-type]
        assert s.sample(good, {"max_tokens": 3, "temperature": 0})[0].sequences[0].tokens == out[0].sequences[0].tokens


@pytest.mark.parametrize(
    "params",
    [
        {"logprobs": 10**9},
        {"logprobs": 769},
        {"prompt_logprobs": 10**6},
        {"temperature": 1e-300},
        {"stop_token_ids": [2**70]},
        {"stop_token_ids": [768]},
        {"num_samples": 10**6},
        {"max_tokens": 2**64},
        {"logprobs": 768, "num_samples": 4096, "max_tokens": 500},  # each valid; together ~1.6e9 alternatives
    ],
    ids=lambda p: next(iter(p)),
)
def test_values_beyond_limits_are_refused_before_any_allocation(tiny_llama: Path, params: dict) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        with pytest.raises(InvalidSamplingParams, match=next(iter(params))):
            s.sample(InputFeature(input_ids=[1, 2, 3]), params)
        assert len(s.sample(InputFeature(input_ids=[1, 2, 3]), {"max_tokens": 2})[0].sequences[0].tokens) == 2


def test_logprobs_up_to_the_vocabulary_work(tiny_llama: Path) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        seq = s.sample(InputFeature(input_ids=[1, 2, 3]), SamplingParams(max_tokens=2, logprobs=s.vocab_size))[0]
        assert len(seq.sequences[0].top_logprobs[0]) == s.vocab_size


@pytest.mark.soak
def test_soak_every_sequence_matches_its_weights_and_adapter(
    tiny_llama: Path, chat_prompts: list[Trajectory], lora_dirs: dict[str, Path]
) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        report = run_soak(
            s, chat_prompts[:3], _states(tiny_llama), {"a": lora_dirs["a"], "b": lora_dirs["b"]}, seconds=soak_seconds()
        )
    assert report.sequences > 0 and report.updates > 0 and report.swaps > 0, report


_LONG = {"max_tokens": 480, "ignore_eos": True, "num_samples": 64}
_GREEDY = {"max_tokens": 8, "temperature": 0}


def _steps_stay(stats: DecoderStats, settle_s: float = 0.5) -> bool:
    """Whether the decode loop runs no forward for ``settle_s`` (after the grace of a step in flight).

    The grace is generous: on a loaded machine (CI's two cores) a step of 64 rows can take 0.2 s.
    """
    time.sleep(1.0)
    steps = stats.steps
    time.sleep(settle_s)
    return stats.steps == steps


def test_ctrl_c_in_sample_ends_the_calls_rows(
    tiny_llama: Path, chat_prompts: list[Trajectory], lora_dirs: dict[str, Path]
) -> None:
    """An interrupted ``sample()`` leaves nothing decoding behind it: no forward runs for it afterwards, and an
    adapter loaded next never serves a call labelled as the base model (rows left running used to let it)."""
    with TorchSampler(tiny_llama, device="cpu") as s:
        base = s.sample(chat_prompts[0], _GREEDY)[0].sequences[0].tokens
        stats = s.engine._decoder.stats

        def interrupt(*_: object) -> None:
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(KeyboardInterrupt):
                s.sample(chat_prompts[1], _LONG)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        assert _steps_stay(stats)
        s.add_adapter_to_model("b", lora_dirs["b"])
        again = s.sample(chat_prompts[0], _GREEDY)[0].sequences[0]
        assert again.tokens == base and again.adapter_name == ""
        assert s.sample(chat_prompts[0], _GREEDY, adapter_name="b")[0].sequences[0].adapter_name == "b"


def test_cancelling_asample_aborts_its_call(tiny_llama: Path, chat_prompts: list[Trajectory]) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        stats = s.engine._decoder.stats

        async def cancel_while_decoding() -> None:
            task = asyncio.ensure_future(s.asample(chat_prompts[1], _LONG))
            start, deadline = stats.steps, time.monotonic() + 60
            while stats.steps < start + 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        asyncio.run(cancel_while_decoding())
        assert _steps_stay(stats)
        assert len(s.sample(chat_prompts[0], _GREEDY)[0].sequences[0].tokens) == 8


def test_update_weights_takes_float8_and_refuses_what_is_not_tensors(tiny_llama: Path) -> None:
    with TorchSampler(tiny_llama, device="cpu") as s:
        version = s.weights_version
        for bad in (None, 5, "weights"):
            with pytest.raises(WeightUpdateError, match="expected a mapping"):
                s.update_weights(bad)  # type: ignore[arg-type]
        name = "model.layers.0.mlp.down_proj.weight"
        sent = s.model.state_dict()[name].to(torch.float8_e4m3fn)
        assert s.update_weights({name: sent}) == version + 1
        assert torch.equal(s.model.state_dict()[name], sent.float())


def test_a_padded_feature_samples_as_its_unpadded_prompt(tiny_llama: Path) -> None:
    """A feature from a padded batch (``attention_mask`` 0 on the pads) samples its prompt alone; a mask that
    cannot mean padding is refused, not ignored."""
    prompt = [1, 281, 201, 302, 283, 286]
    params = {"max_tokens": 6, "temperature": 0, "logprobs": 0, "prompt_logprobs": 0}
    with TorchSampler(tiny_llama, device="cpu") as s:
        plain = s.sample(InputFeature(input_ids=prompt), params)[0]
        for ids, mask in (([0, 0, *prompt], [0, 0, *[1] * 6]), ([*prompt, 0, 0], [*[1] * 6, 0, 0])):
            padded = s.sample(InputFeature(input_ids=ids, attention_mask=mask), params)[0]
            assert padded.prompt_token_ids == prompt
            assert padded.sequences[0].tokens == plain.sequences[0].tokens
            assert padded.sequences[0].logprobs == pytest.approx(plain.sequences[0].logprobs, abs=1e-5)
            assert padded.prompt_logprobs == pytest.approx(plain.prompt_logprobs, abs=1e-5)
        for mask, why in (([1, 1, 0, 1, 1, 1], "between"), ([7, 1, 1, 1, 1, 1], "holds 7"), ([0] * 6, "no tokens")):
            with pytest.raises(InvalidInputError, match=why):
                s.sample(InputFeature(input_ids=prompt, attention_mask=mask), params)
        out = s.sample(
            [InputFeature(input_ids=prompt, attention_mask=[1, 0, 1, 1, 1, 1]), InputFeature(input_ids=prompt)],
            params,
            on_invalid="skip",
        )
        assert out[0].error and "attention_mask" in out[0].error and out[1].sequences[0].tokens


def test_removing_an_adapter_under_keep_returns_what_its_calls_generated(
    tiny_llama: Path, chat_prompts: list[Trajectory], lora_dirs: dict[str, Path]
) -> None:
    """``keep`` continues calls after a change; a call whose adapter is gone cannot continue, so its sequences
    end as an abort ends them (tokens kept, labelled with the adapter that made them), not as an error."""
    with TorchSampler(tiny_llama, device="cpu") as s:
        s.add_adapter_to_model("a", lora_dirs["a"])
        stats = s.engine._decoder.stats
        handle = s.submit(chat_prompts[1], {**_LONG, "num_samples": 2}, adapter_name="a")
        deadline = time.monotonic() + 60
        while stats.steps < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        s.remove_adapter("a", in_flight="keep")
        sequences = handle.result(timeout=60)[0].sequences
        assert [q.stop_reason for q in sequences] == ["abort", "abort"]
        assert all(q.tokens and q.adapter_name == "a" for q in sequences)
        assert sorted(len(f.sequence.tokens) for f in handle.as_completed()) == sorted(len(q.tokens) for q in sequences)
        assert "a" not in s.adapters


@pytest.mark.parametrize("include_stop", [False, True])
def test_a_continued_sequence_stops_and_reads_as_the_uninterrupted_one(
    tiny_llama: Path, chat_prompts: list[Trajectory], include_stop: bool
) -> None:
    """A sequence continued after an abort (``resume()``, ``keep``) joins its parts as if never stopped: a stop
    string begun before the join and completed after it ends it, and the text follows the call's text options."""
    from twinkle_core.sampler.continuation import merge_sequences

    with TorchSampler(tiny_llama, device="cpu") as s:
        plain = {"max_tokens": 30, "temperature": 0, "ignore_eos": True, "skip_special_tokens": False}
        whole = s.sample(chat_prompts[0], plain)[0]
        tokens, prompt = whole.sequences[0].tokens, whole.prompt_token_ids
        text = s.template.decode(tokens, skip_special_tokens=False)
        # a join after token k, and a stop string of the text on both sides of it (its first occurrence)
        k, stop = next(
            (k, text[len(head) - 2 : len(head) + 2])
            for k in range(2, len(tokens) - 4)
            for head in [s.template.decode(tokens[:k], skip_special_tokens=False)]
            if len(head) >= 2 and text.find(text[len(head) - 2 : len(head) + 2]) == len(head) - 2
        )
        params = SamplingParams(**plain, stop=[stop], include_stop_str_in_output=include_stop)
        reference = s.sample(chat_prompts[0], params)[0].sequences[0]
        assert reference.stop == stop and len(reference.tokens) > k
        first = s.sample(InputFeature(input_ids=prompt), params.replace(max_tokens=k))[0].sequences[0]
        assert first.tokens == tokens[:k] and first.stop is None
        first = attrs.evolve(first, stop_reason="abort")
        rest = s.sample(InputFeature(input_ids=prompt + tokens[:k]), params.replace(max_tokens=30 - k))[0]
        merged = merge_sequences(
            prompt, first, rest.sequences[0], params=params, template=s.template, make_sequence=s._sequences.make
        )
        assert (merged.tokens, merged.text, merged.stop, merged.stop_reason) == (
            reference.tokens,
            reference.text,
            reference.stop,
            reference.stop_reason,
        )
        assert merged.text.endswith(stop) == include_stop


def test_asample_takes_adapter_path_as_sample_does(
    tiny_llama: Path, chat_prompts: list[Trajectory], lora_dirs: dict[str, Path]
) -> None:
    scored = {**_GREEDY, "logprobs": 0}
    with TorchSampler(tiny_llama, device="cpu") as s:
        expected = s.sample(chat_prompts[0], scored, adapter_path=lora_dirs["b"])[0].sequences[0]
        got = asyncio.run(s.asample(chat_prompts[0], scored, adapter_path=lora_dirs["b"]))[0].sequences[0]
        assert got.adapter_name == expected.adapter_name == f"path:{lora_dirs['b'].resolve()}"
        assert (got.tokens, got.logprobs) == (expected.tokens, expected.logprobs)
        # the adapter is what scored them: the base model's own log-probs of the same tokens differ
        whole = InputFeature(input_ids=expected.training_feature.input_ids)
        base = s.sample(whole, {"max_tokens": 0, "prompt_logprobs": 0})[0].prompt_logprobs
        assert base[-len(got.tokens) :] != pytest.approx(got.logprobs, abs=1e-4)


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_update_that_fails_part_way_refuses_sampling_until_pushed_again(
    tiny_llama: Path, chat_prompts: list[Trajectory], error: type[BaseException]
) -> None:
    """An update interrupted after some tensors were copied leaves a mix that no version names: no sample may
    carry the old version's label over it. Calls in flight under ``keep`` keep what the old weights made."""
    scored = {**_GREEDY, "logprobs": 0}
    with TorchSampler(tiny_llama, device="cpu") as s:
        original = {k: v.clone() for k, v in s.model.state_dict().items()}
        generator = torch.Generator().manual_seed(0)
        new = {k: v + 0.05 * torch.randn(v.shape, generator=generator) for k, v in original.items()}
        last = list(new)[-1]
        failing = {**new, last: failing_when_copied(new[last], error("interrupted while copying"))}
        before = s.sample(chat_prompts[0], scored)[0].sequences[0]
        version, stats = s.weights_version, s.engine._decoder.stats
        start = stats.steps
        handle = s.submit(chat_prompts[1], {**_LONG, "num_samples": 2})
        deadline = time.monotonic() + 60
        while stats.steps < start + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(error, match="interrupted while copying"):
            s.update_weights(failing, in_flight="keep")
        assert s.weights_version == version
        sequences = handle.result(timeout=60)[0].sequences
        assert all(q.stop_reason == "abort" and q.tokens and q.weights_version == version for q in sequences)
        why = rf"version {version + 1} failed part-way \({error.__name__}.*Sampling is refused"
        with pytest.raises(IncompleteUpdateError, match=why):
            s.sample(chat_prompts[0], scored)
        # some of the tensors are not enough; all of them bring sampling back, on exactly the weights pushed
        s.update_weights({last: new[last]})
        with pytest.raises(IncompleteUpdateError, match=why):
            s.sample(chat_prompts[0], scored)
        s.update_weights(new)
        recovered = s.sample(chat_prompts[0], scored)[0].sequences[0]
        assert recovered.weights_version == s.weights_version
        s.update_weights(original)
        assert s.sample(chat_prompts[0], scored)[0].sequences[0].logprobs == before.logprobs
        s.update_weights(new)
        again = s.sample(chat_prompts[0], scored)[0].sequences[0]
        assert (again.tokens, again.logprobs) == (recovered.tokens, recovered.logprobs)
        assert again.logprobs != before.logprobs


def test_weights_that_overflow_in_the_forward_fail_their_call_not_the_engine(
    tiny_llama: Path, chat_prompts: list[Trajectory]
) -> None:
    """Finite weights may still overflow to NaN in the forward: the call gets a typed error (greedy used to
    return token 0 with NaN log-probs; a sampled draw raised an IndexError; scoring returned NaN prompt
    log-probs), and the engine goes on."""
    from twinkle_core.testing.policy import checkpoint_weights, random_lora

    with TorchSampler(tiny_llama, device="cpu") as s:
        base = s.sample(chat_prompts[0], {**_GREEDY, "logprobs": 0})[0].sequences[0]
        config, weights = random_lora(checkpoint_weights(tiny_llama), ("q_proj", "v_proj"), seed=0)
        s.add_adapter_to_model(
            "huge", {**config, "lora_alpha": 1e30}, weights={k: v * 1e30 for k, v in weights.items()}
        )
        scoring = {"max_tokens": 0, "prompt_logprobs": 1}
        sampled = ({**_GREEDY, "logprobs": 0}, {"max_tokens": 8}, {"max_tokens": 8, "top_p": 0.9, "top_k": 5})
        for params in (*sampled, scoring):
            with pytest.raises(NumericalError, match="NaN or infinity with adapter 'huge'"):
                s.sample(chat_prompts[0], params, adapter_name="huge")
        again = s.sample(chat_prompts[0], {**_GREEDY, "logprobs": 0})[0].sequences[0]
        assert (again.tokens, again.logprobs) == (base.tokens, base.logprobs)
        norm = s.model.state_dict()["model.norm.weight"].clone()
        s.update_weights({"model.norm.weight": torch.full_like(norm, 3e38)})
        for params in ({"max_tokens": 8, "num_samples": 2}, scoring):
            with pytest.raises(NumericalError, match="NaN or infinity:"):
                s.sample(chat_prompts[:2], params)
        s.update_weights({"model.norm.weight": norm})
        assert s.sample(chat_prompts[0], _GREEDY)[0].sequences[0].tokens == base.tokens
        scored = s.sample(chat_prompts[0], scoring)[0].prompt_logprobs
        assert scored is not None and all(math.isfinite(v) for v in scored[1:])
