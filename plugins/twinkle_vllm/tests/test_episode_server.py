"""Episodes and ``twinkle serve`` on the vLLM CPU engine: one engine for the module."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from twinkle_core import SamplingParams
from twinkle_core.episode import Episode
from twinkle_core.server import RunningServer, start_server
from twinkle_core.testing.expect import tool_calls_of
from twinkle_core.testing.tiny_model import TINY_WEATHER_TOOL as WEATHER

from .conftest import make_sampler

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def sampler(tiny_model: Path) -> Iterator[Any]:
    with make_sampler(tiny_model) as s:
        yield s


@pytest.fixture(scope="module")
def server(sampler: Any) -> Iterator[RunningServer]:
    with start_server(sampler, model_name="tiny") as srv:
        yield srv


def test_episode_tool_loop_is_token_exact(sampler: Any) -> None:
    conversation = {"messages": [{"role": "user", "content": "What is the weather in Oslo?"}], "tools": [WEATHER]}
    ep = Episode(sampler, conversation)
    params = SamplingParams(temperature=0.0, max_tokens=48)
    ep.sample(sampler, params)
    calls = [c["function"] for c in ep.last_turn.tool_calls]  # type: ignore[union-attr]
    assert calls == tool_calls_of(sampler, conversation, params)  # what the engine says, whichever city
    ep.add_tool_result("3 degrees and snowy")
    forks = ep.sample(sampler, params.replace(temperature=1.0, seed=11), num_samples=3)
    assert len(forks) == 3 and all(f.tokens[: forks[0].turns[1].start] == ep.tokens[: ep.turns[1].start] for f in forks)
    feature = ep.training_feature()
    assert feature.input_ids == [t for s in ep.segments for t in s.tokens]
    assert [t for t, m in zip(feature.input_ids, feature.extra["loss_mask"]) if m] == ep.turns[0].tokens + ep.turns[
        1
    ].tokens
    assert all(lp is not None for lp, m in zip(feature.extra["logprobs"], feature.extra["loss_mask"]) if m)


def test_server_agent_loop_and_streaming(server: RunningServer, sampler: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Lima?"}]
    expected = tool_calls_of(sampler, {"messages": messages, "tools": [WEATHER]}, {"temperature": 0, "max_tokens": 48})
    sampled = []
    for _ in range(4):
        r = client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=[WEATHER],
            temperature=0,
            max_tokens=48,
            user="v-agent",
            logprobs=True,
        )
        msg = r.choices[0].message
        sampled.append(r.choices[0].model_extra["token_ids"])
        assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(
            r.choices[0].model_extra["sampled_logprobs"]
        )
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        if len(sampled) == 1:
            call = msg.tool_calls[0].function
            assert [{"name": call.name, "arguments": json.loads(call.arguments)}] == expected
        messages.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "25 degrees and sunny"})
    assert len(sampled) >= 2
    feature = json.loads(httpx.get(server.url + "/v1/sessions/v-agent/export").text.splitlines()[0])["feature"]
    trained = [t for t, m in zip(feature["input_ids"], feature["extra"]["loss_mask"]) if m]
    assert trained == [t for turn in sampled for t in turn]

    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello!"}], n=2, temperature=0, max_tokens=12
    )
    hello = sampler.sample({"messages": [{"role": "user", "content": "Hello!"}]}, {"temperature": 0, "max_tokens": 12})
    assert [c.message.content for c in r.choices] == [hello[0].sequences[0].text] * 2
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello!"}], temperature=0, max_tokens=12, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
