"""Agent frameworks, unmodified, against ``twinkle serve``: what they send is answered, and recorded token-exactly.

The OpenAI Agents SDK with its default Responses model (its chat-completions
model runs in ``test_server_clients.py``), pydantic-ai with a structured
``output_type`` (a forced ``tool_choice``) and with tools, and LangChain's
``ChatOpenAI`` with tools (free and forced) and structured output by function
calling (a named ``tool_choice``), each over the tiny model on
the torch engine. Expectations come from the same sampler in process
(greedy), given the body the framework sent: the test watches the real
client's HTTP traffic through httpx's event hooks, without touching the
framework.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")

from pydantic import BaseModel  # noqa: E402

from twinkle_core.server import RunningServer  # noqa: E402
from twinkle_core.server.protocol import openai_messages, openai_tools  # noqa: E402
from twinkle_core.tool_choice import tool_constraint  # noqa: E402
from twinkle_core.tools import get_tool_parser  # noqa: E402

ASK = "What is the weather in Paris?"


class City(BaseModel):
    city: str


class Traffic:
    """The chat bodies a real client sent and the replies it got (httpx event hooks on its own HTTP client)."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def http(self) -> httpx.AsyncClient:
        """An HTTP client for the framework's OpenAI client that records each chat call."""

        async def on_response(response: httpx.Response) -> None:
            await response.aread()
            if response.request.url.path.endswith("/chat/completions") and response.status_code == 200:
                self.calls.append((json.loads(response.request.content), response.json()))

        return httpx.AsyncClient(event_hooks={"response": [on_response]})

    def client(self, server: RunningServer, session: str) -> Any:
        return openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, http_client=self.http(),
            default_headers={"X-Session-Id": session},
        )  # fmt: skip


def _expected_tokens(sampler: Any, body: dict[str, Any]) -> list[int]:
    """The engine's own greedy turn for a chat body, under the constraint its tool_choice asks for."""
    params: dict[str, Any] = {"temperature": 0, "max_tokens": body.get("max_completion_tokens") or body["max_tokens"]}
    constraint = tool_constraint(
        get_tool_parser("hermes"), body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    )
    if constraint is not None:
        params["structured_outputs"] = {"grammar": constraint.grammar}
    conversation = {"messages": openai_messages(body["messages"]), "tools": openai_tools(body.get("tools"))}
    return list(sampler.sample(conversation, params)[0].sequences[0].tokens)


def _episode(server: RunningServer, session: str) -> dict[str, Any]:
    exported = httpx.get(server.url + f"/v1/sessions/{session}").json()
    assert exported["episodes"] == 1, exported["episodes"]  # every turn of the run in one episode
    [episode] = exported["data"]
    feature = episode["feature"]
    turns = feature["extra"]["turns"]
    masked = [i for i, m in enumerate(feature["extra"]["loss_mask"]) if m]
    assert masked == [i for t in turns for i in range(t["start"], t["end"])]  # sampled tokens, and only they
    return episode


def _turn_tokens(episode: dict[str, Any], k: int) -> list[int]:
    turn = episode["feature"]["extra"]["turns"][k]
    return list(episode["feature"]["input_ids"][turn["start"] : turn["end"]])


# -- OpenAI Agents SDK, default (Responses) model ----------------------------------------------------------------


def test_agents_sdk_responses_model_tool_loop_is_one_token_exact_episode(server: RunningServer, sampler: Any) -> None:
    from agents import Agent, FunctionTool, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    asked: list[str] = []

    async def get_weather(ctx: Any, arguments: str) -> str:
        asked.append(json.loads(arguments)["city"])
        return "21 degrees and sunny"

    tool = FunctionTool(
        name="get_weather",
        description="Get the weather in a city.",
        params_json_schema={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        on_invoke_tool=get_weather,
        strict_json_schema=False,
    )
    client = openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="unused", max_retries=0, default_headers={"X-Session-Id": "agents-resp"}
    )
    agent = Agent(
        name="weather",
        tools=[tool],
        model=OpenAIResponsesModel(model="tiny", openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=48),
    )
    result = asyncio.run(Runner.run(agent, ASK, max_turns=4))
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"] and len(asked) == 1
    episode = _episode(server, "agents-resp")
    assert len(episode["feature"]["extra"]["turns"]) == 2
    assert sampler.template.decode(_turn_tokens(episode, 1)).strip() == result.final_output.strip()
    # the first turn is the engine's own greedy turn for the opening conversation
    tools = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                               "parameters": tool.params_json_schema}}]  # fmt: skip
    direct = sampler.sample({"messages": [{"role": "user", "content": ASK}], "tools": tools},
                            {"temperature": 0, "max_tokens": 48})  # fmt: skip
    assert _turn_tokens(episode, 0) == direct[0].sequences[0].tokens


