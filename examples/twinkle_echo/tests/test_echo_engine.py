"""What the echo engine does beyond the shared contract: its tokenizer, its
template, its toy model and the finer points of each sampling option."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest

from twinkle_core import InputFeature, SamplingParams, Trajectory
from twinkle_core.errors import ConfigError, InvalidInputError, UnsupportedFeatureError
from twinkle_echo import EchoSampler, EchoTokenizer
from twinkle_echo.tokenizer import ECHO_CHAT_TEMPLATE, IM_END_ID, IM_START_ID, render_chatml


@pytest.fixture(scope="module")
def sampler() -> Iterator[EchoSampler]:
    engine = EchoSampler()
    with engine:  # Sampler.__enter__ is typed to return Sampler, so keep our own reference
        yield engine


def chat(text: str) -> Trajectory:
    return Trajectory(messages=[{"role": "user", "content": text}])


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)  # type: ignore[arg-type]


# -- tokenizer ---------------------------------------------------------------------------
def test_tokenizer_round_trip_bytes_and_specials() -> None:
    tok = EchoTokenizer()
    text = "<|im_start|>user\nCafé ☕<|im_end|>\n<|reserved_3|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == IM_START_ID and IM_END_ID in ids and max(ids) == 256 + 3 + 3
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "user\nCafé ☕\n"
    assert len(tok) == 300 and tok.eos_token_id == IM_END_ID
    with pytest.raises(ValueError, match="300"):
        tok.decode([300])
    with pytest.raises(ValueError, match="vocab_size"):
        EchoTokenizer(100)


def test_partial_utf8_decodes_to_replacement_character() -> None:
    tok = EchoTokenizer()
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"


CONVERSATIONS = [
    ([{"role": "user", "content": "hi"}], None),
    (
        [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "add", "arguments": {"x": 1, "y": "é"}}},
                    {"type": "function", "function": {"name": "neg", "arguments": '{"x": 2}'}},
                ],
            },
            {"role": "tool", "content": "3"},
        ],
        [{"type": "function", "function": {"name": "add", "description": "x+y", "parameters": {}}}],
    ),
    (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "ok", "tool_calls": [{"name": "f", "arguments": {}}]},
        ],
        [{"name": "f"}],
    ),
]


@pytest.mark.parametrize("messages,tools", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_hand_written_chatml_matches_its_jinja_source(
    messages: list[dict[str, object]], tools: list[dict[str, object]] | None, add_generation_prompt: bool
) -> None:
    pytest.importorskip("jinja2")
    from twinkle_echo.tokenizer import _render_jinja

    context = {"messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt}
    assert render_chatml(messages, tools, add_generation_prompt) == _render_jinja(ECHO_CHAT_TEMPLATE, **context)


def test_template_encodes_chatml(sampler: EchoSampler) -> None:
    feature = sampler.template.encode(chat("hi"))
    assert sampler.template.decode(feature.input_ids, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_another_registered_template_renders_with_jinja() -> None:
    pytest.importorskip("jinja2")
    with EchoSampler(template="chatml") as s:
        out = s.sample(chat("Count to five."), greedy(max_tokens=4))[0]
        assert out.prompt_token_ids[0] == IM_START_ID and len(out.sequences[0].tokens) == 4


# -- the toy model -----------------------------------------------------------------------
def test_greedy_echoes_the_last_user_message_then_ends_the_turn(sampler: EchoSampler) -> None:
    seq = sampler.sample(chat("Count to five."), greedy(max_tokens=64))[0].sequences[0]
    assert seq.text == "Count to five."
    assert seq.stop_reason == "stop" and seq.stop == IM_END_ID and seq.tokens[-1] == IM_END_ID


def test_raw_token_prompts_are_continued_by_induction(sampler: EchoSampler) -> None:
    ids = sampler.tokenizer.encode("abcd abcd ab")
    seq = sampler.sample(InputFeature(input_ids=ids), greedy(max_tokens=5))[0].sequences[0]
    assert seq.text == "cd ab"


def test_model_id_and_seed_make_different_models() -> None:
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=0, logprobs=0)
    a = EchoSampler().sample(chat("Tell me a story."), params)[0].sequences[0]
    b = EchoSampler("other").sample(chat("Tell me a story."), params)[0].sequences[0]
    c = EchoSampler(seed=1).sample(chat("Tell me a story."), params)[0].sequences[0]
    assert a.logprobs != b.logprobs and a.logprobs != c.logprobs


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"vocab_size": 10}, "vocab_size"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"seed": "x"}, "seed"),
        ({"model_id": 3}, "model_id"),
    ],
)
def test_bad_constructor_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EchoSampler(**kwargs)  # type: ignore[arg-type]


# -- sampling options ----------------------------------------------------------------------
def test_sample_i_has_its_own_seeded_stream(sampler: EchoSampler) -> None:
    params = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, seed=40)
    many = sampler.sample(chat("Tell me a story."), params, num_samples=3)[0].sequences
    for i, seq in enumerate(many):  # the same stream alone and as one of several, and not seed 40 + i's first
        again = sampler.sample([chat("Hi."), chat("Tell me a story.")], params, num_samples=3)[1].sequences[i]
        assert seq.tokens == again.tokens
        if i:
            alone = sampler.sample(chat("Tell me a story."), params.replace(seed=40 + i))[0].sequences[0]
            assert seq.tokens != alone.tokens
    negative = sampler.sample(chat("Tell me a story."), params.replace(seed=-40))[0].sequences[0]
    assert negative.tokens != many[0].tokens


@pytest.mark.parametrize("truncation", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}])
def test_truncation_to_one_token_is_greedy(sampler: EchoSampler, truncation: dict[str, float]) -> None:
    ref = sampler.sample(chat("Count to five."), greedy(max_tokens=10, ignore_eos=True))[0].sequences[0]
    params = SamplingParams(temperature=2.0, max_tokens=10, ignore_eos=True, seed=3, logprobs=2).replace(**truncation)
    seq = sampler.sample(chat("Count to five."), params)[0].sequences[0]
    assert seq.tokens == ref.tokens
    assert seq.logprobs == [0.0] * 10
    assert all(top[1][1] == -math.inf for top in seq.top_logprobs or [])


def test_top_p_keeps_the_smallest_nucleus(sampler: EchoSampler) -> None:
    params = SamplingParams(temperature=3.0, top_p=0.5, max_tokens=12, ignore_eos=True, seed=1, logprobs=300)
    proc = sampler.sample(chat("Tell me a story."), params)[0].sequences[0]
    raw = sampler.sample(chat("Tell me a story."), params.replace(logprobs_mode="raw"))[0].sequences[0]
    assert proc.tokens == raw.tokens
    for top_proc, top_raw in zip(proc.top_logprobs or [], raw.top_logprobs or []):
        # the temperature-3 distribution, rebuilt from the raw log-probs
        weights = [(t, math.exp(lp / 3.0)) for t, lp in top_raw]
        total = sum(w for _, w in weights)
        nucleus, mass = set(), 0.0
        for t, w in sorted(weights, key=lambda x: -x[1]):
            if mass >= 0.5:
                break
            nucleus.add(t)
            mass += w / total
        kept = {t for t, lp in top_proc if lp > -math.inf}
        assert kept == nucleus and 1 < len(kept) < 300
        assert sum(math.exp(lp) for t, lp in top_proc if t in kept) == pytest.approx(1.0)


def test_min_p_drops_tokens_below_a_fraction_of_the_top(sampler: EchoSampler) -> None:
    params = SamplingParams(temperature=3.0, min_p=0.1, max_tokens=12, ignore_eos=True, seed=2, logprobs=300)
    proc = sampler.sample(chat("Tell me a story."), params)[0].sequences[0]
    raw = sampler.sample(chat("Tell me a story."), params.replace(logprobs_mode="raw"))[0].sequences[0]
    assert proc.tokens == raw.tokens
    sizes = []
    for top_proc, top_raw in zip(proc.top_logprobs or [], raw.top_logprobs or []):
        # min-p compares each token's temperature-3 probability with the top one's
        best = max(lp for _, lp in top_raw) / 3.0
        expected = {t for t, lp in top_raw if lp / 3.0 - best >= math.log(0.1)}
        kept = {t for t, lp in top_proc if lp > -math.inf}
        assert kept == expected
        sizes.append(len(kept))
    assert max(sizes) > 1 and max(sizes) < 300


def test_repetition_penalty_changes_greedy_and_processed_only(sampler: EchoSampler) -> None:
    plain = sampler.sample(chat("aaaa"), greedy(max_tokens=6, ignore_eos=True, logprobs=0))[0].sequences[0]
    params = greedy(max_tokens=6, ignore_eos=True, logprobs=0, repetition_penalty=3.0)
    proc = sampler.sample(chat("aaaa"), params)[0]
    raw = sampler.sample(chat("aaaa"), params.replace(logprobs_mode="raw"))[0]
    assert plain.text.startswith("aaaa") and not proc.sequences[0].text.startswith("aaaa")
    assert proc.sequences[0].tokens == raw.sequences[0].tokens
    # raw log-probs are the model's own: scoring the sequence gives them back
    full = InputFeature(input_ids=proc.prompt_token_ids + raw.sequences[0].tokens)
    scored = sampler.sample(full, SamplingParams(max_tokens=0, prompt_logprobs=0))[0].prompt_logprobs or []
    assert scored[len(proc.prompt_token_ids) :] == pytest.approx(raw.sequences[0].logprobs)
    assert proc.sequences[0].logprobs != pytest.approx(raw.sequences[0].logprobs)


def test_stop_token_text_is_left_out_but_token_kept(sampler: EchoSampler) -> None:
    space = ord(" ")
    seq = sampler.sample(chat("Count to five."), greedy(max_tokens=20, stop_token_ids=[space]))[0].sequences[0]
    assert seq.tokens[-1] == space and seq.stop == space and seq.stop_reason == "stop"
    assert seq.text == "Count"


def test_earliest_stop_string_wins_even_inside_a_character(sampler: EchoSampler) -> None:
    seq = sampler.sample(chat("Café au lait."), greedy(max_tokens=20, stop=["lait", "é a"]))[0].sequences[0]
    assert seq.stop == "é a" and seq.text == "Caf"
    assert sampler.template.decode(seq.tokens) == "Café a"


def test_context_window_ends_with_length(sampler: EchoSampler) -> None:
    prompt = InputFeature(input_ids=[ord("x")] * (sampler.max_model_len - 3))
    seq = sampler.sample(prompt, greedy(max_tokens=10, ignore_eos=True))[0].sequences[0]
    assert len(seq.tokens) == 3 and seq.stop_reason == "length"


def test_scoring_only_returns_empty_sequences(sampler: EchoSampler) -> None:
    out = sampler.sample(chat("hi"), SamplingParams(max_tokens=0, prompt_logprobs=1), num_samples=2)[0]
    assert [s.tokens for s in out.sequences] == [[], []]
    assert all(s.stop_reason == "length" and s.text == "" for s in out.sequences)
    assert out.prompt_top_logprobs is not None and len(out.prompt_top_logprobs[1] or []) == 1


def test_prompt_logprobs_are_raw_whatever_the_mode(sampler: EchoSampler) -> None:
    base = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.5, top_k=2)
    a = sampler.sample(chat("hi"), base)[0].prompt_logprobs
    b = sampler.sample(chat("hi"), base.replace(logprobs_mode="raw", temperature=1.0, top_k=-1))[0].prompt_logprobs
    assert a == b


def test_out_of_vocabulary_prompt_is_rejected(sampler: EchoSampler) -> None:
    with pytest.raises(InvalidInputError, match="outside the vocabulary"):
        sampler.sample(InputFeature(input_ids=[1, 300]), greedy(max_tokens=1))


def test_no_adapters_no_weight_updates(sampler: EchoSampler) -> None:
    with pytest.raises(UnsupportedFeatureError, match="echo"):
        sampler.add_adapter_to_model("a", "/nowhere")
    with pytest.raises(UnsupportedFeatureError, match="echo"):
        sampler.update_weights({"w": [1.0]})
    assert sampler.weights_version == 0 and not sampler.adapters
    assert len(sampler.sample(chat("hi"), greedy(max_tokens=2))[0].sequences[0].tokens) == 2
