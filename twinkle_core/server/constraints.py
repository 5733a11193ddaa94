"""A call's constraint on what is sampled: ``tool_choice`` / ``parallel_tool_calls`` and structured outputs.

Both routes that sample turns (``/v1/chat/completions`` and ``/v1/responses``)
take the same decision here: the tool-call grammar of
:mod:`twinkle_core.tool_choice` becomes the call's
``SamplingParams.structured_outputs``, so the engines constrain it like any
other grammar. A body that asks for both a forced tool call and a response
format is refused: one completion cannot be both. What constrained a turn is
recorded on it (``Episode.constraint``), and so in the session export.
"""

from __future__ import annotations

from typing import Any

from twinkle_core.data_format import SamplingParams
from twinkle_core.errors import TwinkleError
from twinkle_core.server.protocol import ApiError
from twinkle_core.tool_choice import ToolChoiceError, tool_constraint
from twinkle_core.tools import ToolCallParser

__all__ = ["constrain"]


def constrain(
    params: SamplingParams,
    parser: ToolCallParser,
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: Any,
    names: dict[str, str],
    *,
    format_field: str = "response_format",
) -> tuple[SamplingParams, dict[str, Any] | None]:
    """``params`` with the call's tool-call constraint, and what the turn records of its constraint.

    ``names``: the body's names of the sampling fields (:func:`body_names`); a
    grammar the engine refuses later is then reported as ``tool_choice``.
    ``format_field``: what the body calls its structured-output field.

    Raises:
        ApiError: a 400 naming the field that cannot be honoured.
    """
    try:
        constraint = tool_constraint(parser, tools, tool_choice, parallel_tool_calls)
    except ToolChoiceError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None
    except TwinkleError as exc:  # xgrammar missing
        raise ApiError(400, str(exc), param="tool_choice") from None
    if constraint is None:
        structured = params.structured_outputs
        return params, ({"structured_outputs": structured.kind} if structured is not None else None)
    if params.structured_outputs is not None:
        raise ApiError(
            400,
            f"{format_field} and tool_choice={constraint.tool_choice!r} (with parallel_tool_calls="
            f"{str(constraint.parallel_tool_calls).lower()}) both constrain the reply: a turn is either tool calls"
            f" or the format. Leave out {format_field}, or use tool_choice 'auto'.",
            param="tool_choice",
        )
    names["structured_outputs"] = "tool_choice"
    return params.replace(structured_outputs={"grammar": constraint.grammar}), constraint.describe()
