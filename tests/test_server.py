"""``twinkle serve`` driven by the real ``openai`` client, over the torch engine on the tiny model.

Each test talks to a real uvicorn server on a free loopback port.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from twinkle_core import ConfigError  # noqa: E402 - after the optional-dependency skips
from twinkle_core.server import RunningServer, start_server  # noqa: E402
from twinkle_core.testing.expect import tool_calls_of  # noqa: E402
from twinkle_core.testing.tiny_model import TINY_WEATHER_TOOL as WEATHER  # noqa: E402


def test_plain_chat_and_logprobs(client: Any, sampler: Any) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=32, logprobs=True, top_logprobs=3
    )
    choice = r.choices[0]
    direct = sampler.sample({"messages": messages}, {"temperature": 0, "max_tokens": 32, "logprobs": 3})[0].sequences[0]
    assert choice.message.content == direct.text
    assert choice.finish_reason == {"stop": "stop", "length": "length"}[direct.stop_reason]
    extra = choice.model_extra
    assert extra["token_ids"] == direct.tokens and extra["weights_version"] == sampler.weights_version
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(direct.logprobs)
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert r.usage.completion_tokens == len(direct.tokens)
    assert r.usage.prompt_tokens == len(sampler.template.encode({"messages": messages}).input_ids)


def test_n_choices_and_base_model_name(client: Any) -> None:
    r = client.chat.completions.create(
        model="base",
        messages=[{"role": "user", "content": "Say something about a fox."}],
        n=3,
        temperature=2.0,
        max_tokens=16,
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({tuple(c.model_extra["token_ids"]) for c in r.choices}) > 1


def test_streaming_gives_the_same_text(client: Any) -> None:
    messages = [{"role": "user", "content": "Tell me a story about a duck."}]
    whole = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=30)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=messages,
            temperature=0,
            max_tokens=30,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) > 3
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert final.choices[0].model_extra["token_ids"] == whole.choices[0].model_extra["token_ids"]
    assert chunks[-1].usage.completion_tokens == len(final.choices[0].model_extra["token_ids"])


def test_reply_text_keeps_the_sampled_whitespace_whole_and_streamed(client: Any, sampler: Any) -> None:
    # Without tool calls the text is what was sampled, as vLLM returns it: the whole reply and the
    # stream agree, and neither strips it (an RL reward on formatting sees what the model wrote).
    (space,) = sampler.template.tokenizer.encode("\n", add_special_tokens=False)
    messages = [{"role": "user", "content": "Tell me a story about a duck."}]
    ask = {"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 3}
    extra = {"logit_bias": {str(space): 100}, "ignore_eos": True}
    whole = client.chat.completions.create(**ask, extra_body=extra)
    direct = sampler.sample({"messages": messages}, {"temperature": 0, "max_tokens": 3, **extra})[0].sequences[0]
    assert direct.tokens == [space] * 3 and direct.text.strip() == ""
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**ask, extra_body=extra, stream=True)
        if c.choices
    )
    assert whole.choices[0].message.content == streamed == direct.text


def test_agent_loop_session_export_is_what_was_sampled(client: Any, server: RunningServer, sampler: Any) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Rome?"}]
    # the call the engine itself makes in process for the first turn (whichever city the tiny model names)
    expected = tool_calls_of(sampler, {"messages": messages, "tools": [WEATHER]}, {"temperature": 0, "max_tokens": 48})
    sampled: list[list[int]] = []
    for _ in range(4):  # a plain agent loop: call the tool while the model asks for it
        r = client.chat.completions.create(
            model="tiny",
            messages=messages,
            tools=[WEATHER],
            temperature=0,
            max_tokens=48,
            extra_headers={"X-Session-Id": "agent-1"},
        )
        msg = r.choices[0].message
        sampled.append(r.choices[0].model_extra["token_ids"])
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        call = msg.tool_calls[0]
        if len(sampled) == 1:
            assert [{"name": call.function.name, "arguments": json.loads(call.function.arguments)}] == expected
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "17 degrees and cloudy"})
    turns = len(sampled)
    assert turns >= 2

    body = httpx.get(server.url + "/v1/sessions/agent-1").json()
    assert body["episodes"] == 1 and body["turns"] == turns
    lines = httpx.get(server.url + "/v1/sessions/agent-1/export").text.splitlines()
    feature = json.loads(lines[0])["feature"]
    ids, mask = feature["input_ids"], feature["extra"]["loss_mask"]
    # The trained tokens are exactly the sampled ones, in order, and nothing else is trained.
    assert [t for t, m in zip(ids, mask) if m] == [t for turn in sampled for t in turn]
    spans = feature["extra"]["turns"]
    assert [ids[s["start"] : s["end"]] for s in spans] == sampled
    prompt = sampler.template.encode({"messages": messages[:1], "tools": [WEATHER]}).input_ids
    assert ids[: len(prompt)] == prompt and spans[0]["start"] == len(prompt)
    listed = httpx.get(server.url + "/v1/sessions").json()["data"]
    assert {"id": "agent-1", "episodes": 1, "turns": turns, "tokens": len(ids)} in listed
    assert httpx.delete(server.url + "/v1/sessions/agent-1").json()["deleted"] is True
    assert httpx.get(server.url + "/v1/sessions/agent-1").status_code == 404


def test_completions_route(client: Any, sampler: Any) -> None:
    prompt = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
    ids = sampler.template.tokenizer.encode(prompt, add_special_tokens=False)
    direct = sampler.sample({"input_ids": ids}, {"temperature": 0, "max_tokens": 12})[0].sequences[0]
    assert r.choices[0].text == direct.text and r.choices[0].model_extra["token_ids"] == direct.tokens
    assert len(r.choices[0].logprobs.token_logprobs) == len(direct.tokens)


def test_weights_version_follows_updates(client: Any, sampler: Any) -> None:
    name, tensor = next(iter(sampler.model.state_dict().items()))
    before = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=4)
    version = sampler.update_weights({name: tensor.clone()})
    after = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}], max_tokens=4)
    assert (
        after.choices[0].model_extra["weights_version"]
        == version
        == before.choices[0].model_extra["weights_version"] + 1
    )
    assert httpx.get(str(client.base_url).replace("/v1/", "/health")).json()["weights_version"] == version


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "does not exist"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
        ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "best_of": 2}, 400, "best_of"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
            400,
            "tool_choice",
        ),
        ({"model": "tiny", "messages": [{"role": "user", "content": "hi " * 600}]}, 400, "prompt tokens"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "presence_penalty": 3.0},
            400,
            "presence_penalty",
        ),
    ],
)
def test_bad_requests_get_openai_errors(server: RunningServer, body: dict[str, Any], status: int, needle: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    assert "Traceback" not in r.text


def test_log_prob_alternatives_are_capped_like_vllms_max_logprobs(server: RunningServer, sampler: Any) -> None:
    # The torch engine returns as many alternatives as asked, up to the vocabulary: one short call could
    # make a reply of hundreds of MB. The server caps them at vLLM's default, 20, per route and field.
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
    text = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for route, body, param in (
        ("/v1/chat/completions", {**chat, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "prompt_logprobs": 500}, "prompt_logprobs"),
        ("/v1/completions", {**text, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {**text, "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {**text, "echo": True, "logprobs": 21}, "logprobs"),
    ):
        r = httpx.post(server.url + route, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and f"{param}={body[param]} is more than this server allows" in err["message"]
    ok = httpx.post(server.url + "/v1/chat/completions", json={**chat, "top_logprobs": 20, "temperature": 0})
    assert ok.status_code == 200, ok.text
    assert all(len(t["top_logprobs"]) == 20 for t in ok.json()["choices"][0]["logprobs"]["content"])
    with start_server(sampler, model_name="tiny", max_logprobs=25) as wider:
        r = httpx.post(wider.url + "/v1/completions", json={**text, "logprobs": 25, "temperature": 0})
        assert r.status_code == 200, r.text
        assert all(len(d) >= 25 for d in r.json()["choices"][0]["logprobs"]["top_logprobs"])


def test_malformed_json_and_unknown_route(server: RunningServer) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] is None
    assert "the body is not valid JSON (Expecting property name" in r.json()["error"]["message"], r.text
    # JSON nested deeper than the parser goes: a 400, in the body and in a tool call's arguments
    deep = "[" * 100_000 + "]" * 100_000
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "x": ' + deep + "}"
    r = httpx.post(server.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json(), r.text
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": messages})
    assert r.status_code == 400 and "are not JSON" in r.json()["error"]["message"], r.text
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/v1/nothing").json()["error"]["code"] == "not_found"


def test_client_leaving_mid_stream_aborts_the_engine_call(server: RunningServer, client: Any) -> None:
    max_tokens = 400
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a story about a cow."}],
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,  # without an abort the engine would generate all of them
    }
    headers = {"X-Session-Id": "leaver"}
    with httpx.Client() as h, h.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ")  # the role chunk: the engine call is running
    # The session's next call waits until the aborted one is recorded, so no polling is needed.
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=8,
        temperature=0,
        extra_headers=headers,
    )
    assert r.choices[0].message.content  # the server is still up and serving
    aborted = httpx.get(server.url + "/v1/sessions/leaver").json()["data"][0]["feature"]
    [turn] = aborted["extra"]["turns"]
    assert turn["stop_reason"] == "abort"
    kept = turn["end"] - turn["start"]
    assert kept < max_tokens  # generation stopped early (the abort may even land before the first token)
    assert aborted["extra"]["loss_mask"][turn["start"] : turn["end"]] == [1] * kept


def test_n_choices_stream_as_each_finishes(client: Any) -> None:
    request = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say something about a fox."}],
        "n": 3,
        "temperature": 1.0,
        "seed": 5,
        "max_tokens": 24,
    }
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(f.index for f in finals) == [0, 1, 2]  # each choice finishes exactly once
    for choice in whole.choices:
        text = "".join(
            c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == choice.index
        )
        final = next(f for f in finals if f.index == choice.index)
        assert text == choice.message.content
        assert final.model_extra["token_ids"] == choice.model_extra["token_ids"]


def test_an_update_that_failed_part_way_turns_requests_away_until_pushed_again(client: Any, sampler: Any) -> None:
    """Weights no version names are never served: 503 ``weights_incomplete``, streamed or not, until a push."""
    from twinkle_core.testing.faults import failing_when_copied

    state = {k: v.clone() for k, v in sampler.model.state_dict().items()}
    last = list(state)[-1]
    with pytest.raises(RuntimeError, match="gather failed"):
        sampler.update_weights({**state, last: failing_when_copied(state[last], RuntimeError("gather failed"))})
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(**ask, stream=stream)
        assert info.value.status_code == 503 and info.value.code == "weights_incomplete"
        assert "failed part-way (RuntimeError: gather failed)" in info.value.message
    version = sampler.update_weights(state)
    r = client.chat.completions.create(**ask)
    assert r.choices[0].model_extra["weights_version"] == version


def test_weights_that_overflow_are_a_server_error_not_a_bad_request(client: Any, sampler: Any) -> None:
    """NaN logits are the served weights' fault: 500 ``numerical_error``, streamed or not; the server goes on."""
    import torch

    norm = sampler.model.state_dict()["model.norm.weight"].clone()
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    sampler.update_weights({"model.norm.weight": torch.full_like(norm, 3e38)})
    try:
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(**ask)
        assert info.value.status_code == 500 and info.value.code == "numerical_error"
        with pytest.raises(openai.APIError) as streamed:  # after the stream's 200: the error body as its last event
            list(client.chat.completions.create(**ask, stream=True))
        assert streamed.value.code == "numerical_error"
        for error in (info.value, streamed.value):
            assert error.type == "server_error" and "NaN or infinity" in error.message
    finally:
        sampler.update_weights({"model.norm.weight": norm})
    assert client.chat.completions.create(**ask).choices[0].finish_reason in ("stop", "length")


