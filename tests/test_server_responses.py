"""``/v1/responses`` on ``twinkle serve``, driven by the real ``openai`` client over the tiny model (torch engine).

Expectations come from the same sampler in process (greedy); chains are
checked in the session export, where a chain is one token-exact episode.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from twinkle_core.server import RunningServer, start_server  # noqa: E402
from twinkle_core.testing.tiny_model import TINY_WEATHER_TOOL  # noqa: E402

# the Responses shape of the tool the tiny model learnt to call
WEATHER = {"type": "function", **TINY_WEATHER_TOOL["function"]}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server(sampler: Any) -> Iterator[RunningServer]:
    with start_server(sampler, model_name="tiny", max_stored_responses=4) as srv:
        yield srv


def test_a_string_input_is_the_engines_greedy_turn(client: Any, sampler: Any) -> None:
    r = client.responses.create(model="tiny", input="Say hello.", instructions="Answer briefly.", temperature=0,
                                max_output_tokens=24)  # fmt: skip
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Say hello."}]
    direct = sampler.sample({"messages": messages}, {"temperature": 0, "max_tokens": 24, "logprobs": 0})[0].sequences[0]
    assert r.output_text == direct.text and r.object == "response"
    assert r.status == ("incomplete" if direct.stop_reason == "length" else "completed")
    extra = r.model_extra
    assert extra["token_ids"] == direct.tokens and extra["weights_version"] == sampler.weights_version
    assert extra["sampled_logprobs"] == pytest.approx(direct.logprobs, abs=1e-5)
    prompt = len(sampler.template.encode({"messages": messages}, add_generation_prompt=True).input_ids)
    assert (r.usage.input_tokens, r.usage.output_tokens) == (prompt, len(direct.tokens))
    assert client.responses.retrieve(r.id).output_text == r.output_text  # stored (store defaults to true)


def test_a_chain_is_one_token_exact_episode(client: Any, server: RunningServer) -> None:
    first = client.responses.create(model="tiny", input=ASK, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=64)  # fmt: skip
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    second = client.responses.create(
        model="tiny", previous_response_id=first.id, tools=[WEATHER], temperature=0, max_output_tokens=32,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees and sunny"}],
    )  # fmt: skip
    session = second.model_extra["session_id"]
    assert session == first.model_extra["session_id"]  # the chain's session: its first response's
    exported = httpx.get(server.url + f"/v1/sessions/{session}").json()
    assert exported["episodes"] == 1 and exported["turns"] == 2
    feature = exported["data"][0]["feature"]
    turns = feature["extra"]["turns"]
    ids = feature["input_ids"]
    assert ids[turns[0]["start"] : turns[0]["end"]] == first.model_extra["token_ids"]
    assert ids[turns[1]["start"] : turns[1]["end"]] == second.model_extra["token_ids"]
    assert [t["constraint"] for t in turns] == [{"tool_choice": "required", "parallel_tool_calls": False}, None]


def test_streamed_events_carry_the_same_response(client: Any) -> None:
    whole = client.responses.create(model="tiny", input="Say hello.", temperature=0, max_output_tokens=16)
    with client.responses.stream(model="tiny", input="Say hello.", temperature=0, max_output_tokens=16) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.delta" in kinds
    assert final.output_text == whole.output_text
    assert final.model_extra["token_ids"] == whole.model_extra["token_ids"]


def test_text_format_json_schema(client: Any, sampler: Any) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = client.responses.create(
        model="tiny", input=ASK, temperature=0, max_output_tokens=48,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}},
    )  # fmt: skip
    params = {"temperature": 0, "max_tokens": 48, "structured_outputs": {"json": schema}}
    direct = sampler.sample({"messages": [{"role": "user", "content": ASK}]}, params)[0].sequences[0]
    assert r.output_text == direct.text
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text)["city"], str)


def test_the_stored_responses_are_bounded(client: Any, sampler: Any) -> None:
    oldest = client.responses.create(model="tiny", input="Hi!", max_output_tokens=2)
    for _ in range(4):  # the server keeps 4
        client.responses.create(model="tiny", input="Hi!", max_output_tokens=2)
    r = httpx.post(
        str(client.base_url) + "responses", json={"model": "tiny", "input": "Again.", "previous_response_id": oldest.id}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert "the last 4" in r.json()["error"]["message"]


def test_a_chain_stays_in_its_session(client: Any, server: RunningServer) -> None:
    first = client.responses.create(model="tiny", input="Hi!", max_output_tokens=2, extra_headers={"X-Session-Id": "a"})
    body = {"model": "tiny", "input": "Again.", "previous_response_id": first.id}
    r = httpx.post(server.url + "/v1/responses", json=body, headers={"X-Session-Id": "b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    assert "another session" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "flute"}}}}, "text.format"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    server: RunningServer, client: Any, fields: dict[str, Any], param: str
) -> None:
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", "input": "Hi!", **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert client.responses.create(model="tiny", input="Hi!", max_output_tokens=2).status  # the server is unaffected
