"""``twinkle serve``'s vLLM protocol, field by field and route by route, over the torch engine on the tiny model.

One server for the module; expectations come from the same sampler in process.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from twinkle_core.data_format import InputFeature
from twinkle_core.server import RunningServer, start_server
from twinkle_core.server.protocol import FIELDS, model_fields


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from twinkle_core.testing import build_tiny_model

    return build_tiny_model("llama")


@pytest.fixture(scope="module")
def sampler(model_dir: Path) -> Iterator[Any]:
    from twinkle_torch.sampler import TorchSampler

    with TorchSampler(model_dir, device="cpu") as s:
        yield s


@pytest.fixture(scope="module")
def server(sampler: Any) -> Iterator[RunningServer]:
    with start_server(sampler, model_name="tiny") as srv:
        yield srv


def _post(server: RunningServer, path: str, body: dict[str, Any], status: int = 200) -> Any:
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def _ids(sampler: Any, text: str) -> list[int]:
    return list(sampler.template.encode({"messages": [{"role": "user", "content": text}]}).input_ids)


# -- /v1/completions ---------------------------------------------------------------------------------------------


def test_batched_token_prompts_are_prompt_major(server: RunningServer, sampler: Any) -> None:
    prompts = [_ids(sampler, "Hi!"), _ids(sampler, "What is two plus two?"), _ids(sampler, "Name a color.")]
    body = {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 6, "seed": 7, "temperature": 1.0}
    out = _post(server, "/v1/completions", {**body, "return_token_ids": True})
    direct = sampler.sample([{"input_ids": p} for p in prompts], {"max_tokens": 6, "seed": 7, "num_samples": 2})
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert [c["token_ids"] for c in out["choices"]] == [s.tokens for r in direct for s in r.sequences]
    assert [c["prompt_token_ids"] for c in out["choices"]] == [p for p in prompts for _ in range(2)]
    assert out["usage"]["prompt_tokens"] == sum(map(len, prompts))
    # a list of strings is several prompts too, encoded as vLLM does (special tokens added)
    texts = ["The quick brown fox", "Numbers: 0 1"]
    out = _post(server, "/v1/completions", {"model": "tiny", "prompt": texts, "max_tokens": 4, "temperature": 0})
    greedy = sampler.sample(
        [{"input_ids": sampler.template.tokenizer.encode(t)} for t in texts], {"temperature": 0, "max_tokens": 4}
    )
    assert [c["text"] for c in out["choices"]] == [r.sequences[0].text for r in greedy]


def test_echo_scores_the_prompt_like_lm_eval(server: RunningServer, sampler: Any) -> None:
    ids = _ids(sampler, "What is the capital of France?")
    out = _post(
        server,
        "/v1/completions",
        {"model": "tiny", "prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0},
    )
    [choice] = out["choices"]
    direct = sampler.sample({"input_ids": ids}, {"max_tokens": 0, "prompt_logprobs": 1})[0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(direct.prompt_logprobs[1:], abs=1e-6)
    for i in range(1, len(ids)):  # the prompt's own token first, then the most likely one
        top = lp["top_logprobs"][i]
        assert next(iter(top.values())) == pytest.approx(direct.prompt_logprobs[i], abs=1e-6)
        assert max(top.values()) == pytest.approx(direct.prompt_top_logprobs[i][0][1], abs=1e-6)
    assert choice["text"] == sampler.template.decode(ids) and choice["token_ids"] == []
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # echo with a completion: the prompt's block, then the completion's
    out = _post(
        server,
        "/v1/completions",
        {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 3, "temperature": 0},
    )
    [choice] = out["choices"]
    assert len(choice["logprobs"]["tokens"]) == len(ids) + len(choice["token_ids"])
    assert choice["text"].startswith(sampler.template.decode(ids))


def test_prompt_logprobs_in_vllms_shape(server: RunningServer, sampler: Any) -> None:
    ids = _ids(sampler, "Hello there!")
    out = _post(server, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    rows = out["choices"][0]["prompt_logprobs"]
    direct = sampler.sample({"input_ids": ids}, {"max_tokens": 1, "prompt_logprobs": 2})[0]
    assert rows[0] is None and len(rows) == len(ids)
    for i in range(1, len(ids)):
        row = rows[i]
        assert row[str(ids[i])]["logprob"] == pytest.approx(direct.prompt_logprobs[i], abs=1e-6)
        ranked = sorted(row.items(), key=lambda kv: kv[1]["rank"])
        assert [int(k) for k, _ in ranked[:2]] == [t for t, _ in direct.prompt_top_logprobs[i]]
        assert all(
            v["decoded_token"] == sampler.template.decode([int(k)], skip_special_tokens=False) for k, v in row.items()
        )


def test_token_names_stop_reason_and_texts(server: RunningServer, sampler: Any) -> None:
    ids = _ids(sampler, "Count to five.")
    # ignore_eos: the greedy completion runs all 12 tokens, so it has text to take a stop string from
    free = sampler.sample({"input_ids": ids}, {"temperature": 0, "max_tokens": 12, "ignore_eos": True})[0].sequences[0]
    assert len(free.text) >= 5, f"12 greedy tokens decoded to only {free.text!r}"
    # a stop string the greedy completion reaches: the text is cut before it, and kept with include_stop_str_in_output
    stop = free.text[3:5]
    base = {"model": "tiny", "prompt": ids, "temperature": 0, "max_tokens": 12, "ignore_eos": True, "stop": [stop]}
    cut = _post(server, "/v1/completions", base)["choices"][0]
    kept = _post(server, "/v1/completions", {**base, "include_stop_str_in_output": True})["choices"][0]
    assert cut["stop_reason"] == stop and cut["finish_reason"] == "stop"
    assert kept["text"] == cut["text"] + stop and kept["token_ids"] == cut["token_ids"]
    as_ids = _post(
        server,
        "/v1/completions",
        {
            "model": "tiny",
            "prompt": ids,
            "temperature": 0,
            "max_tokens": 4,
            "logprobs": 2,
            "return_tokens_as_token_ids": True,
        },
    )["choices"][0]
    assert as_ids["logprobs"]["tokens"] == [f"token_id:{t}" for t in as_ids["token_ids"]]
    assert all(k.startswith("token_id:") for row in as_ids["logprobs"]["top_logprobs"] for k in row)
    # special tokens in the text on request (the EOS that ended it is left out, as vLLM does)
    special = _post(
        server,
        "/v1/completions",
        {"model": "tiny", "prompt": ids, "temperature": 0, "max_tokens": 24, "skip_special_tokens": False},
    )["choices"][0]
    shown = sampler.template.decode(special["token_ids"], skip_special_tokens=False)
    assert shown.startswith(special["text"])


def test_truncate_prompt_tokens(server: RunningServer, sampler: Any) -> None:
    ids = _ids(sampler, "What is the capital of France? Answer briefly.")
    for side, kept in (("left", ids[-5:]), ("right", ids[:5])):
        out = _post(
            server,
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": ids,
                "truncate_prompt_tokens": 5,
                "truncation_side": side,
                "max_tokens": 3,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        assert out["choices"][0]["prompt_token_ids"] == kept
        direct = sampler.sample({"input_ids": kept}, {"temperature": 0, "max_tokens": 3})[0].sequences[0]
        assert out["choices"][0]["token_ids"] == direct.tokens


def test_completions_stream(server: RunningServer, sampler: Any) -> None:
    ids = _ids(sampler, "Hi!")
    body = {"model": "tiny", "prompt": ids, "n": 2, "max_tokens": 5, "seed": 3, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    import json

    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    choices = sorted((c for chunk in chunks for c in chunk["choices"]), key=lambda c: c["index"])
    direct = sampler.sample({"input_ids": ids}, {"max_tokens": 5, "seed": 3, "num_samples": 2})[0]
    assert [c["token_ids"] for c in choices] == [s.tokens for s in direct.sequences]
    assert chunks[-1]["usage"]["completion_tokens"] == sum(len(s.tokens) for s in direct.sequences)


def _stream_events(server: RunningServer, path: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        return r.status_code, [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [5, -1]}, "token id"),  # found by the engine, once the call runs
        ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"regex": "(("}}, "regex"),
    ],
)
def test_a_stream_the_engine_refuses_ends_with_the_error(
    server: RunningServer, path: str, body: dict[str, Any], param: str
) -> None:
    """The 200 has gone out when the engine refuses: the stream carries the error body, then [DONE]."""
    import json

    body = {"model": "tiny", "max_tokens": 4, **body}
    plain = httpx.post(server.url + path, json=body, timeout=60)
    assert plain.status_code == 400, plain.text
    status, events = _stream_events(server, path, body)
    assert status == 200 and events[-1] == "[DONE]"
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert errors == [plain.json()["error"]] and param in errors[0]["message"]
    healthy = {"prompt": [5, 6]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    _post(server, path, {"model": "tiny", "max_tokens": 2, **healthy})  # and the server goes on


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "x " * 600}),
        ("/v1/completions", {"prompt": list(range(5, 700))}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 600}]}),
    ],
)
def test_a_prompt_that_cannot_fit_is_refused_before_a_stream_opens(
    server: RunningServer, path: str, body: dict[str, Any]
) -> None:
    """Its length is known before the call runs: streamed or not, the answer is the same 400, OpenAI's code."""
    body = {"model": "tiny", "max_tokens": 4, **body}
    plain = httpx.post(server.url + path, json=body, timeout=60)
    streamed = httpx.post(server.url + path, json={**body, "stream": True}, timeout=60)
    assert plain.status_code == streamed.status_code == 400, plain.text
    assert plain.json() == streamed.json()
    assert plain.json()["error"]["code"] == "context_length_exceeded"
    assert "max_model_len" in plain.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body", "where"),
    [
        ("/v1/completions", {"prompt": "\ud83d hi"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udc00"]}, "prompt.1"),
        ("/v1/completions", {"prompt": "hi", "bad_words": ["\ud83d"]}, "bad_words.0"),
        ("/v1/completions", {"prompt": "hi", "stop": "\ud83d"}, "stop"),
        ("/v1/completions", {"prompt": "hi", "request_id": "\ud83d"}, "request_id"),
        ("/tokenize", {"prompt": "\ud83d hi"}, "prompt"),
    ],
)
def test_lone_surrogates_are_refused_naming_the_field(
    server: RunningServer, path: str, body: dict[str, Any], where: str
) -> None:
    """JSON's "\\ud83d" is valid JSON but no text: a 400 naming the field, before any engine work."""
    raw = __import__("json").dumps({"model": "tiny", "max_tokens": 2, **body}).replace("\\\\u", "\\u")
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert where in r.json()["error"]["message"] and "surrogate" in r.json()["error"]["message"]


def test_seeds_beyond_64_bits_and_stream_with_prompt_logprobs_are_refused(server: RunningServer) -> None:
    for seed in (2**63, -(2**63) - 1, 2**64):
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "seed": seed}, timeout=60)
        assert r.status_code == 400 and "seed" in r.text, r.text
    _post(server, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "seed": 2**63 - 1})
    for path, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        body = {"model": "tiny", "max_tokens": 2, "prompt_logprobs": 1, "stream": True, **body}
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_abort_requests_refuses_unknown_keys(server: RunningServer) -> None:
    r = httpx.post(server.url + "/abort_requests", json={"request_id": "other"}, timeout=60)
    assert r.status_code == 400 and "request_id" in r.text, r.text


