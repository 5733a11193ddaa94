"""Forced and limited tool calls: ``tool_choice`` and ``parallel_tool_calls`` as a grammar in the model's own syntax.

OpenAI's (and vLLM's) ``tool_choice`` asks for more than a parser can give
after the fact: ``"required"`` means at least one call, a named function
``{"type": "function", "function": {"name": ...}}`` means exactly that call,
and ``parallel_tool_calls=false`` means at most one. twinkle gets them the
way it gets every other constraint: by constraining what is sampled, so the
tokens recorded in the episode are the tokens drawn, with the log-probs of
the distribution they were drawn from (the constraint is part of the
processed log-probs and of the sampling mask, like any structured output).

The constraint is written in the model's own tool-call syntax, the one its
tool parser reads back (:mod:`twinkle_core.tools`): a parser names the
xgrammar *structural tag* of its format (``hermes`` is xgrammar's
``qwen_3``: ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``),
and xgrammar builds, from the tools' JSON schemas, a grammar whose calls
name only the allowed functions and whose arguments match each schema.
``strict`` is honoured as vLLM and xgrammar read it: ``strict: false``
leaves a tool's arguments any JSON value; otherwise (``true`` or unset) they
match its ``parameters`` schema exactly (no properties it does not list).

The result is an EBNF grammar, given to the engine as
``SamplingParams.structured_outputs={"grammar": ...}``, so both engines run
it through the path their structured outputs already take.

What is constrained:

* ``"none"``: nothing (the parser is off, as before).
* ``"auto"`` (or unset): nothing, unless ``parallel_tool_calls=False``:
  then free text, and at most one call, after which the turn ends.
* ``"required"``: free text, then at least one call (exactly one with
  ``parallel_tool_calls=False``); the turn ends after the calls.
* a named function: exactly one call to that function, nothing else.

Importing this module imports nothing heavy; xgrammar is imported when a
constraint is built.
"""

from __future__ import annotations

import json
import re
from typing import Any

import attrs

from twinkle_core.errors import InvalidInputError, UnsupportedFeatureError
from twinkle_core.tools import ToolCallParser

__all__ = ["ToolChoiceError", "ToolConstraint", "tool_constraint"]


class ToolChoiceError(InvalidInputError):
    """A ``tool_choice``, ``parallel_tool_calls`` or tool schema that cannot be honoured.

    Attributes:
        field: the request field at fault, as an OpenAI body names it
            (``"tool_choice"``, ``"tools[2].function.parameters"``...).
    """

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


@attrs.frozen(kw_only=True)
class ToolConstraint:
    """A turn's tool-call constraint: what was asked, and the grammar that enforces it.

    Attributes:
        tool_choice: ``"auto"``, ``"required"``, or the forced function's name.
        parallel_tool_calls: False when the turn may hold at most one call.
        grammar: the EBNF grammar the completion must match.
    """

    tool_choice: str
    parallel_tool_calls: bool
    grammar: str

    def describe(self) -> dict[str, Any]:
        """What the session export records for a constrained turn (the grammar left out: it is long)."""
        return {"tool_choice": self.tool_choice, "parallel_tool_calls": self.parallel_tool_calls}


def _choice_name(tool_choice: Any) -> str | None:
    """The function a named ``tool_choice`` forces; ``None`` for the string choices."""
    if tool_choice is None:
        return None
    if isinstance(tool_choice, str):
        if tool_choice in ("none", "auto", "required"):
            return None
        raise ToolChoiceError(
            f"tool_choice={tool_choice!r:.80} is invalid: expected 'none', 'auto', 'required' or"
            ' {"type": "function", "function": {"name": ...}}.',
            field="tool_choice",
        )
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else tool_choice.get("name")  # Responses: {"type", "name"}
        if tool_choice.get("type") == "function" and isinstance(name, str) and name:
            return name
    raise ToolChoiceError(
        f"tool_choice={json.dumps(tool_choice)[:200]} is invalid: a named choice is"
        ' {"type": "function", "function": {"name": ...}}; the string choices are \'none\', \'auto\' and'
        " 'required'.",
        field="tool_choice",
    )


