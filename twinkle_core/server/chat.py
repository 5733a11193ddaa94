"""``/v1/chat/completions``: a chat call is one turn of an episode, sent whole or streamed.

The call's messages find the session's episode they continue (or start a new
one), one turn is submitted (:func:`~twinkle_core.server.turns.start_turn`),
and each choice is built from the recorded turn. Streaming sends each choice
as soon as the engine finishes it, as one chunk per token of its text; a
client that leaves mid-stream aborts the engine call (the turn is still
recorded, with ``stop_reason="abort"``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from twinkle_core.data_format import Trajectory
from twinkle_core.episode import Turn
from twinkle_core.errors import TwinkleError
from twinkle_core.server.bodies import ChatRequest
from twinkle_core.server.constraints import constrain
from twinkle_core.server.media import check_message_media
from twinkle_core.server.protocol import ApiError, body_names, openai_messages, openai_tools
from twinkle_core.server.shapes import TokenNames
from twinkle_core.server.state import ServerState
from twinkle_core.server.turns import (
    TurnCall,
    openai_tool_calls,
    request_session_id,
    sse,
    start_turn,
    text_pieces,
    turn_extras,
)

__all__ = ["add_chat_routes", "chat"]

log = logging.getLogger("twinkle.server")


def add_chat_routes(app: FastAPI, state: ServerState) -> None:
    """Add ``/v1/chat/completions`` to ``app``."""

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        return await chat(state, req, request)


async def chat(state: ServerState, req: ChatRequest, request: Request) -> Any:
    """``/v1/chat/completions``: one turn of the session's episode (new, or the one the messages continue)."""
    adapter = state.adapter(req.model or "")
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
    params = state.params(
        req,
        "chat",
        max_tokens=req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        logprobs=req.top_logprobs or 0,
        prompt_logprobs=req.prompt_logprobs,
    )
    state.check_parts(len(req.messages) + len(req.tools or []), body_names("chat", req))
    messages = openai_messages(req.messages)
    check_message_media(messages, state.media_access)
    try:
        trajectory = Trajectory(messages=messages, tools=openai_tools(req.tools))
    except TwinkleError as exc:
        raise ApiError(400, str(exc), param="tools") from None
    parser = state.no_parser if req.tool_choice == "none" else state.tool_parser
    fields = body_names("chat", req)
    params, constraint = constrain(
        params, state.tool_parser, req.tools, req.tool_choice, req.parallel_tool_calls, fields
    )
    session_id = request_session_id(request, req)
    template = state.template_with(req.chat_template_kwargs)
    await state.unpaused()
    call = await start_turn(state, session_id, trajectory, parser, params, adapter, template, fields, constraint)
    rid = req.request_id or ("chatcmpl-" + uuid.uuid4().hex)
    prompt_ids = list(call.target.tokens)
    names = TokenNames(state.sampler.template, bool(req.return_tokens_as_token_ids))
    if req.stream:
        return StreamingResponse(
            _stream_chat(state, rid, req, call, prompt_ids, session_id, names), media_type="text/event-stream"
        )
    try:
        with state.tracked(rid, call.pending):
            responses = await call.pending.until_done_or_gone(request)
        episodes = await call.episodes
    except TwinkleError as exc:  # refused once it ran (a grammar that does not compile...)
        raise state.refusal(exc, fields) from None
    turns = [t for t in (e.last_turn for e in episodes) if t is not None]
    choices = [_chat_choice(i, t, names if req.logprobs else None) for i, t in enumerate(turns)]
    completion = sum(len(t.tokens) for t in turns)
    state.count(len(prompt_ids), completion)
    body: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model or state.model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion,
        },
        "session_id": session_id,
    }
    if req.return_token_ids:
        body["prompt_token_ids"] = prompt_ids
    if req.prompt_logprobs is not None:
        first = responses[0] if responses else None
        body["prompt_logprobs"] = names.prompt_logprobs(
            prompt_ids,
            first.prompt_logprobs if first is not None else None,
            first.prompt_top_logprobs if first is not None else None,
        )
    return body


def _finish(turn_or_seq: Any, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    reason = turn_or_seq.stop_reason
    return reason if reason in ("length", "abort") else "stop"


def _message(turn: Turn) -> dict[str, Any]:
    calls = turn.tool_calls
    return {
        "role": "assistant",
        # without calls, the text as sampled (the stream sends the same; the parser may have trimmed it)
        "content": (turn.message.content or None) if calls else turn.text,
        "tool_calls": openai_tool_calls(calls) if calls else None,
    }


def _chat_choice(index: int, turn: Turn, names: TokenNames | None) -> dict[str, Any]:
    """One choice of a whole reply (``names``: the log-prob block is wanted, with these token names)."""
    lp = None
    if names is not None:
        lp = {"content": names.chat_content(turn.tokens, turn.logprobs, turn.top_logprobs)}
    return {
        "index": index,
        "message": _message(turn),
        "finish_reason": _finish(turn, bool(turn.tool_calls)),
        "logprobs": lp,
        **turn_extras(turn),
    }


async def _stream_chat(
    state: ServerState,
    rid: str,
    req: ChatRequest,
    call: TurnCall,
    prompt_ids: list[int],
    session_id: str | None,
    names: TokenNames,
) -> AsyncIterator[str]:
    """Send each choice as OpenAI chunks as soon as the engine finishes it.

    Starlette cancels this generator when the client disconnects; the
    ``finally`` then aborts the engine call (the recorder still keeps the
    aborted turn in the session).
    """
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": req.model or state.model_name,
                "choices": choices,
                **extra,
            }
        )

    decode = state.sampler.template.decode
    completion = 0
    complete = False
    try:
        # The role chunks go out at once: the client sees the stream open before any choice is done.
        first: dict[str, Any] = {"prompt_token_ids": prompt_ids} if req.return_token_ids else {}
        for index in range(call.n):
            yield chunk(
                [{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                **(first if index == 0 else {}),
            )
        try:
            with state.tracked(rid, call.pending):
                async for item in call.pending.finished():
                    index = item.input_index * call.n + item.sample_index
                    turn = call.turn(item)
                    completion += len(turn.tokens)
                    for text in text_pieces(decode, turn):
                        yield chunk([{"index": index, "delta": {"content": text}, "finish_reason": None}])
                    if turn.tool_calls:
                        calls = [{"index": k, **c} for k, c in enumerate(openai_tool_calls(turn.tool_calls))]
                        yield chunk([{"index": index, "delta": {"tool_calls": calls}, "finish_reason": None}])
                    final: dict[str, Any] = {
                        "index": index,
                        "delta": {},
                        "finish_reason": _finish(turn, bool(turn.tool_calls)),
                        **turn_extras(turn),
                    }
                    if req.logprobs:
                        final["logprobs"] = {
                            "content": names.chat_content(turn.tokens, turn.logprobs, turn.top_logprobs)
                        }
                    yield chunk([final], session_id=session_id)
        except Exception as exc:  # the engine refused the call once it ran: say so in the stream
            yield state.stream_error(exc, body_names("chat", req))
            complete = True
            return
        if req.stream_options and req.stream_options.get("include_usage"):
            usage = {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion,
                "total_tokens": len(prompt_ids) + completion,
            }
            yield chunk([], usage=usage)
        state.count(len(prompt_ids), completion)
        yield "data: [DONE]\n\n"
        complete = True
    finally:
        if not complete and call.pending.abort():
            log.info("client left mid-stream; aborted the engine call of %s", rid)