def test_small_protocol_edges(server: RunningServer) -> None:
    """The served name when a body names none; an unknown model on the tokenizer routes; an empty stop string."""
    for model in (None, ""):
        out = _post(server, "/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2})
        assert out["model"] == "tiny"
        out = _post(server, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}]})
        assert out["model"] == "tiny"
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
        r = httpx.post(server.url + path, json={"model": "nope", **body}, timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        _post(server, path, {"model": "tiny", **body})
    for stop in ("", [""]):
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "stop": stop}, timeout=60)
        assert r.status_code == 400 and "stop" in r.text, r.text
    _post(server, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "stop": []})


_HI = [{"role": "user", "content": "Hi"}]
_MANY = {"choice": [str(i) for i in range(20000)]}
_NO_TYPE = {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hi", "n": 0}, "n"),
        ("/v1/chat/completions", {"messages": _HI, "n": 4097}, "n"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": -1}, "logprobs"),
        ("/v1/chat/completions", {"messages": _HI, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": _HI, "max_completion_tokens": -1}, "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": _HI, "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"999999": 1}}, "logit_bias"),
        ("/v1/completions", {"prompt": "Hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ("/v1/completions", {"prompt": "Hi", "structured_outputs": {}}, "structured_outputs"),
        ("/v1/completions", {"prompt": "Hi", "structured_outputs": _MANY}, "structured_outputs"),
        ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs"),
        ("/v1/chat/completions", {"messages": _HI, "response_format": _NO_TYPE}, "response_format"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("stream", [False, True])
def test_errors_name_the_field_as_the_body_does(
    server: RunningServer, path: str, body: dict[str, Any], param: str, stream: bool
) -> None:
    """A refused sampling value is named as the client sent it (``n``, not the engine's ``num_samples``),
    in ``param`` and in the message, whether refused on arrival or once the engine ran the call."""
    r = httpx.post(server.url + path, json={"model": "tiny", "max_tokens": 2, **body, "stream": stream}, timeout=120)
    if r.status_code == 200:  # a stream refused once the engine ran it: the error is its last event
        assert stream, r.text
        events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param) and "SamplingParams" not in error["message"], error
    if body.get("structured_outputs") is _MANY:
        assert "20000 choices" in error["message"], error  # a choice list is not called a grammar


def test_a_request_for_more_sequences_than_memory_allows_is_refused(server: RunningServer) -> None:
    from twinkle_core.server.completions import MAX_SEQUENCES

    prompts = [[5, 6]] * (MAX_SEQUENCES // 4096 + 1)  # a short body that asks for one sequence too many x n
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompts, "n": 4096}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert f"at most {MAX_SEQUENCES}" in r.json()["error"]["message"]
    assert _post(server, "/v1/completions", {"model": "tiny", "prompt": [[5, 6]] * 2, "n": 3, "max_tokens": 1})


# -- fields: the table, neutral values, refusals ----------------------------------------------------------------


@pytest.mark.parametrize("route", ["completions", "chat", "responses"])
def test_the_table_names_every_accepted_field(route: str) -> None:
    named = {f.name for f in FIELDS if route in f.routes}
    assert named == model_fields(route)  # type: ignore[arg-type]


_NEUTRAL_PROBES: dict[str, Any] = {
    "use_beam_search": True,
    "priority": 1,
}


@pytest.mark.parametrize(("name", "value"), sorted(_NEUTRAL_PROBES.items()))
def test_neutral_fields_refuse_any_other_value(server: RunningServer, name: str, value: Any) -> None:
    rule = next(f for f in FIELDS if f.name == name)
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    if rule.neutral:  # its neutral value changes nothing and is accepted
        _post(server, "/v1/completions", {**body, name: rule.neutral[0]})
    err = _post(server, "/v1/completions", {**body, name: value}, status=400)["error"]
    assert err["param"] == name and name in err["message"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, name: value}
    assert _post(server, "/v1/chat/completions", chat, status=400)["error"]["param"] == name


#: vLLM's sampling fields twinkle's engines honour: the server passes them on as they are.
_ENGINE_FIELDS: dict[str, Any] = {
    "presence_penalty": 1.5,
    "frequency_penalty": -0.5,
    "min_tokens": 3,
    "logit_bias": {"5": 10.0, "9": -4.0},
    "allowed_token_ids": [5, 6, 7, 9],
    "bad_words": ["fox"],
    "structured_outputs": {"regex": "[a-z]+"},
}


@pytest.mark.parametrize(("name", "value"), sorted(_ENGINE_FIELDS.items()))
def test_engine_sampling_fields_reach_the_engine(server: RunningServer, sampler: Any, name: str, value: Any) -> None:
    body = {"model": "tiny", "prompt": [[5, 6, 7, 8]], "max_tokens": 6, "temperature": 0.9, "seed": 3, name: value}
    out = _post(server, "/v1/completions", body)
    direct = sampler.sample(InputFeature(input_ids=[5, 6, 7, 8]), {**body_params(body), name: value})[0]
    assert out["choices"][0]["token_ids"] == direct.sequences[0].tokens
    # a value the field refuses is a 400 that names it
    bad = {"presence_penalty": 9, "frequency_penalty": 9, "min_tokens": 99, "logit_bias": {"5": 1e3}}.get(name)
    if bad is None:
        bad = {"allowed_token_ids": [10**9], "bad_words": [""], "structured_outputs": {"regex": "(["}}[name]
    err = _post(server, "/v1/completions", {**body, name: bad}, status=400)["error"]
    assert name in err["message"]


def test_response_format_constrains_the_reply(server: RunningServer) -> None:
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40, "seed": 1}
    for rf in ({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, {"type": "json_object"}):
        out = _post(server, "/v1/chat/completions", {**chat, "response_format": rf})
        choice = out["choices"][0]
        if choice["finish_reason"] == "stop":
            value = json.loads(choice["message"]["content"])
            assert isinstance(value, dict) and (rf["type"] == "json_object" or isinstance(value["ok"], bool))
    body = {**chat, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}
    assert _post(server, "/v1/chat/completions", body, status=400)["error"]["param"] == "response_format"
    bad = {**chat, "response_format": {"type": "xml"}}
    assert "xml" in _post(server, "/v1/chat/completions", bad, status=400)["error"]["message"]


def body_params(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields of a completions body, as ``SamplingParams`` names them."""
    return {"max_tokens": body["max_tokens"], "temperature": body["temperature"], "seed": body["seed"], "logprobs": 0}


def test_trl_defaults_and_unknown_fields(server: RunningServer) -> None:
    # what TRL's VLLMClient sends at its defaults is accepted
    defaults = {"repetition_penalty": 1.0, "top_k": 0, "min_p": 0.0, "top_p": 1.0, "logprobs": 0}
    _post(server, "/v1/completions", {"model": "tiny", "prompt": [[5, 6, 7]], "max_tokens": 2, **defaults})
    # a field nobody defines is still refused, by name
    err = _post(server, "/v1/completions", {"model": "tiny", "prompt": "x", "best_of": 3}, status=400)["error"]
    assert "best_of" in err["message"]
    err = _post(server, "/v1/completions", {"model": "tiny", "prompt": [[5, 99999]]}, status=400)["error"]
    assert "99999" in err["message"]


def test_chat_tools_with_strict_and_token_ids(server: RunningServer, sampler: Any) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            "strict": True,
        },
    }
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    body = {"model": "tiny", "messages": messages, "tools": [tool], "temperature": 0, "max_tokens": 40}
    out = _post(server, "/v1/chat/completions", {**body, "return_token_ids": True, "prompt_logprobs": 0})
    plain = {**tool, "function": {k: v for k, v in tool["function"].items() if k != "strict"}}
    prompt = sampler.template.encode({"messages": messages, "tools": [plain]}).input_ids
    assert out["prompt_token_ids"] == prompt
    assert len(out["prompt_logprobs"]) == len(prompt) and out["prompt_logprobs"][0] is None
    direct = sampler.sample({"messages": messages, "tools": [plain]}, {"temperature": 0, "max_tokens": 40})[0]
    assert out["choices"][0]["token_ids"] == direct.sequences[0].tokens
    bad = {**tool, "function": {**tool["function"], "strict": "yes"}}
    assert "strict" in _post(server, "/v1/chat/completions", {**body, "tools": [bad]}, status=400)["error"]["message"]


# -- the other routes --------------------------------------------------------------------------------------------


def test_tokenizer_routes(server: RunningServer, sampler: Any) -> None:
    tok = _post(server, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False, "return_token_strs": True})
    assert tok["tokens"] == sampler.template.tokenizer.encode("Hello there", add_special_tokens=False)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == sampler.max_model_len
    assert "".join(tok["token_strs"]) == "Hello there"
    chat = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi!"}]})
    assert chat["tokens"] == _ids(sampler, "Hi!")
    assert _post(server, "/detokenize", {"tokens": tok["tokens"]})["prompt"] == "Hello there"
    assert "vocabulary" in _post(server, "/detokenize", {"tokens": [10**6]}, status=400)["error"]["message"]
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == sampler.template.tokenizer.eos_token and info["chat_template"]


def test_description_routes(server: RunningServer, sampler: Any) -> None:
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/get_world_size").json() == {"world_size": 1}
    info = httpx.get(server.url + "/server_info").json()
    assert info["twinkle"]["weights_version"] == sampler.weights_version
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert models[0]["id"] == "tiny" and models[0]["max_model_len"] == sampler.max_model_len
    metrics = httpx.get(server.url + "/metrics").text
    assert f'twinkle:weights_version{{model_name="tiny"}} {sampler.weights_version}' in metrics
    assert "# TYPE vllm:generation_tokens_total counter" in metrics
    assert info["vllm_config"]["weight_transfer_config"] is None  # started without --weight-transfer-config
    for path, body in (("/init_weight_transfer_engine", {"init_info": {}}), ("/update_weights", {"update_info": {}})):
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400 and "--weight-transfer-config" in r.json()["error"]["message"]


def test_pause_holds_new_calls_until_resume(server: RunningServer) -> None:
    assert httpx.get(server.url + "/is_paused").json() == {"is_paused": False}
    assert _post(server, "/pause?mode=wait", {}) == {"status": "paused"}
    assert httpx.get(server.url + "/is_paused").json() == {"is_paused": True}
    done: list[float] = []

    def call() -> None:
        _post(server, "/v1/completions", {"model": "tiny", "prompt": "Hi", "max_tokens": 2})
        done.append(time.monotonic())

    thread = threading.Thread(target=call)
    thread.start()
    deadline = time.monotonic() + 30
    while _metric(server, "vllm:num_requests_waiting") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, "vllm:num_requests_waiting") == 1
    assert not done  # held
    resumed = time.monotonic()
    assert _post(server, "/resume", {}) == {"status": "resumed"}
    thread.join(30)
    assert done and done[0] >= resumed
    assert "mode" in _post(server, "/pause?mode=freeze", {}, status=400)["error"]["message"]
    assert httpx.get(server.url + "/is_paused").json() == {"is_paused": False}


def test_pause_abort_and_abort_requests(server: RunningServer, sampler: Any) -> None:
    ids = _ids(sampler, "Tell me a long story.")
    longest = sampler.max_model_len - len(ids)
    body = {"model": "tiny", "prompt": ids, "max_tokens": longest, "ignore_eos": True}

    async def run() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as h:
            first = asyncio.ensure_future(h.post("/v1/completions", json={**body, "request_id": "long-1"}))
            await _until_running(h, "long-1")
            aborted = (await h.post("/abort_requests", json={"request_ids": ["long-1"]})).json()
            one = (await first).json()
            second = asyncio.ensure_future(h.post("/v1/completions", json={**body, "request_id": "long-2"}))
            await _until_running(h, "long-2")
            await h.post("/pause", params={"mode": "abort"})
            two = (await second).json()
            await h.post("/resume")
            return aborted, one, two

    aborted, one, two = asyncio.run(run())
    assert aborted == {"status": "aborted", "aborted": 1}
    for reply, rid in ((one, "long-1"), (two, "long-2")):
        assert reply["id"] == rid and reply["choices"][0]["finish_reason"] == "abort"
        assert len(reply["choices"][0]["token_ids"]) < longest


def test_an_aborted_chat_call_says_abort(server: RunningServer, sampler: Any) -> None:
    """A chat turn cut off by /abort_requests is not a natural end: an RL client must see "abort", not "stop"."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": sampler.max_model_len,  # cut to what the prompt leaves of the context
        "ignore_eos": True,
        "request_id": "chat-1",
    }

    async def run() -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as h:
            first = asyncio.ensure_future(h.post("/v1/chat/completions", json=body))
            await _until_running(h, "chat-1")
            await h.post("/abort_requests", json={"request_ids": ["chat-1"]})
            reply: dict[str, Any] = (await first).json()
            return reply

    choice = asyncio.run(run())["choices"][0]
    assert choice["finish_reason"] == "abort"


def _metric(server: RunningServer, name: str) -> float:
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {name}")


async def _until_running(h: httpx.AsyncClient, rid: str) -> None:
    for _ in range(600):
        if 'vllm:num_requests_running{model_name="tiny"} 1' in (await h.get("/metrics")).text:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{rid} never started")


def test_runtime_lora_routes(server: RunningServer, sampler: Any, model_dir: Path, tmp_path: Path) -> None:
    _save_adapter(model_dir, tmp_path / "a")
    out = _post(server, "/v1/load_lora_adapter", {"lora_name": "style", "lora_path": str(tmp_path / "a")})
    assert out["weights_version"] == sampler.weights_version and "style" in sampler.adapters
    listed = {m["id"]: m for m in httpx.get(server.url + "/v1/models").json()["data"]}
    assert listed["style"]["parent"] == "tiny" and listed["style"]["root"] == str(tmp_path / "a")
    ids = _ids(sampler, "Hi!")
    reply = _post(server, "/v1/completions", {"model": "style", "prompt": ids, "max_tokens": 4, "temperature": 0})
    direct = sampler.sample({"input_ids": ids}, {"temperature": 0, "max_tokens": 4}, "style")[0].sequences[0]
    assert reply["choices"][0]["token_ids"] == direct.tokens and reply["choices"][0]["adapter_name"] == "style"
    again = {"lora_name": "style", "lora_path": str(tmp_path / "a")}
    assert "load_inplace" in _post(server, "/v1/load_lora_adapter", again, status=400)["error"]["message"]
    replaced = _post(server, "/v1/load_lora_adapter", {**again, "load_inplace": True})
    assert replaced["weights_version"] == out["weights_version"] + 1
    _post(server, "/v1/unload_lora_adapter", {"lora_name": "style"})
    assert "style" not in sampler.adapters
    _post(server, "/v1/unload_lora_adapter", {"lora_name": "style"}, status=404)
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "none")}, status=400)