def test_bad_server_options_are_refused_before_it_listens(sampler: Any) -> None:
    for options, message in (
        ({"port": 99999}, "port=99999 is invalid: expected an integer from 0 to 65535"),
        ({"port": "80"}, "port='80' is invalid"),
        ({"default_max_tokens": -5}, "default_max_tokens=-5 is invalid: expected an integer >= 1"),
        ({"default_max_tokens": 2.5}, "default_max_tokens=2.5 is invalid"),
        ({"max_logprobs": -1}, "max_logprobs=-1 is invalid: expected an integer >= 0"),
        ({"max_logprobs": True}, "max_logprobs=True is invalid"),
    ):
        with pytest.raises(ConfigError, match=message):
            start_server(sampler, **options)


def test_api_key(sampler: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with start_server(sampler, api_key="s3cret") as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        missing = httpx.get(srv.url + "/v1/models")
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0).models.list()
        assert [m.id for m in ok] == ["twinkle", "base"]
    monkeypatch.delenv("TWINKLE_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="API key is required"):
        start_server(sampler, host="0.0.0.0")


def test_twinkle_serve_command(tmp_path: Any) -> None:
    import os
    import socket
    import subprocess
    import sys

    from twinkle_core.testing import build_tiny_model

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-c",
        "from twinkle_core.cli import main; main()",
        "serve",
        "-e",
        "torch",
        "-m",
        str(build_tiny_model("llama")),
        "--port",
        str(port),
        "--model-name",
        "tiny",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "TWINKLE_API_KEY": ""})
    try:
        assert proc.stderr is not None
        for line in proc.stderr:  # uvicorn announces the address once it accepts connections
            if "Uvicorn running on" in line:
                break
        else:
            pytest.fail(f"twinkle serve exited with {proc.wait()}")
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hello!"}], temperature=0, max_tokens=12
        )
        assert r.choices[0].message.content == "Hello! How can I help you today?"
    finally:
        proc.terminate()
        proc.wait()
