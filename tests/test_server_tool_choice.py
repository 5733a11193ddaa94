"""Forced and limited tool calls on ``twinkle serve``: ``tool_choice`` and ``parallel_tool_calls``.

The real ``openai`` client against a server over the tiny model (torch engine;
the vLLM engine once). Expectations come from the same sampler in process,
given the constraint the server builds (:func:`twinkle_core.tool_choice.tool_constraint`).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")

from twinkle_core.server import RunningServer, start_server  # noqa: E402
from twinkle_core.testing import build_tiny_model  # noqa: E402
from twinkle_core.testing.tiny_model import TINY_WEATHER_TOOL  # noqa: E402
from twinkle_core.tool_choice import tool_constraint  # noqa: E402
from twinkle_core.tools import get_tool_parser  # noqa: E402

WEATHER = TINY_WEATHER_TOOL
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
# what the template renders (the server takes `strict` out: it is a constraint, not part of the prompt)
RENDERED = [WEATHER, {**ADD, "function": {k: v for k, v in ADD["function"].items() if k != "strict"}}]
HELLO = [{"role": "user", "content": "Say hello."}]  # the tiny model answers it without a call
NAMED_ADD = {"type": "function", "function": {"name": "add"}}


def _direct(sampler: Any, messages: Any, tool_choice: Any, parallel: bool | None, **params: Any) -> Any:
    """The engine's own completion under the constraint the server builds for these fields."""
    constraint = tool_constraint(get_tool_parser("hermes"), TOOLS, tool_choice, parallel)
    assert constraint is not None
    return sampler.sample(
        {"messages": messages, "tools": RENDERED},
        {"max_tokens": 64, "logprobs": 0, "structured_outputs": {"grammar": constraint.grammar}, **params},
    )[0].sequences[0]


@pytest.mark.parametrize(
    ("tool_choice", "parallel"), [("required", None), (NAMED_ADD, None), ("required", False), ("auto", False)]
)
def test_forced_and_single_calls_are_what_the_engine_samples_under_the_constraint(
    client: Any, server: RunningServer, sampler: Any, tool_choice: Any, parallel: bool | None
) -> None:
    session = f"tc-{json.dumps(tool_choice)}-{parallel}"
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=1.0,
        seed=7,
        max_tokens=64,
        extra_headers={"X-Session-Id": session},
        **extra,
    )
    [choice] = r.choices
    direct = _direct(sampler, HELLO, tool_choice, parallel, temperature=1.0, seed=7)
    assert choice.model_extra["token_ids"] == direct.tokens
    assert choice.model_extra["sampled_logprobs"] == pytest.approx(direct.logprobs, abs=1e-5)
    calls = choice.message.tool_calls or []
    if tool_choice != "auto":  # forced: the turn holds calls, read back by the parser
        assert calls and choice.finish_reason == "tool_calls"
    if tool_choice == NAMED_ADD:
        assert {c.function.name for c in calls} == {"add"}
        for c in calls:  # strict: exactly the schema's integers
            args = json.loads(c.function.arguments)
            assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())
    if parallel is False:
        assert len(calls) <= 1
    exported = httpx.get(server.url + f"/v1/sessions/{session}").json()
    [turn] = exported["data"][0]["feature"]["extra"]["turns"]
    forced = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else tool_choice
    assert turn["constraint"] == {"tool_choice": forced, "parallel_tool_calls": parallel is not False}


def test_the_constraint_is_in_the_processed_log_probs(client: Any, sampler: Any) -> None:
    # The named call's tokens, scored by the model alone, are less likely than under the constraint
    # (which removes every token the call syntax does not allow): the trainer sees the drawn distribution.
    r = client.chat.completions.create(
        model="tiny", messages=HELLO, tools=TOOLS, tool_choice=NAMED_ADD, temperature=0, max_tokens=64
    )
    [choice] = r.choices
    tokens, constrained = choice.model_extra["token_ids"], choice.model_extra["sampled_logprobs"]
    prompt = list(sampler.template.encode({"messages": HELLO, "tools": RENDERED}, add_generation_prompt=True).input_ids)
    free = sampler.sample({"input_ids": prompt + tokens}, {"max_tokens": 1, "prompt_logprobs": 0})[0]
    unconstrained = free.prompt_logprobs[len(prompt) :]
    assert all(c >= u - 1e-4 for c, u in zip(constrained, unconstrained))
    assert sum(constrained) > sum(unconstrained) + 1.0
    # no-choice turns are unchanged: the same call without tool_choice is unconstrained
    plain = client.chat.completions.create(model="tiny", messages=HELLO, tools=TOOLS, temperature=0, max_tokens=16)
    direct = sampler.sample({"messages": HELLO, "tools": RENDERED}, {"temperature": 0, "max_tokens": 16})
    assert plain.choices[0].model_extra["token_ids"] == direct[0].sequences[0].tokens


def test_a_forced_call_continues_the_episode_token_exactly(client: Any, server: RunningServer, sampler: Any) -> None:
    session = "tc-loop"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=64,
        parallel_tool_calls=False, extra_headers={"X-Session-Id": session},
    )  # fmt: skip
    [call] = first.choices[0].message.tool_calls
    messages += [
        first.choices[0].message.model_dump(include={"role", "content", "tool_calls"}),
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"},
    ]
    headers = {"X-Session-Id": session}
    client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=16, extra_headers=headers
    )
    exported = httpx.get(server.url + f"/v1/sessions/{session}").json()
    assert exported["episodes"] == 1 and exported["turns"] == 2
    turns = exported["data"][0]["feature"]["extra"]["turns"]
    assert [t["constraint"] for t in turns] == [{"tool_choice": "required", "parallel_tool_calls": False}, None]
    ids = exported["data"][0]["feature"]["input_ids"]
    assert ids[turns[0]["start"] : turns[0]["end"]] == first.choices[0].model_extra["token_ids"]


BAD_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": {"type": "flute"}}}


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tool_choice": NAMED_ADD}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'sometimes'"),
        ({"tools": [WEATHER, BAD_SCHEMA], "tool_choice": "required"}, "tools[1].function.parameters", "flute"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", '"no"'),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "response_format",
        ),
    ],
)
def test_tool_choices_that_cannot_be_honoured_are_400s_naming_the_field(
    server: RunningServer, client: Any, fields: dict[str, Any], param: str, needle: str
) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": HELLO, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"]
    ok = client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2)  # the server is unaffected
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_a_parser_without_a_call_format_refuses_forced_calls(sampler: Any) -> None:
    with start_server(sampler, model_name="tiny", tool_parser="none") as srv:
        body = {"model": "tiny", "messages": HELLO, "tools": TOOLS, "tool_choice": "required"}
        r = httpx.post(srv.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "'none'" in r.json()["error"]["message"]


def test_forced_calls_on_the_vllm_engine() -> None:
    pytest.importorskip("vllm")
    from twinkle_vllm.sampler import vLLMSampler

    args = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "dtype": "float32", "max_num_seqs": 8}
    with vLLMSampler(build_tiny_model("llama"), engine_args=args) as sampler, start_server(sampler) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            model="twinkle", messages=HELLO, tools=TOOLS, tool_choice=NAMED_ADD, parallel_tool_calls=False,
            temperature=0, max_tokens=64,
        )  # fmt: skip
        direct = _direct(sampler, HELLO, NAMED_ADD, False, temperature=0)
    [choice] = r.choices
    assert choice.model_extra["token_ids"] == direct.tokens
    assert choice.model_extra["sampled_logprobs"] == pytest.approx(direct.logprobs, abs=1e-5)
    assert [c.function.name for c in choice.message.tool_calls] == ["add"]
