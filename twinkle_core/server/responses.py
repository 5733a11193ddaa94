"""``/v1/responses``: OpenAI's Responses API, as vLLM serves it, over the same episodes as chat.

A Responses call is a chat turn in another shape. ``instructions`` and the
``input`` items become chat messages (``message`` items by role, ``developer``
as ``system``; a ``function_call`` joins the assistant message before it as a
tool call; a ``function_call_output`` is a ``tool`` message), function
``tools`` become chat tools, and the call runs through the chat route's
parts: the session's episode is found or started, one turn is sampled (under
the ``tool_choice`` constraint or ``text.format``), and the turn becomes the
``output`` items: a ``message`` with its text, then one ``function_call``
per call the parser read.

``previous_response_id`` continues the stored response's episode itself (a
chain is one episode, whatever else its session holds): the new ``input``
items are appended to that episode through the template's delta, so nothing
sampled is re-tokenized. A stored response (``store``, default true) is kept
in a bounded store, oldest evicted first (``max_stored_responses``); a call
without a session joins the session named by its chain's first response id,
so the chain is in the session export. Clients that resend the whole history
instead (the OpenAI Agents SDK's default) are matched to the session's
episodes as chat calls are.

What the engines cannot do is a 400 naming the field: hosted tools
(``web_search``...), reasoning items, images and files in ``input``, and the
fields the table marks neutral (``background``, ``reasoning``...).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from twinkle_core.data_format import Trajectory
from twinkle_core.episode import Episode, Turn
from twinkle_core.errors import ConfigError, TwinkleError
from twinkle_core.server.bodies import ChatRequest, ResponsesRequest
from twinkle_core.server.constraints import constrain
from twinkle_core.server.protocol import (
    RESPONSES_SAMPLING,
    ApiError,
    body_names,
    brief,
    neutral_violation,
    openai_messages,
    openai_tools,
)
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

__all__ = ["ResponseStore", "StoredResponse", "add_response_routes"]

_LOGPROBS = "message.output_text.logprobs"
#: Chat's field names, as a Responses body calls them (in error messages and ``param``).
_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format", "messages": "input"}


@attrs.define
class StoredResponse:
    """A response kept for ``previous_response_id``: its body, session and episode (ending with its turn)."""

    body: dict[str, Any]
    session_id: str
    episode: Episode


class ResponseStore:
    """The stored responses, at most ``limit``, the oldest evicted first."""

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigError(f"max_stored_responses={limit!r} is invalid: expected an integer >= 1.")
        self.limit = limit
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, rid: str, item: StoredResponse) -> None:
        """Keep ``item``, evicting the oldest beyond the limit."""
        self._items[rid] = item
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, rid: str) -> StoredResponse | None:
        """The stored response, or ``None`` (never stored, or evicted)."""
        return self._items.get(rid)


def _renamed(exc: ApiError) -> ApiError:
    """A chat-route error in the Responses body's names."""
    message, param = exc.message, exc.param
    for chat, ours in _NAMES.items():
        message = message.replace(chat, ours)
        if param is not None and (param == chat or param.startswith(chat + "[")):
            param = ours + param[len(chat) :]
    return ApiError(exc.status, message, kind=exc.kind, param=param, code=exc.code)


def _content_text(content: Any, where: str) -> str:
    """A message item's content (a string, or text parts) as text."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content={brief(content)}: expected a string or a list of parts.", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ApiError(
                400,
                f"{where}.content[{j}].type={brief(kind)} is not supported: this server serves text models"
                " (input_text and output_text parts).",
                param=f"{where}.content[{j}].type",
            )
        texts.append(part["text"])
    return "".join(texts)


def input_messages(raw: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``input`` items as OpenAI chat messages (``function_call`` items join the assistant message before them)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    out: list[dict[str, Any]] = []
    open_turn = False  # the last message is an assistant turn that a following function_call joins
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            given = item.get("role")
            role = "system" if given == "developer" else given
            if role not in ("user", "system", "assistant"):
                raise ApiError(
                    400,
                    f"{where}.role={brief(item.get('role'))}: expected user, system, developer or assistant.",
                    param=f"{where}.role",
                )
            out.append({"role": role, "content": _content_text(item.get("content"), where)})
            open_turn = role == "assistant"
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise ApiError(400, f"{where}: a function_call needs call_id, name and arguments.", param=where)
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"]}}
            call["function"]["arguments"] = item["arguments"]
            if not open_turn:
                out.append({"role": "assistant", "content": ""})
                open_turn = True
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise ApiError(400, f"{where}: a function_call_output needs its call_id.", param=where)
            text = output if isinstance(output, str) else _content_text(output, where)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
            open_turn = False
        elif kind == "reasoning":
            raise ApiError(
                400,
                f"{where} is a reasoning item: this server has no reasoning parser, so its models produce none and"
                " none can go back into the prompt. Leave reasoning items out.",
                param=f"{where}.type",
            )
        else:
            raise ApiError(
                400,
                f"{where}.type={brief(kind)} is not supported: expected message, function_call or"
                " function_call_output (hosted tools' items are not served here).",
                param=f"{where}.type",
            )
    return out


def chat_tools(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (``{"type": "function", "name", "parameters", ...}``) in the chat shape."""
    if raw is None:
        return None
    out = []
    for i, tool in enumerate(raw):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise ApiError(
                400,
                f"tools[{i}].type={brief(tool.get('type'))} is not supported: this server runs function tools only"
                " ({'type': 'function', 'name': ..., 'parameters': ...}); hosted tools (web search, file search,"
                " code interpreter...) have no engine here.",
                param=f"tools[{i}].type",
            )
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