def tool_constraint(
    parser: ToolCallParser,
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: Any,
) -> ToolConstraint | None:
    """The constraint ``tool_choice`` and ``parallel_tool_calls`` ask for (``None``: the turn is unconstrained).

    Args:
        parser: the tool parser that reads the turn back (its format is the grammar's).
        tools: the request's tools, OpenAI chat shape (``{"type": "function", "function": {...}}``).
        tool_choice: ``None``, ``"none"``, ``"auto"``, ``"required"`` or a named function.
        parallel_tool_calls: ``None`` or a boolean (``False``: at most one call).

    Raises:
        ToolChoiceError: a choice without tools, a name not among them, a parser
            without a constrainable format, a schema the grammar compiler refuses.
        UnsupportedFeatureError: xgrammar is not installed.
    """
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolChoiceError(
            f"parallel_tool_calls={json.dumps(parallel_tool_calls)[:80]} is invalid: expected true or false.",
            field="parallel_tool_calls",
        )
    name = _choice_name(tool_choice)
    parallel = parallel_tool_calls is not False
    mode = "named" if name is not None else tool_choice or "auto"
    if mode == "none" or (mode == "auto" and parallel) or (mode == "auto" and not tools):
        return None
    if not tools:
        raise ToolChoiceError(
            f"tool_choice={json.dumps(tool_choice)[:200]} needs tools: give the functions it may call in 'tools'"
            " (or leave tool_choice out).",
            field="tool_choice",
        )
    names = [_tool_name(t) for t in tools]
    if name is not None and name not in names:
        raise ToolChoiceError(
            f"tool_choice names the function {name!r:.80}, which is not among the tools: expected one of"
            f" {', '.join(repr(n) for n in names)}.",
            field="tool_choice",
        )
    fmt = parser.structural_tag_format
    if fmt is None:
        raise ToolChoiceError(
            f"tool_choice={json.dumps(tool_choice)[:200]} with parallel_tool_calls={json.dumps(parallel_tool_calls)}"
            f" needs a constrained tool-call format, and this server's tool parser {parser.name!r} has none:"
            " use 'auto' or 'none', or start the server with a parser that has one (hermes).",
            field="tool_choice",
        )
    grammar = _grammar(fmt, tools, {"type": "function", "function": {"name": name}} if name else mode, parallel)
    return ToolConstraint(tool_choice=name or mode, parallel_tool_calls=parallel, grammar=grammar)


def _tool_name(tool: Any) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) else ""


def _grammar(fmt: str, tools: list[dict[str, Any]], choice: Any, parallel: bool) -> str:
    try:
        import xgrammar as xgr
    except ImportError as exc:
        raise UnsupportedFeatureError(
            "tool_choice 'required', a named function and parallel_tool_calls=false need the xgrammar library:"
            " pip install xgrammar (the vLLM install brings it)."
        ) from exc
    try:
        tag = xgr.get_model_structural_tag(
            fmt, tools=list(tools), tool_choice=choice, reasoning="disabled", parallel_tool_calls=parallel
        )
        return str(xgr.Grammar.from_structural_tag(tag))
    except Exception as exc:  # xgrammar raises ValueError, RuntimeError or its own errors
        where = _bad_schema(xgr, tools)
        if where is None:
            raise ToolChoiceError(
                f"The tool-call constraint for tool_choice={json.dumps(choice)[:200]} does not compile:"
                f" {_message(exc)}.",
                field="tool_choice",
            ) from None
        index, why = where
        raise ToolChoiceError(
            f"tools[{index}].function.parameters={json.dumps(tools[index]['function'].get('parameters'))[:200]} is"
            f" a JSON schema the grammar compiler refuses ({why}): fix it, or mark the tool strict: false to leave"
            " its arguments unconstrained.",
            field=f"tools[{index}].function.parameters",
        ) from None


def _bad_schema(xgr: Any, tools: list[dict[str, Any]]) -> tuple[int, str] | None:
    """The first tool whose schema xgrammar refuses, and why."""
    for i, tool in enumerate(tools):
        fn = tool.get("function") or {}
        params = fn.get("parameters")
        if fn.get("strict") is False or params is None:
            continue
        try:
            xgr.Grammar.from_json_schema(json.dumps(params))
        except Exception as exc:
            return i, _message(exc)
    return None


def _message(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    # xgrammar prefixes "[time] file.cc:line: "
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[-1]) if lines else type(exc).__name__