def test_control_routes_need_the_key(sampler: Any) -> None:
    with start_server(sampler, model_name="tiny", api_key="secret") as srv:
        assert httpx.get(srv.url + "/health").status_code == 200
        for method, path in (("POST", "/pause"), ("POST", "/v1/load_lora_adapter"), ("GET", "/metrics")):
            assert httpx.request(method, srv.url + path, json={}).status_code == 401
        ok = httpx.get(srv.url + "/is_paused", headers={"Authorization": "Bearer secret"})
        assert ok.json() == {"is_paused": False}


# -- the docs say what the code does -----------------------------------------------------------------------------

DOCS = Path(__file__).resolve().parents[1] / "docs" / "server.md"


def test_docs_field_table_is_the_code_table() -> None:
    from twinkle_core.server.protocol import fields_table

    text = DOCS.read_text()
    start = text.index("<!-- fields-table")
    body = text[text.index("\n", start) + 1 : text.index("<!-- /fields-table -->")]
    assert body == fields_table()


def test_docs_route_table_is_every_route(server: RunningServer) -> None:
    import re

    text = DOCS.read_text()
    section = text[text.index("## Routes") : text.index("## Request fields")]
    documented: set[tuple[str, str]] = set()
    for cell in re.findall(r"^\| ([^|]*(?:\\\|[^|]*)*) \|", section, flags=re.M):
        method = None
        for part in re.findall(r"`([^`]+)`|(/[\w/{}_-]+)", cell):
            token = part[0] or part[1]
            words = token.split()
            if len(words) == 2:
                method, path = words
            elif method is not None and token.startswith("/"):
                path = token
            else:
                continue
            documented.add((method, path.split("?")[0]))
    app = server._server.config.app
    served = {
        (m, re.sub(r"\{(\w+):\w+\}", r"{\1}", r.path))  # a converter ({id:path}) is not the docs' business
        for r in app.routes
        for m in getattr(r, "methods", None) or ()
        if m != "HEAD" and r.path not in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
    }
    assert documented == served