# -- pydantic-ai -------------------------------------------------------------------------------------------------


def _pydantic_ai_model(client: Any) -> Any:
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel("tiny", provider=OpenAIProvider(openai_client=client))


def test_pydantic_ai_structured_output_type(server: RunningServer, sampler: Any) -> None:
    from pydantic_ai import Agent

    traffic = Traffic()
    agent = Agent(
        _pydantic_ai_model(traffic.client(server, "pai-output")),
        output_type=City,
        model_settings={"temperature": 0, "max_tokens": 64},
    )
    result = agent.run_sync(ASK)
    [(body, reply)] = traffic.calls
    assert body["tool_choice"] == "required"  # pydantic-ai's default output mode: a forced call of its output tool
    [call] = reply["choices"][0]["message"]["tool_calls"]
    assert result.output == City.model_validate_json(call["function"]["arguments"])
    assert reply["choices"][0]["token_ids"] == _expected_tokens(sampler, body)
    episode = _episode(server, "pai-output")
    assert _turn_tokens(episode, 0) == reply["choices"][0]["token_ids"]
    assert episode["feature"]["extra"]["turns"][0]["constraint"]["tool_choice"] == "required"


def test_pydantic_ai_tools_and_output_type(server: RunningServer, sampler: Any) -> None:
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.tools import ToolDefinition

    traffic = Traffic()
    agent = Agent(
        _pydantic_ai_model(traffic.client(server, "pai-tools")),
        output_type=City,
        model_settings={"temperature": 0, "max_tokens": 64},
    )
    asked: list[str] = []

    async def until_called(ctx: RunContext[None], tool: ToolDefinition) -> ToolDefinition | None:
        return None if asked else tool  # offered until called once: then the agent must give its output

    @agent.tool_plain(prepare=until_called)
    def get_weather(city: str) -> str:
        """Get the weather in a city."""
        asked.append(city)
        return "21 degrees and sunny"

    result = agent.run_sync(ASK)
    assert len(traffic.calls) == 2
    first_reply, second_reply = (reply for _, reply in traffic.calls)
    [call] = first_reply["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and asked == [json.loads(call["function"]["arguments"])["city"]]
    [output] = second_reply["choices"][0]["message"]["tool_calls"]
    assert output["function"]["name"] == "final_result"
    assert result.output == City.model_validate_json(output["function"]["arguments"])
    for body, reply in traffic.calls:
        assert body["tool_choice"] == "required"
        assert reply["choices"][0]["token_ids"] == _expected_tokens(sampler, body)
    # The second call offers other tools than the first, which its prompt renders: a new episode of the session.
    exported = httpx.get(server.url + "/v1/sessions/pai-tools").json()
    assert exported["episodes"] == 2 and exported["turns"] == 2


# -- LangChain ---------------------------------------------------------------------------------------------------


def test_langchain_tools_and_structured_output(server: RunningServer, sampler: Any) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the weather in a city."""
        return "21 degrees and sunny"

    traffic = Traffic()
    llm = ChatOpenAI(
        model="tiny", temperature=0, max_tokens=48, max_retries=0, base_url=server.url + "/v1",
        api_key="unused", http_async_client=traffic.http(),  # type: ignore[arg-type]
    )  # fmt: skip

    async def run() -> tuple[Any, Any, Any]:
        free = await llm.bind_tools([get_weather]).ainvoke(ASK)
        forced = await llm.bind_tools([get_weather], tool_choice="get_weather").ainvoke("Say hello.")
        function = await llm.with_structured_output(City, method="function_calling").ainvoke(ASK)  # a named choice
        return free, forced, function

    free, forced, function = asyncio.run(run())
    bodies = [body for body, _ in traffic.calls]
    replies = [reply["choices"][0] for _, reply in traffic.calls]
    assert [r["token_ids"] for r in replies] == [_expected_tokens(sampler, b) for b in bodies]
    assert free.tool_calls == [] or free.tool_calls[0]["name"] == "get_weather"
    assert [c["name"] for c in forced.tool_calls] == ["get_weather"]  # forced, on a prompt that calls nothing
    assert bodies[2]["tool_choice"]["function"]["name"] == "City"
    assert function == City.model_validate_json(replies[2]["message"]["tool_calls"][0]["function"]["arguments"])
