"""A chat turn of the server: its engine call, the episode it extends, and the pieces of its reply.

Shared by the chat route (:mod:`twinkle_core.server.chat`) and the Responses
route (:mod:`twinkle_core.server.responses`): both find or start a session's
episode (:func:`start_turn`), run one turn of it as a :class:`TurnCall`, and build
their replies from the recorded :class:`~twinkle_core.episode.Turn`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from fastapi import Request

from twinkle_core.data_format import Message, SamplingParams, Trajectory
from twinkle_core.episode import Episode, Turn
from twinkle_core.errors import TwinkleError
from twinkle_core.requests import Finished
from twinkle_core.server.calls import Pending
from twinkle_core.server.protocol import ApiError
from twinkle_core.server.sessions import Session
from twinkle_core.server.shapes import routes_field
from twinkle_core.server.state import ServerState

__all__ = [
    "SESSION_HEADER",
    "TurnCall",
    "openai_tool_calls",
    "request_session_id",
    "sse",
    "start_turn",
    "text_pieces",
    "turn_extras",
]

#: The header that names a session (the body's ``user`` field is the fallback).
SESSION_HEADER = "X-Session-Id"


def openai_tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A turn's parsed tool calls as OpenAI's ``tool_calls`` (``arguments`` a JSON string)."""
    return [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
        }
        for c in calls
    ]


class TurnCall:
    """A chat call in flight: the engine call, and the task that records its episodes.

    The task extends the episode with the sampled turn (aborted ones too)
    and records it in the session, then releases the session's lock, which
    the route took before matching the call to an episode: the session's
    next call sees this one's turn, whatever became of the client.
    """

    def __init__(
        self,
        sampler: Any,
        session: Session | None,
        base: Episode | None,
        target: Episode,
        params: SamplingParams,
        adapter: str,
    ) -> None:
        params = Episode.turn_params(sampler, params)
        self.pending = Pending(sampler, [target.prompt()], params, adapter)
        self.session, self.base, self.target, self.n = session, base, target, params.num_samples
        self.episodes: asyncio.Future[list[Episode]] = asyncio.get_running_loop().create_future()
        # Retrieved here so that a stream whose client left never logs "exception never retrieved".
        self.episodes.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._recorder = asyncio.ensure_future(self._record())

    async def _record(self) -> None:
        try:
            responses = await self.pending.responses()
            [response] = responses
            episodes = self.target.extend_sampled(response)
            if self.session is not None:
                stored = self.session.episodes
                if self.base is not None and self.base in stored:
                    stored[stored.index(self.base)] = episodes[0]
                    stored.extend(episodes[1:])
                else:
                    stored.extend(episodes)
            self.episodes.set_result(episodes)
        except asyncio.CancelledError:  # the server is shutting down
            self.episodes.cancel()
            raise
        except Exception as exc:  # handed to whoever awaits the call (the route turns it into an error body)
            self.episodes.set_exception(exc)
        finally:
            if self.session is not None:
                self.session.lock.release()

    def turn(self, item: Finished) -> Turn:
        """The turn a finished sequence makes (on a throwaway fork: the recorder keeps the real one)."""
        return self.target.fork().append_sampled(item.sequence)


def sse(obj: Any) -> str:
    """One server-sent event holding ``obj`` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


def request_session_id(request: Request, req: Any) -> str | None:
    """The session a chat call joins: the header, else the body's ``session_id``, else its ``user``.

    ``export`` and ids ending in ``/export`` are refused: the session routes
    could not tell them from the export routes, so they could not be read back.
    """
    for where, value in (
        (SESSION_HEADER, request.headers.get(SESSION_HEADER)),
        ("session_id", req.session_id),
        ("user", req.user),
    ):
        if value:
            if value == "export" or value.endswith("/export"):
                raise ApiError(
                    400,
                    f"{where}={value!r} cannot name a session: 'export' and ids ending in '/export' are the"
                    " session export routes. Use another id.",
                    param=where,
                )
            return value
    return None


async def start_turn(
    state: ServerState,
    session_id: str | None,
    trajectory: Trajectory,
    parser: Any,
    params: SamplingParams,
    adapter: str,
    template: Any = None,
    names: Mapping[str, str] | None = None,
    constraint: dict[str, Any] | None = None,
    continues: Episode | None = None,
) -> TurnCall:
    """Find or start the episode and submit its next turn (``n > 1`` forks it).

    A session's calls run one at a time: its lock is taken here and released
    by the call's recorder once the turn is in the session. ``template``: the
    sampler's template with the call's ``chat_template_kwargs``; an episode
    rendered with other options is not continued (the call starts a new one).
    ``constraint``: what constrains the turn, recorded on it. ``continues``: the
    episode the call extends (a stored response's), instead of the one the session matches.
    """
    session = state.sessions.get_or_create(session_id) if session_id else None
    if session is not None:
        await session.lock.acquire()
    try:
        if continues is not None:
            found: tuple[Episode, list[Message]] | None = (continues, trajectory.messages)
        else:
            found = session.match(trajectory.messages) if session is not None else None
        options = template.options if template is not None else {}
        if (
            found is not None
            and continues is None
            and (found[0].template.options != options or _tool_specs(found[0].tools) != _tool_specs(trajectory.tools))
        ):
            found = None  # rendered with other options or other tools: its tokens are not this call's prompt
        base: Episode | None = None
        if found is not None:
            base, new = found
            target = base.fork()  # extend a copy: a failed call leaves the session as it was
            target.tool_parser = parser
            target.add_messages(new)
        else:
            target = Episode(
                template if template is not None else state.sampler,
                trajectory,
                tool_parser=parser,
                on_template_mismatch=state.on_template_mismatch,
                max_prompt_tokens=state.sampler.max_model_len - 1,  # one token left to generate
            )
        target.constraint = constraint
        return TurnCall(state.sampler, session, base, target, params, adapter)
    except BaseException as exc:
        if session is not None:
            session.lock.release()
        if isinstance(exc, TwinkleError):
            raise state.refusal(exc, names) from None
        raise


def _tool_specs(tools: list[Any]) -> list[dict[str, Any]]:
    return [t.to_hf() for t in tools]


def turn_extras(turn: Turn) -> dict[str, Any]:
    """What twinkle adds to each choice of a reply: the sampled tokens, their log-probs and provenance."""
    return {
        "token_ids": turn.tokens,
        "sampled_logprobs": turn.logprobs,
        "weights_version": turn.weights_version,
        "adapter_name": turn.adapter_name,
        "tool_call_errors": turn.tool_call_errors,
        **routes_field(turn.routed_experts),
    }


def text_pieces(decode: Any, turn: Turn) -> list[str]:
    """A turn's text as a stream sends it: one piece per token (its calls' content whole, if any)."""
    if turn.tool_calls:
        return [str(turn.message.content)] if turn.message.content else []
    # One piece per token: the decoded text grows by each token's share (cut at a stop string).
    pieces: list[str] = []
    shown = 0
    for i in range(1, len(turn.tokens) + 1):
        text = decode(turn.tokens[:i])[: len(turn.text)]
        if len(text) > shown and turn.text.startswith(text):
            pieces.append(text[shown:])
            shown = len(text)
    if shown < len(turn.text):
        pieces.append(turn.text[shown:])
    return pieces