# -- the command line, as vLLM's --------------------------------------------------------------------------------


def _save_adapter(model_dir: Path, out: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(out))
    return out


def test_a_vllm_command_line_serves(model_dir: Path, tmp_path: Path) -> None:
    import json
    import os
    import socket
    import subprocess
    import sys

    adapter = _save_adapter(model_dir, tmp_path / "style")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # `vllm serve MODEL ...` with the program's name changed (and the engine named)
    argv = [str(model_dir), "--served-model-name", "policy", "--port", str(port), "--max-model-len", "256"]
    argv += [
        "--dtype",
        "float32",
        "--enable-lora",
        "--lora-modules",
        json.dumps({"name": "style", "path": str(adapter)}),
    ]
    cmd = [sys.executable, "-c", "from twinkle_core.cli import main; main()", "serve", *argv, "--engine", "torch"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "TWINKLE_API_KEY": ""})
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "Uvicorn running on" in line:
                break
        else:
            pytest.fail(f"twinkle serve exited with {proc.wait()}")
        models = {m["id"]: m for m in httpx.get(f"http://127.0.0.1:{port}/v1/models").json()["data"]}
        assert next(iter(models)) == "policy" and models["policy"]["max_model_len"] == 256
        assert models["style"]["root"] == str(adapter) and models["style"]["parent"] == "policy"
    finally:
        proc.terminate()
        proc.wait()