def _chat_request(req: ResponsesRequest) -> ChatRequest:
    """The chat body whose sampling fields are this call's (for the chat route's checks)."""
    fields: dict[str, Any] = {name: getattr(req, name) for name in RESPONSES_SAMPLING if name in req.model_fields_set}
    if req.max_output_tokens is not None:
        fields["max_completion_tokens"] = req.max_output_tokens
    if req.top_logprobs:
        fields.update(logprobs=True, top_logprobs=req.top_logprobs)
    text = dict(req.text or {})
    fmt = text.pop("format", None)
    if text.pop("verbosity", None) not in (None, "medium") or text:
        raise ApiError(400, f"text={brief(req.text)}: only format is supported (verbosity 'medium').", param="text")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
    elif fmt is not None:
        fields["response_format"] = fmt
    try:
        return ChatRequest(messages=[{"role": "user", "content": ""}], stream=req.stream, **fields)
    except ValueError as exc:
        raise ApiError(400, f"Invalid request: {exc}") from None


def add_response_routes(app: FastAPI, state: ServerState, max_stored_responses: int) -> None:
    """Serve ``POST /v1/responses`` and ``GET /v1/responses/{response_id}`` over ``state``'s sessions."""
    store = ResponseStore(max_stored_responses)

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Any:
        bad = neutral_violation("responses", req.model_dump(exclude_unset=True))
        if bad is not None:
            raise ApiError(400, bad, param=bad.split("=", 1)[0])
        if set(req.include or ()) - {_LOGPROBS}:
            raise ApiError(400, f"include={brief(req.include)}: only {_LOGPROBS!r} is served here.", param="include")
        adapter = state.adapter(req.model or "")
        chat = _chat_request(req)
        try:
            params = state.params(chat, "chat", max_tokens=chat.max_completion_tokens, logprobs=req.top_logprobs or 0)
            tools = chat_tools(req.tools)
            rendered = openai_tools(tools)
            fields = {_k: _NAMES.get(v, v) for _k, v in body_names("chat", chat).items()}
            params, constraint = constrain(
                params, state.tool_parser, tools, req.tool_choice, req.parallel_tool_calls, fields,
                format_field="text.format",
            )  # fmt: skip
        except ApiError as exc:
            raise _renamed(exc) from None
        items = len(req.input) if isinstance(req.input, list) else 1  # each item renders to a token at least
        state.check_parts(items + len(req.tools or []) + bool(req.instructions), fields)
        new = input_messages(req.input)
        session_id = request_session_id(request, req)
        previous = _previous(store, req.previous_response_id, session_id)
        if previous is not None:
            session_id = previous.session_id
            if req.instructions:
                raise ApiError(
                    400,
                    "instructions with previous_response_id: the chain's episode already holds its opening"
                    " messages, which cannot change. Leave instructions out.",
                    param="instructions",
                )
        elif req.instructions:
            new = [{"role": "system", "content": req.instructions}, *new]
        rid = req.request_id or "resp_" + uuid.uuid4().hex
        if session_id is None and req.store:
            session_id = rid  # the chain's session: a stored response can be continued, and is exported
        try:
            messages = openai_messages(new)
            trajectory = Trajectory(messages=messages, tools=rendered)
        except ApiError as exc:
            raise _renamed(exc) from None
        except TwinkleError as exc:
            raise ApiError(400, str(exc), param="tools") from None
        if previous is not None and _specs(previous.episode) != [t.to_hf() for t in trajectory.tools]:
            raise ApiError(
                400,
                "tools differ from those of the previous response: the chain's episode rendered its tools into its"
                " prompt. Send the same tools.",
                param="tools",
            )
        parser = state.no_parser if req.tool_choice == "none" else state.tool_parser
        await state.unpaused()
        base = previous.episode if previous is not None else None
        call = await start_turn(state, session_id, trajectory, parser, params, adapter, None, fields, constraint, base)
        names = TokenNames(state.sampler.template, False)
        if req.stream:
            events = _stream(state, store, rid, req, call, session_id, names)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            with state.tracked(rid, call.pending):
                await call.pending.until_done_or_gone(request)
            [episode] = await call.episodes
        except TwinkleError as exc:
            raise state.refusal(exc, fields) from None
        return _finish(state, store, rid, req, episode, session_id, names)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        found = store.get(response_id)
        if found is None:
            raise ApiError(
                404,
                f"No stored response {response_id!r}: never stored (store=false), or evicted (this server keeps the"
                f" last {store.limit}).",
                param="response_id",
                code="not_found",
            )
        return found.body


