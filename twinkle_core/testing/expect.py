"""Expectations taken from the engine's own outputs, for tests of the layers above it.

An agent or server test that asserts the tiny model calls ``get_weather`` with
the city it was asked about tests the model, and the tiny model is trained on
the machine that builds it: on another CPU it may answer with another city.
What such a test should check is that the layer under test (an episode, the
server) returns what the engine itself gives for the same conversation.
"""

from __future__ import annotations

from typing import Any

from twinkle_core.tools import get_tool_parser

__all__ = ["tool_calls_of"]


def tool_calls_of(sampler: Any, conversation: Any, params: Any, parser: str = "hermes") -> list[dict[str, Any]]:
    """The tool calls (``{"name", "arguments"}`` each) in the engine's own completion of ``conversation``.

    Raises:
        AssertionError: the completion holds no well-formed call (the test needs a model that calls tools).
    """
    text = sampler.sample(conversation, params)[0].sequences[0].text
    calls = [c["function"] for c in get_tool_parser(parser).parse(text).tool_calls]
    assert calls, f"the model made no tool call for this conversation: {text!r}"
    return calls