def test_command_line_mistakes_are_usage_errors(model_dir: Path) -> None:
    from click.testing import CliRunner

    from twinkle_core.cli import cli

    runner = CliRunner()
    twice = runner.invoke(cli, ["serve", str(model_dir), "--model", "other"])
    assert twice.exit_code == 2 and "given twice" in twice.output
    bad = runner.invoke(cli, ["serve", str(model_dir), "--lora-modules", '{"name": "x"}'])
    assert bad.exit_code == 2 and "'name' and 'path'" in bad.output


_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}{{ '\\n' }}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(server: RunningServer, sampler: Any) -> None:
    from twinkle_core.template import Template

    before = sampler.template
    sampler.set_template(Template(before.tokenizer, chat_template=_THINKING))
    try:
        messages = [{"role": "user", "content": "Hi!"}]
        body = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
        plain = _post(server, "/v1/chat/completions", body)["prompt_token_ids"]
        off = _post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"enable_thinking": False}})
        expected = sampler.template.with_options(enable_thinking=False).encode({"messages": messages}).input_ids
        assert off["prompt_token_ids"] == expected != plain
        assert sampler.template.decode(expected[len(plain) :]).strip() == "/no_think"
        tokenized = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
        assert _post(server, "/tokenize", tokenized)["tokens"] == expected
        bad_tokenize = {"messages": messages, "chat_template_kwargs": {"tokenize": False}}
        assert _post(server, "/tokenize", bad_tokenize, status=400)["error"]["param"] == "chat_template_kwargs"
        bad = {**body, "chat_template_kwargs": {"add_generation_prompt": False}}
        assert _post(server, "/v1/chat/completions", bad, status=400)["error"]["param"] == "chat_template_kwargs"
        # a session's episode continues only under the options it was opened with
        headers = {"X-Session-Id": "thinking"}
        first = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60).json()
        reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
        follow = {**body, "messages": [*messages, reply, {"role": "user", "content": "More."}]}
        options = {"chat_template_kwargs": {"enable_thinking": False}}
        r = httpx.post(server.url + "/v1/chat/completions", json={**follow, **options}, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(server.url + "/v1/sessions/thinking").json()["episodes"] == 2
    finally:
        sampler.set_template(before)


def test_message_names_and_the_developer_role_reach_the_template(server: RunningServer, sampler: Any) -> None:
    from twinkle_core.template import Template

    before = sampler.template
    sampler.set_template(Template(before.tokenizer, chat_template=_THINKING))
    try:
        messages = [
            {"role": "developer", "content": "Answer briefly."},
            {"role": "user", "name": "ada", "content": "Hi!"},
        ]
        body = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0, "return_token_ids": True}
        out = _post(server, "/v1/chat/completions", body)
        expected = sampler.template.encode({"messages": messages}).input_ids
        assert out["prompt_token_ids"] == expected
        text = sampler.template.decode(expected, skip_special_tokens=False)
        assert "<|im_start|>developer\nAnswer briefly." in text and "<|im_start|>user (ada)\nHi!" in text
        assert _post(server, "/tokenize", {"messages": messages})["tokens"] == expected
        # a name is part of the message: a session continues an episode only when the names agree
        headers = {"X-Session-Id": "names"}
        first = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60).json()
        reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
        renamed = [messages[0], {**messages[1], "name": "bob"}, reply, {"role": "user", "content": "More."}]
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, "messages": renamed}, headers=headers)
        assert r.status_code == 200, r.text
        assert httpx.get(server.url + "/v1/sessions/names").json()["episodes"] == 2
        bad = {**body, "messages": [{"role": "user", "name": 7, "content": "Hi!"}]}
        assert "name" in _post(server, "/v1/chat/completions", bad, status=400)["error"]["message"]
    finally:
        sampler.set_template(before)


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def test_a_session_continues_an_episode_only_under_the_same_tools(server: RunningServer, sampler: Any) -> None:
    # The tools are rendered into the prompt: an episode continued under other tools would hold tokens
    # (and export a tool list) that no call of this session was sampled from.
    messages = [{"role": "user", "content": "Hi!"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0, "tools": [_tool("clock")]}
    for sid, tools, episodes in (("same-tools", [_tool("clock")], 1), ("new-tools", [_tool("clock"), _tool("map")], 2)):
        headers = {"X-Session-Id": sid}
        first = httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60).json()
        reply = {"role": "assistant", "content": first["choices"][0]["message"]["content"]}
        follow = {**body, "messages": [*messages, reply, {"role": "user", "content": "More."}], "tools": tools}
        r = httpx.post(server.url + "/v1/chat/completions", json=follow, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        session = httpx.get(server.url + f"/v1/sessions/{sid}").json()
        assert session["episodes"] == episodes
        last = session["data"][-1]
        assert [t["function"]["name"] for t in last["tools"]] == [t["function"]["name"] for t in tools]
        if episodes == 2:  # the new episode's prompt is the messages rendered with the new tools
            want = sampler.template.encode({"messages": follow["messages"], "tools": tools}).input_ids
            assert last["feature"]["input_ids"][: len(want)] == list(want)


def test_session_ids_with_slashes_are_reachable_and_reserved_ids_refused(server: RunningServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 2, "temperature": 0}
    sid = "run-3/episode-17"
    assert httpx.post(server.url + "/v1/chat/completions", json={**body, "session_id": sid}, timeout=60).is_success
    got = httpx.get(server.url + f"/v1/sessions/{sid}")
    assert got.status_code == 200 and got.json()["id"] == sid and got.json()["episodes"] == 1
    lines = httpx.get(server.url + f"/v1/sessions/{sid}/export").text.splitlines()
    assert [json.loads(line)["session_id"] for line in lines] == [sid]
    assert sid in [
        json.loads(line)["session_id"] for line in httpx.get(server.url + "/v1/sessions/export").text.splitlines()
    ]
    assert httpx.delete(server.url + f"/v1/sessions/{sid}").json()["deleted"] is True
    assert httpx.get(server.url + f"/v1/sessions/{sid}").status_code == 404
    for where, extra, headers in (
        ("session_id", {"session_id": "export"}, {}),
        ("user", {"user": "run-3/export"}, {}),
        ("X-Session-Id", {}, {"X-Session-Id": "a/export"}),
    ):
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, **extra}, headers=headers, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == where, r.text
    assert all(not s["id"].endswith("export") for s in httpx.get(server.url + "/v1/sessions").json()["data"])


