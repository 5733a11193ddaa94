"""Token-exact episodes on real engines: the torch engine on the tiny model, and the echo engine.

The echo engine repeats the latest user message, so a test can make "the
model" sample exactly the text it needs (reasoning blocks, malformed tool
calls) through a real engine.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from twinkle_core import SamplingParams, Template, TemplateError
from twinkle_core.data_format import IGNORE_INDEX
from twinkle_core.episode import Episode, asample_episodes, sample_episodes
from twinkle_core.errors import InvalidInputError
from twinkle_core.testing.expect import tool_calls_of
from twinkle_core.testing.tiny_model import TINY_WEATHER_TOOL as WEATHER
from twinkle_core.tools import (
    HermesToolParser,
    ParsedToolCalls,
    ToolCallParser,
    UnknownToolParserError,
    get_tool_parser,
    tool_parser_registry,
)

if importlib.util.find_spec("twinkle_echo") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "twinkle_echo"))

GREEDY = SamplingParams(temperature=0.0, max_tokens=48)

#: ChatML that, like Qwen3's template, drops the reasoning of assistant turns that are not the last message.
STRIP_THINK_JINJA = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.role == 'assistant' and not loop.last %}{{ message.content.split('</think>')[-1] }}"
    "{%- else %}{{ message.content }}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def torch_sampler() -> Iterator[Any]:
    from twinkle_core.testing import build_tiny_model
    from twinkle_torch.sampler import TorchSampler

    with TorchSampler(build_tiny_model("llama"), device="cpu") as s:
        yield s


@pytest.fixture(scope="module")
def echo() -> Iterator[Any]:
    from twinkle_echo import EchoSampler

    with EchoSampler() as s:
        yield s


def weather_episode(sampler: Any, **kw: Any) -> Episode:
    return Episode(
        sampler, {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER]}, **kw
    )


def test_tool_loop_is_token_exact(torch_sampler: Any) -> None:
    ep = weather_episode(torch_sampler)
    prompt_ids = torch_sampler.template.encode(ep.trajectory()).input_ids
    [same] = ep.sample(torch_sampler, GREEDY)
    assert same is ep
    first = ep.last_turn
    assert first is not None and first.tool_call_errors == []
    # the calls the engine itself makes for this conversation, whichever city the tiny model names
    expected = tool_calls_of(torch_sampler, {"input_ids": prompt_ids}, GREEDY)
    assert [c["function"] for c in first.tool_calls] == expected
    # What the engine returns for that prompt is what the episode holds, token for token.
    direct = torch_sampler.sample({"input_ids": prompt_ids}, GREEDY.replace(logprobs=0))[0].sequences[0]
    assert first.tokens == direct.tokens and first.logprobs == direct.logprobs

    ep.add_tool_result("20 degrees and sunny", tool_call_id=first.tool_calls[0]["id"])
    ep.sample(torch_sampler, GREEDY)
    before = ep.tokens[: ep.turns[1].start]  # type: ignore[union-attr]
    again = torch_sampler.sample({"input_ids": before}, GREEDY)[0].sequences[0]
    assert ep.last_turn.tokens == again.tokens  # type: ignore[union-attr]

    feature = ep.training_feature()
    # The tokens are the concatenation of what was encoded, sampled and appended.
    assert feature.input_ids == [t for seg in ep.segments for t in seg.tokens]
    assert [s.kind for s in ep.segments] == ["prompt", "sampled", "closing", "delta", "sampled"]
    assert feature.input_ids[: len(prompt_ids)] == prompt_ids
    sampled = [i for i, m in enumerate(feature.extra["loss_mask"]) if m]
    assert sampled == [*range(ep.turns[0].start, ep.turns[0].end), *range(ep.turns[1].start, ep.turns[1].end)]
    assert [feature.input_ids[i] for i in sampled] == ep.turns[0].tokens + ep.turns[1].tokens
    assert [feature.labels[i] for i in range(len(feature)) if i not in set(sampled)] == [IGNORE_INDEX] * (
        len(feature) - len(sampled)
    )
    assert [feature.extra["logprobs"][i] for i in sampled] == ep.turns[0].logprobs + ep.turns[1].logprobs
    assert all(feature.extra["logprobs"][i] is None for i in range(len(feature)) if i not in set(sampled))
    assert [t["weights_version"] for t in feature.extra["turns"]] == [0, 0]
    # A prefix-preserving template: the exact tokens decode to the template's own rendering.
    rendered = torch_sampler.template.render(ep.trajectory(), add_generation_prompt=False)
    assert torch_sampler.template.decode(feature.input_ids, skip_special_tokens=False) + "\n" == rendered


def test_logprobs_line_up_with_a_rescoring_of_the_episode(torch_sampler: Any) -> None:
    ep = weather_episode(torch_sampler)
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=7, logprobs_mode="raw")
    ep.sample(torch_sampler, params)
    ep.add_tool_result("12 degrees and rainy")
    ep.sample(torch_sampler, params)
    feature = ep.training_feature()
    scored = torch_sampler.sample({"input_ids": feature.input_ids}, {"max_tokens": 0, "prompt_logprobs": 0})[
        0
    ].prompt_logprobs
    for i, (mask, lp) in enumerate(zip(feature.extra["loss_mask"], feature.extra["logprobs"])):
        if mask:
            assert lp == pytest.approx(scored[i], abs=1e-3), i


def test_length_stop_gets_the_whole_closing_appended(torch_sampler: Any) -> None:
    ep = weather_episode(torch_sampler)
    ep.sample(torch_sampler, GREEDY.replace(max_tokens=3))
    assert ep.last_turn.stop_reason == "length"  # type: ignore[union-attr]
    ep.add_user("Thanks!")
    closing = next(s for s in ep.segments if s.kind == "closing")
    assert torch_sampler.template.decode(closing.tokens, skip_special_tokens=False) == "<|im_end|>\n"


def test_num_samples_forks_the_episode(torch_sampler: Any) -> None:
    ep = weather_episode(torch_sampler)
    prefix = list(ep.tokens)
    # a hot temperature: the tiny model is peaked after the tool prompt, and forks must visibly diverge
    forks = ep.sample(torch_sampler, SamplingParams(temperature=3.0, max_tokens=16, seed=3), num_samples=4)
    assert len(forks) == 4 and forks[0] is ep and len({id(f) for f in forks}) == 4
    for f in forks:
        assert f.tokens[: len(prefix)] == prefix and len(f.turns) == 1
    assert len({tuple(f.last_turn.tokens) for f in forks}) > 1  # type: ignore[union-attr]
    # Extending one fork leaves the others alone.
    before = [list(f.tokens) for f in forks[1:]]
    forks[0].add_user("Thanks!")
    assert [f.tokens for f in forks[1:]] == before


def test_asample_many_episodes_in_flight(torch_sampler: Any) -> None:
    def conversation(city: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": f"What is the weather in {city}?"}], "tools": [WEATHER]}

    async def agent(city: str) -> Episode:
        ep = Episode(torch_sampler, conversation(city))
        await ep.asample(torch_sampler, GREEDY)
        ep.add_tool_result(f"{len(city)} degrees and sunny")
        await ep.asample(torch_sampler, GREEDY)
        return ep

    async def main() -> list[Episode]:
        return list(await asyncio.gather(*(agent(c) for c in ("Paris", "Rome", "Oslo"))))

    episodes = asyncio.run(main())
    for ep, city in zip(episodes, ("Paris", "Rome", "Oslo")):
        # each episode in flight got what that conversation alone gets
        alone = tool_calls_of(torch_sampler, conversation(city), GREEDY)
        assert [c["function"] for c in ep.turns[0].tool_calls] == alone
        assert len(ep.turns) == 2
    batched = sample_episodes(torch_sampler, [weather_episode(torch_sampler), weather_episode(torch_sampler)], GREEDY)
    assert [len(b) for b in batched] == [1, 1]
    assert batched[0][0].tokens == episodes[0].tokens[: len(batched[0][0].tokens)]
    assert asyncio.run(asample_episodes(torch_sampler, [], GREEDY)) == []


def test_sampling_twice_without_a_message_is_refused(echo: Any) -> None:
    ep = Episode(echo, {"messages": [{"role": "user", "content": "hi"}]})
    ep.sample(echo, GREEDY)
    with pytest.raises(InvalidInputError, match="add the next message"):
        ep.sample(echo, GREEDY)
    with pytest.raises(InvalidInputError, match="assistant turns come from sampling"):
        ep.add_messages([{"role": "assistant", "content": "x"}])
    with pytest.raises(InvalidInputError, match="on_template_mismatch='maybe' is invalid"):
        Episode(echo, {"messages": [{"role": "user", "content": "hi"}]}, on_template_mismatch="maybe")  # type: ignore[arg-type]


def test_template_that_strips_reasoning_is_detected(echo: Any) -> None:
    stripping = Template(echo.tokenizer, chat_template=STRIP_THINK_JINJA)
    ep = Episode(stripping, {"messages": [{"role": "user", "content": "<think>plan it</think>Paris."}]})
    ep.sample(echo, GREEDY)
    assert ep.last_turn.text == "<think>plan it</think>Paris."  # type: ignore[union-attr]
    tokens = list(ep.tokens)
    with pytest.raises(TemplateError, match="not prefix-preserving"):
        ep.add_user("And Rome?")
    assert ep.tokens == tokens  # nothing was appended

    kept = Episode(
        stripping,
        {"messages": [{"role": "user", "content": "<think>plan it</think>Paris."}]},
        on_template_mismatch="keep_sampled",
    )
    kept.sample(echo, GREEDY)
    sampled = list(kept.tokens)
    kept.add_user("And Rome?")
    assert kept.tokens[: len(sampled)] == sampled  # the reasoning the model sampled is still there
    assert len(kept.template_mismatches) == 1
    tail = echo.template.decode(kept.tokens[len(sampled) :], skip_special_tokens=False)
    assert tail == "\n<|im_start|>user\nAnd Rome?<|im_end|>\n<|im_start|>assistant\n"
    kept.sample(echo, GREEDY)
    assert kept.last_turn.text == "And Rome?"  # type: ignore[union-attr]
    assert kept.training_feature().extra["template_mismatches"] == kept.template_mismatches


def test_malformed_tool_calls_are_reported_on_the_turn(echo: Any) -> None:
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> and <tool_call>{"name": oops}</tool_call>'
    ep = Episode(echo, {"messages": [{"role": "user", "content": text}]})
    ep.sample(echo, SamplingParams(temperature=0.0, max_tokens=120))
    turn = ep.last_turn
    assert turn is not None
    assert [c["function"] for c in turn.tool_calls] == [{"name": "f", "arguments": {"x": 1}}]
    assert len(turn.tool_call_errors) == 1 and "not valid JSON" in turn.tool_call_errors[0]
    assert '{"name": oops}' in turn.message.content


def test_tool_calls_the_parser_refuses_leave_the_episode_usable(echo: Any) -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>'
    ep = Episode(echo, {"messages": [{"role": "user", "content": text}]})
    ep.sample(echo, SamplingParams(temperature=0.0, max_tokens=120))
    assert ep.last_turn.tool_calls == [] and "lone surrogate" in ep.last_turn.tool_call_errors[0]  # type: ignore[union-attr]
    ep.add_user("again")
    assert ep.messages[-1].content == "again"


def test_episodes_are_checked_before_anything_is_sampled(echo: Any) -> None:
    ep = Episode(echo, {"messages": [{"role": "user", "content": "hi"}]})
    for bad in (ep, None, 5):
        with pytest.raises(InvalidInputError, match="expected a list of Episode"):
            sample_episodes(echo, bad, GREEDY)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match=r"episodes\[1\] is episodes\[0\]"):
        sample_episodes(echo, [ep, ep], GREEDY)
    assert ep.last_turn is None  # nothing was sampled into it
    [[same]] = sample_episodes(echo, (ep,), GREEDY)
    assert same is ep and ep.last_turn is not None


def test_hermes_parser() -> None:
    parser = get_tool_parser("hermes")
    assert isinstance(parser, HermesToolParser)
    ok = parser.parse('Let me look.\n<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>')
    assert ok.content == "Let me look." and ok.errors == []
    assert ok.tool_calls[0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert ok.tool_calls[0]["id"].startswith("call_")
    unclosed = parser.parse('<tool_call>{"name": "f"')
    assert unclosed.tool_calls == [] and "not closed" in unclosed.errors[0]
    nameless = parser.parse('<tool_call>{"arguments": {}}</tool_call>')
    assert "non-empty string 'name'" in nameless.errors[0]
    # Whatever a model writes is an error on the turn, never an exception: nesting deeper than
    # Python's parser goes, and numbers strict JSON does not have (a call could not be sent on).
    deep = "[" * 100_000 + "]" * 100_000
    for text, needle in (
        (f"<tool_call>{deep}</tool_call>", "nested too deeply"),
        ('<tool_call>{"name": "f", "arguments": "' + deep + '"}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', "NaN is not a JSON value"),
        ('<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>', "beyond float range"),
        # JSON the parser reads, but no template renders back: nesting past the renderer's recursion,
        # and an escaped lone surrogate no tokenizer encodes (either used to break the episode for good)
        ('<tool_call>{"name": "f", "arguments": ' + '{"a":' * 900 + "1" + "}" * 901 + "</tool_call>", "deeper than"),
        ('<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>', "lone surrogate"),
        ('<tool_call>{"name": "f\\udfff", "arguments": {}}</tool_call>', "lone surrogate"),
    ):
        bad = parser.parse(text)
        assert bad.tool_calls == [] and needle in bad.errors[0], bad.errors
    assert get_tool_parser("none").parse("<tool_call>{}</tool_call>").tool_calls == []


def test_chatml_writes_tool_calls_the_way_the_parser_reads_them(torch_sampler: Any) -> None:
    # A call in the history (an agent's few-shot example, a client's earlier turn) is shown to the model
    # in the very form it has to write for the parser: name and arguments, not the OpenAI wrapper.
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    from twinkle_core.template.base import ChatMLTemplate

    chatml = ChatMLTemplate(torch_sampler.template.tokenizer)
    text = chatml.tokenizer.decode(chatml.encode({"messages": messages, "tools": [WEATHER]}).input_ids)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    parsed = get_tool_parser("hermes").parse(text[text.index("<tool_call>") :].split("<|im_end|>")[0])
    assert parsed.errors == [] and parsed.tool_calls[0]["function"] == call["function"]


def test_tool_parser_registry() -> None:
    with pytest.raises(UnknownToolParserError, match="Did you mean 'hermes'"):
        get_tool_parser("hermse")
    with pytest.raises(LookupError):
        get_tool_parser(42)  # type: ignore[arg-type]

    class Upper(ToolCallParser):
        name = "upper"

        def parse(self, text: str) -> ParsedToolCalls:
            return ParsedToolCalls(content=text.upper())

    tool_parser_registry.register("upper", Upper)
    try:
        assert get_tool_parser("upper").parse("hi").content == "HI"
    finally:
        tool_parser_registry.unregister("upper")


def test_text_parts_render_as_text_and_other_parts_are_refused(torch_sampler: Any) -> None:
    """OpenAI-style content parts: text parts are joined one per line; an image is refused, never dropped
    (a text-only model has no processor to expand it; the torch engine passes no images)."""
    from twinkle_core import Trajectory
    from twinkle_core.errors import UnsupportedFeatureError

    template = torch_sampler.template

    def ids(content: Any) -> list[int]:
        return template.encode(Trajectory(messages=[{"role": "user", "content": content}])).input_ids

    assert ids([{"type": "text", "text": "Hello"}]) == ids("Hello")
    assert ids([{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]) == ids("Hello\nthere")
    image = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}
    with pytest.raises(UnsupportedFeatureError, match="holds an image, but this model has no processor"):
        ids([{"type": "text", "text": "What is this?"}, image])
    with pytest.raises(UnsupportedFeatureError, match="does not pass images"):
        torch_sampler.sample([Trajectory(messages=[{"role": "user", "content": [image]}])], GREEDY)