def _specs(episode: Episode) -> list[dict[str, Any]]:
    return [t.to_hf() for t in episode.tools]


def _previous(store: ResponseStore, rid: str | None, session_id: str | None) -> StoredResponse | None:
    if rid is None:
        return None
    found = store.get(rid)
    if found is None:
        raise ApiError(
            400,
            f"previous_response_id={rid!r:.80} is not a stored response: unknown, stored with store=false, or"
            f" evicted (this server keeps the last {store.limit} responses; a chain continues from a kept one).",
            param="previous_response_id",
        )
    if session_id is not None and session_id != found.session_id:
        raise ApiError(
            400,
            f"previous_response_id={rid!r:.80} belongs to another session than {session_id!r:.80}: a chain is one"
            " episode of one session. Continue it without naming another session.",
            param="previous_response_id",
        )
    return found


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _output(turn: Turn, names: TokenNames, logprobs: bool) -> list[dict[str, Any]]:
    """The turn as output items: its text as a ``message`` (if any, or if there are no calls), then its calls."""
    calls = turn.tool_calls
    text = (turn.message.content or "") if calls else turn.text
    items: list[dict[str, Any]] = []
    if text or not calls:
        lp = names.chat_content(turn.tokens, turn.logprobs, turn.top_logprobs) if logprobs else []
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lp}
        items.append(
            {
                "type": "message",
                "id": "msg_" + uuid.uuid4().hex,
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for call in openai_tool_calls(calls):
        fn = call["function"]
        items.append(
            {
                "type": "function_call",
                "id": "fc_" + uuid.uuid4().hex,
                "call_id": call["id"],
                "name": fn["name"],
                "arguments": fn["arguments"],
                "status": "completed",
            }
        )
    return items


def _body(
    state: ServerState, rid: str, req: ResponsesRequest, status: str, output: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": req.model or state.model_name,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": None,
        "store": req.store,
        "temperature": req.temperature,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "top_p": req.top_p,
        "truncation": "disabled",
        "user": req.user,
        "metadata": req.metadata or {},
        "background": False,
        **extra,
    }


def _finish(
    state: ServerState,
    store: ResponseStore,
    rid: str,
    req: ResponsesRequest,
    episode: Episode,
    session_id: str | None,
    names: TokenNames,
) -> dict[str, Any]:
    """The whole response for the call's recorded turn (stored if asked)."""
    turn = episode.last_turn
    assert turn is not None
    prompt = turn.start  # the episode's tokens before the turn: its prompt
    state.count(prompt, len(turn.tokens))
    status = {"length": "incomplete", "abort": "cancelled"}.get(turn.stop_reason, "completed")
    body = _body(
        state, rid, req, status, _output(turn, names, _LOGPROBS in (req.include or ())),
        usage=_usage(prompt, len(turn.tokens)), session_id=session_id, **turn_extras(turn),
    )  # fmt: skip
    if status == "incomplete":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    if req.store and session_id is not None:
        store.put(rid, StoredResponse(body=body, session_id=session_id, episode=episode))
    return body


async def _stream(
    state: ServerState,
    store: ResponseStore,
    rid: str,
    req: ResponsesRequest,
    call: TurnCall,
    session_id: str | None,
    names: TokenNames,
) -> AsyncIterator[str]:
    """The Responses events: created, then each output item (added, its text or arguments, done), then completed."""
    seq = 0

    def event(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return sse({"type": kind, "sequence_number": seq - 1, **fields})

    complete = False
    try:
        opening = _body(state, rid, req, "in_progress", [], usage=None)
        yield event("response.created", response=opening)
        yield event("response.in_progress", response=opening)
        try:
            with state.tracked(rid, call.pending):
                [episode] = await call.episodes
        except Exception as exc:  # refused once it ran: the error as the stream's last event
            error = state.refusal(exc)
            message = error.message if isinstance(error, ApiError) else f"Internal error ({type(exc).__name__})"
            yield event(
                "error", code=getattr(error, "code", None), message=message, param=getattr(error, "param", None)
            )
            complete = True
            return
        body = _finish(state, store, rid, req, episode, session_id, names)
        turn = episode.last_turn
        assert turn is not None
        for index, item in enumerate(body["output"]):
            yield event("response.output_item.added", output_index=index, item={**item, "status": "in_progress"})
            if item["type"] == "message":
                [part] = item["content"]
                where = {"item_id": item["id"], "output_index": index, "content_index": 0}
                yield event("response.content_part.added", **where, part={**part, "text": "", "logprobs": []})
                for piece in text_pieces(state.sampler.template.decode, turn):
                    yield event("response.output_text.delta", **where, delta=piece, logprobs=[])
                yield event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])
                yield event("response.content_part.done", **where, part=part)
            else:
                where = {"item_id": item["id"], "output_index": index}
                yield event("response.function_call_arguments.delta", **where, delta=item["arguments"])
                yield event(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
                )
            yield event("response.output_item.done", output_index=index, item=item)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(body["status"])
        yield event(kind or "response.failed", response=body)
        complete = True
    finally:
        if not complete:
            call.pending.abort()