def test_a_budget_beyond_the_context_is_refused_and_one_within_it_is_cut(server: RunningServer, sampler: Any) -> None:
    """As vLLM's server: max_tokens over max_model_len is a 400 naming it; up to it, the reply ends at the context."""
    context = sampler.max_model_len
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi!"}], "ignore_eos": True, "temperature": 0}
    text = {"model": "tiny", "prompt": _ids(sampler, "Hi!"), "ignore_eos": True, "temperature": 0}
    for route, body, name in (
        ("/v1/chat/completions", {**chat, "max_tokens": context + 1}, "max_tokens"),
        (
            "/v1/chat/completions",
            {**chat, "max_tokens": 4, "max_completion_tokens": context + 1},
            "max_completion_tokens",
        ),
        ("/v1/completions", {**text, "max_tokens": 10**9}, "max_tokens"),
    ):
        err = _post(server, route, body, status=400)["error"]
        asked = body.get("max_completion_tokens", body["max_tokens"])
        assert err["param"] == name and f"{name}={asked}" in err["message"] and f"{context} tokens" in err["message"]
    reply = _post(server, "/v1/completions", {**text, "max_tokens": context})
    choice, usage = reply["choices"][0], reply["usage"]
    assert choice["finish_reason"] == "length" and usage["prompt_tokens"] + usage["completion_tokens"] == context
    # the server went on serving
    assert _post(server, "/v1/chat/completions", {**chat, "max_tokens": 3})["usage"]["completion_tokens"] == 3


