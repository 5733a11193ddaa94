"""Tool-call parsers: from a completion's text to ``Message.tool_calls``, and their registry.

A model announces a tool call in its own text format; the chat template
renders calls back in that format when the conversation continues. A parser
reads the format out of a completion:

* ``content``: the text with the calls taken out (what an OpenAI client sees
  as ``message.content``);
* ``tool_calls``: each call in the OpenAI / Hugging Face shape,
  ``{"id", "type": "function", "function": {"name", "arguments"}}``, with
  ``arguments`` a dict (chat templates render dicts; the server turns them
  into the JSON string the OpenAI schema wants);
* ``errors``: one message per call that could not be read. A malformed call
  is the model's mistake, which an RL trainer wants to see and penalise,
  so it is reported on the turn, never raised.

Built in: ``hermes`` (Hermes / Qwen / the tiny model's ChatML,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and ``none``
(never parses a call). Plugins add parsers through the
``register_tool_parsers`` hook, exactly as templates are added.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any, ClassVar

import attrs

from twinkle_core.data_format.chat import json_data_problem
from twinkle_core.errors import TwinkleError
from twinkle_core.plugins.registry import PluginInfo, Registry

__all__ = [
    "HermesToolParser",
    "NoToolParser",
    "ParsedToolCalls",
    "ToolCallParser",
    "UnknownToolParserError",
    "get_tool_parser",
    "list_tool_parsers",
    "register_tool_parser",
    "tool_parser_registry",
]


class UnknownToolParserError(TwinkleError, LookupError):
    """No tool-call parser is registered under the requested name."""


@attrs.define(kw_only=True)
class ParsedToolCalls:
    """What a parser read out of one completion.

    Attributes:
        content: the completion's text without its tool calls.
        tool_calls: the well-formed calls, OpenAI shape, ``arguments`` a dict.
        errors: one message per malformed call (the call is left out).
    """

    content: str
    tool_calls: list[dict[str, Any]] = attrs.field(factory=list)
    errors: list[str] = attrs.field(factory=list)


class ToolCallParser:
    """Base class of tool-call parsers; subclasses implement :meth:`parse`.

    Parsers are stateless: one instance may parse many completions from many threads.
    """

    #: The registry name, for messages.
    name: ClassVar[str] = ""
    #: The xgrammar structural-tag format of the calls it reads (``None``: calls cannot be forced or
    #: limited, see :mod:`twinkle_core.tool_choice`).
    structural_tag_format: ClassVar[str | None] = None

    def parse(self, text: str) -> ParsedToolCalls:
        """Read the tool calls out of ``text`` (a completion, special tokens removed)."""
        raise NotImplementedError


class NoToolParser(ToolCallParser):
    """Never finds a tool call: the whole text is content."""

    name = "none"

    def parse(self, text: str) -> ParsedToolCalls:
        """Return ``text`` as content, with no calls."""
        return ParsedToolCalls(content=text)


def new_call_id() -> str:
    """A fresh tool-call id in OpenAI's style (``call_`` + 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


class HermesToolParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen, ChatML).

    A block that is not closed (the model stopped mid-call), whose body is not
    a JSON object, or that lacks a string ``name`` is an error; its text stays
    in ``content`` so nothing the model wrote disappears.
    """

    name = "hermes"
    structural_tag_format = "qwen_3"  # xgrammar's name for exactly this format
    _block = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedToolCalls:
        """Split ``text`` into content and calls; malformed calls become errors."""
        calls: list[dict[str, Any]] = []
        errors: list[str] = []
        kept: list[str] = []
        pos = 0
        for k, match in enumerate(self._block.finditer(text)):
            kept.append(text[pos : match.start()])
            pos = match.end()
            body, closed = match.group(1).strip(), bool(match.group(2))
            call, error = self._read(body, closed, k)
            if call is None:
                errors.append(str(error))
                kept.append(match.group(0))
            else:
                calls.append(call)
        kept.append(text[pos:])
        return ParsedToolCalls(content="".join(kept).strip(), tool_calls=calls, errors=errors)

    @staticmethod
    def _read(body: str, closed: bool, index: int) -> tuple[dict[str, Any] | None, str | None]:
        where = f"tool call {index}"
        if not closed:
            return None, f"{where} is not closed by </tool_call> (the completion ended inside it): {body[:200]!r}"
        try:
            obj = _strict_json(body)
        except ValueError as exc:
            return None, f"{where} is not valid JSON ({_json_problem(exc)}): {body[:200]!r}"
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None, f"{where} must be a JSON object with a non-empty string 'name': {body[:200]!r}"
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = _strict_json(args)
            except ValueError:
                return None, f"{where} ({obj['name']}) has 'arguments' that are not a JSON object: {args[:200]!r}"
        if not isinstance(args, dict):
            return None, f"{where} ({obj['name']}) has 'arguments' that are not a JSON object: {args!r:.200}"
        problem = json_data_problem(obj)
        if problem is not None:  # the call could not be rendered back into the conversation
            return None, f"{where} ({obj['name']!r:.80}) cannot go back into a prompt: {problem}: {body[:200]!r}"
        return {"id": new_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": args}}, None


def _strict_json(text: str) -> Any:
    """``json.loads`` as the JSON standard reads it: no NaN or Infinity, no number beyond float range.

    Raises:
        ValueError: anything that is not such JSON, nesting too deep for the parser included.
    """

    def number(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise ValueError(f"the number {literal[:40]} is beyond float range")
        return value

    def constant(literal: str) -> Any:
        raise ValueError(f"{literal} is not a JSON value")

    try:
        return json.loads(text, parse_float=number, parse_constant=constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _json_problem(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at position {exc.pos}"
    return str(exc)


tool_parser_registry: Registry[type[ToolCallParser]] = Registry(
    "tool parser", "register_tool_parsers", UnknownToolParserError
)
tool_parser_registry.register("hermes", HermesToolParser)
tool_parser_registry.register("none", NoToolParser)


def register_tool_parser(name: str, target: Any = None, *, replace: bool = False) -> Any:
    """Register a parser class (or ``"pkg.mod:Class"``) as ``name``; a decorator without ``target``."""
    return tool_parser_registry.register(name, target, replace=replace)


def get_tool_parser(parser: str | ToolCallParser | type[ToolCallParser]) -> ToolCallParser:
    """A parser instance from a registered name, a parser class or an instance.

    Raises:
        UnknownToolParserError: an unknown name (with did-you-mean and the names available).
    """
    if isinstance(parser, ToolCallParser):
        return parser
    if isinstance(parser, type) and issubclass(parser, ToolCallParser):
        return parser()
    if not isinstance(parser, str):
        raise UnknownToolParserError(
            f"tool_parser={parser!r} is invalid: expected a registered name"
            f" ({', '.join(tool_parser_registry.names())}), a ToolCallParser class or instance."
        )
    cls = tool_parser_registry.get(parser)
    if not (isinstance(cls, type) and issubclass(cls, ToolCallParser)):
        raise UnknownToolParserError(f"Tool parser {parser!r} resolves to {cls!r}, which is not a ToolCallParser.")
    return cls()


def list_tool_parsers() -> list[PluginInfo]:
    """Every registered tool-parser name."""
    return tool_parser_registry.infos()
