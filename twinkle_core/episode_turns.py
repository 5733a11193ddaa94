"""The records of a token-exact episode: the runs of tokens appended to it, and its sampled turns.

They live here, beside :class:`~twinkle_core.episode.Episode` (which re-exports them), so that the
episode's module holds its behaviour alone.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from twinkle_core.data_format import Message

__all__ = ["Segment", "Turn"]


@attrs.define(kw_only=True)
class Segment:
    """A run of tokens appended to an episode in one step.

    Attributes:
        kind: ``"prompt"`` (the first encoding), ``"sampled"`` (a turn, as
            sampled), ``"closing"`` (the template's end of a sampled turn) or
            ``"delta"`` (new messages and the next generation prompt).
        tokens: the token ids.
    """

    kind: Literal["prompt", "sampled", "closing", "delta"]
    tokens: list[int]


@attrs.define(kw_only=True)
class Turn:
    """One sampled assistant turn of an episode.

    Attributes:
        start: the index of its first token in ``Episode.tokens``.
        tokens: the tokens as sampled.
        text: the completion's text.
        logprobs: the sampled tokens' log-probs (``None`` if the engine gave none).
        stop_reason: why it stopped (``"stop"``, ``"length"``, ``"abort"``).
        weights_version: the weights version that produced it.
        adapter_name: the adapter that produced it (``""``: the base model).
        message: the assistant message parsed from it (content and tool calls).
        tool_call_errors: one message per malformed tool call (left out of
            ``message.tool_calls``); reported here, never raised.
        top_logprobs: with ``logprobs=k > 0``, the top-k alternatives per position.
        constraint: what constrained its sampling (``None``: nothing), as
            :attr:`Episode.constraint` said when it was sampled, e.g.
            ``{"tool_choice": "required", "parallel_tool_calls": True}``.
        routed_experts: with ``return_routed_experts``, the sequence's
            ``routed_experts`` (see :class:`~twinkle_core.data_format.SampledSequence`).
    """

    start: int
    tokens: list[int]
    text: str
    logprobs: list[float] | None
    stop_reason: str
    weights_version: int
    adapter_name: str
    message: Message
    tool_call_errors: list[str] = attrs.field(factory=list)
    top_logprobs: Any = None
    constraint: dict[str, Any] | None = None
    routed_experts: Any = None

    @property
    def end(self) -> int:
        """One past its last token in ``Episode.tokens``."""
        return self.start + len(self.tokens)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The well-formed tool calls of the turn."""
        return list(self.message.tool_calls or [])