def test_refused_prompts_and_options_are_named_as_the_body_sent_them(server: RunningServer, sampler: Any) -> None:
    limit = sampler.max_model_len - 1
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 600}], "max_tokens": 2}
    err = _post(server, "/v1/chat/completions", chat, status=400)["error"]
    assert err["param"] == "messages" and f"at most {limit} prompt tokens" in err["message"]
    assert "on_invalid" not in err["message"] and "inputs[" not in err["message"]
    text = {"model": "tiny", "max_tokens": 2}
    for prompt, where, needle in (
        ("hi " * 600, "prompt", "The prompt has"),
        (["hi", "hi " * 600], "prompt", "The prompt[1] has"),
        ([[5, 6], [5, 10**6]], "prompt", "prompt[1] has token id 1000000 outside the vocabulary"),
    ):
        err = _post(server, "/v1/completions", {**text, "prompt": prompt}, status=400)["error"]
        assert err["param"] == where and needle in err["message"] and "inputs[" not in err["message"], err
    for route, body in (
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {**text, "prompt": "hi"}),
    ):
        err = _post(server, route, {**body, "stream_options": {"include_usage": True}}, status=400)["error"]
        assert err["param"] == "stream_options" and "stream=true" in err["message"]
        err = _post(server, route, {**body, "structured_outputs": {"rgx": "[a-z]+"}}, status=400)["error"]
        assert err["param"] == "structured_outputs" and "'rgx'" in err["message"], err
