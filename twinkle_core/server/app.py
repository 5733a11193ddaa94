"""The FastAPI application of ``twinkle serve``: OpenAI routes over episodes.

The server is a thin layer: a chat call becomes an :class:`~twinkle_core.episode.Episode`
(new, or the session's episode it continues), one turn is submitted to the
engine with ``Sampler.submit()`` (concurrent calls are batched by engines
that batch), and the reply is built from the turn. Each choice carries,
besides the OpenAI fields, the sampled ``token_ids``, their
``sampled_logprobs``, the ``weights_version`` and ``adapter_name`` that
produced them, and ``tool_call_errors``.

Every call is a :class:`_Call`: the engine's handle plus a task that, once
the handle is done, extends the episode and records it in the session (and
only then lets the session's next call in). A client that goes away, while
it waits for a whole reply or mid-stream, aborts the handle: the engine
stops generating, and the turn is still recorded, with what was sampled up
to then and ``stop_reason="abort"``. Streaming sends each choice as soon as
the engine finishes it (``async for`` over the handle), as one chunk per
token of its text. A sampler without ``submit()`` (the Ray front end today)
runs ``sample()`` in a worker thread instead; its calls cannot be aborted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import reprlib
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from twinkle_core.data_format import InputFeature, Message, SampleResponse, SamplingParams, Trajectory
from twinkle_core.episode import Episode, OnTemplateMismatch, Turn, _extend, _prepare
from twinkle_core.errors import (
    EngineDeadError,
    SamplerClosedError,
    TwinkleError,
    UnknownAdapterError,
    UnsupportedFeatureError,
)
from twinkle_core.requests import Finished, SampleHandle
from twinkle_core.server.sessions import Session, SessionStore
from twinkle_core.tools import get_tool_parser

__all__ = ["create_app"]

log = logging.getLogger("twinkle.server")

#: The header that names a session (the body's ``user`` field is the fallback).
SESSION_HEADER = "X-Session-Id"


class _Request(BaseModel):
    # Unknown fields are refused: an option the server would silently ignore is a bug.
    model_config = ConfigDict(extra="forbid")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    # twinkle extensions (as vLLM's server has them), passed with the openai client's extra_body
    ignore_eos: bool = False
    top_k: int | None = None


class ChatRequest(_Request):
    """The ``/v1/chat/completions`` body (the OpenAI fields twinkle honours)."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(_Request):
    """The ``/v1/completions`` body."""

    prompt: str | list[str] | list[int]
    logprobs: int | None = None
    echo: bool = False


class ApiError(Exception):
    """An OpenAI-style error answer."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        """The error as OpenAI's ``{"error": {...}}`` body."""
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


#: Short, bounded reprs of what a client sent, for error messages (a deeply nested value cannot blow the stack).
_BRIEF = reprlib.Repr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother = 3, 60, 60


def _brief(value: Any) -> str:
    return _BRIEF.repr(value)[:60]


def _twinkle_status(exc: TwinkleError) -> ApiError:
    if isinstance(exc, (SamplerClosedError, EngineDeadError)):
        return ApiError(503, str(exc), kind="server_error", code="engine_unavailable")
    if isinstance(exc, LookupError):
        return ApiError(404, str(exc), code="not_found")
    return ApiError(400, str(exc))


def _openai_messages(raw: list[dict[str, Any]]) -> list[Message]:
    """OpenAI message dicts to :class:`Message` (``arguments`` JSON strings become dicts)."""
    out = []
    for i, m in enumerate(raw):
        m = dict(m)
        if m.get("role") == "tool":
            m.pop("name", None)  # OpenAI's legacy function name on tool results; templates key on tool_call_id
        if m.get("content") is None:
            m["content"] = ""
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for c in calls:
                c = json.loads(json.dumps(c))
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
                        raise ApiError(
                            400,
                            f"messages[{i}].tool_calls: arguments {fn['arguments']!r:.80} are not JSON.",
                            param=f"messages[{i}]",
                        ) from None
                fixed.append(c)
            m["tool_calls"] = fixed
        try:
            out.append(Message.from_dict(m))
        except TwinkleError as exc:
            raise ApiError(400, f"messages[{i}]: {exc}", param=f"messages[{i}]") from None
    return out


def _openai_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["function"]["name"], "arguments": json.dumps(c["function"]["arguments"])},
        }
        for c in calls
    ]


class _Server:
    """The state behind the routes: the sampler, the sessions and the options."""

    def __init__(
        self,
        sampler: Any,
        *,
        model_name: str,
        tool_parser: Any,
        on_template_mismatch: OnTemplateMismatch,
        default_max_tokens: int,
        sessions: SessionStore,
    ) -> None:
        self.sampler = sampler
        self.model_name = model_name
        self.tool_parser = get_tool_parser(tool_parser)
        self.no_parser = get_tool_parser("none")
        self.on_template_mismatch = on_template_mismatch
        self.default_max_tokens = default_max_tokens
        self.sessions = sessions

    # -- request pieces ----------------------------------------------------------------------------
    def adapter(self, model: str) -> str:
        if model in ("base", self.model_name, ""):
            return ""
        if model in self.sampler.adapters:
            return model
        names = ", ".join(["base", self.model_name, *self.sampler.adapters])
        raise ApiError(
            404, f"The model {model!r} does not exist: this server has {names}.", param="model", code="model_not_found"
        )

    def params(self, req: _Request, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(req, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name}={getattr(req, name)!r} is not supported: leave it unset or 0.", param=name)
        fields: dict[str, Any] = {"num_samples": req.n, "max_tokens": max_tokens or self.default_max_tokens}
        if req.ignore_eos:
            fields["ignore_eos"] = True
        for name in ("temperature", "top_p", "seed", "top_k"):
            if getattr(req, name) is not None:
                fields[name] = getattr(req, name)
        if req.stop is not None:
            fields["stop"] = req.stop
        fields["logprobs"] = logprobs if logprobs is not None else 0
        if req.stream_options is not None and set(req.stream_options) - {"include_usage"}:
            raise ApiError(
                400,
                f"stream_options={req.stream_options!r}: only 'include_usage' is supported.",
                param="stream_options",
            )
        try:
            return SamplingParams(**fields)
        except TwinkleError as exc:
            raise ApiError(400, str(exc)) from None

    def token_text(self, token: int) -> str:
        return str(self.sampler.template.decode([token], skip_special_tokens=False))

    def logprobs_content(self, tokens: list[int], logprobs: list[float] | None, top: Any) -> list[dict[str, Any]]:
        out = []
        for i, t in enumerate(tokens):
            s = self.token_text(t)
            alts = top[i] if top is not None and i < len(top) else []
            out.append(
                {
                    "token": s,
                    "logprob": logprobs[i] if logprobs else 0.0,
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": self.token_text(a), "logprob": lp, "bytes": list(self.token_text(a).encode())}
                        for a, lp in alts
                    ],
                }
            )
        return out


class _KeyCheck:
    """Pure ASGI middleware checking the API key (no ``BaseHTTPMiddleware``: it would wrap
    ``receive`` and hide a client's disconnect from the streaming routes)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if auth != self.expected:
                response = ApiError(
                    401, "Missing or wrong API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
                ).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _client_gone(request: Request) -> None:
    """Return when the client disconnects (the body has been read, so only a disconnect comes next)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Pending:
    """One engine call: a ``submit()`` handle, or ``sample()`` in a worker thread where there is none."""

    def __init__(self, sampler: Any, prompts: list[InputFeature], params: SamplingParams, adapter: str) -> None:
        submit = getattr(sampler, "submit", None)
        self.handle: SampleHandle | None = None
        self._thread: asyncio.Future[list[SampleResponse]] | None = None
        if submit is not None:
            self.handle = submit(prompts, params, adapter)
        else:
            self._thread = asyncio.ensure_future(asyncio.to_thread(sampler.sample, prompts, params, adapter))

    async def responses(self) -> list[SampleResponse]:
        """What ``sample()`` returns; awaiting it from a cancelled task never cancels the engine call."""
        if self.handle is not None:
            return list(await asyncio.shield(self.handle))
        assert self._thread is not None
        return list(await asyncio.shield(self._thread))

    async def finished(self) -> AsyncIterator[Finished]:
        """Each sequence as the engine finishes it (all at the end without a handle)."""
        if self.handle is not None:
            async for item in self.handle:
                yield item
            return
        for p, response in enumerate(await self.responses()):
            for k, seq in enumerate(response.sequences):
                yield Finished(input_index=p, sample_index=k, sequence=seq)

    def abort(self) -> bool:
        """Stop the engine call (its unfinished sequences end with ``stop_reason="abort"``); whether it ran."""
        if self.handle is None or self.handle.done():
            return False
        self.handle.abort()
        return True

    async def until_done_or_gone(self, request: Request) -> list[SampleResponse]:
        """The responses; aborts the call first if the client disconnects while it runs."""
        result = asyncio.ensure_future(self.responses())
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done() and self.abort():
                log.info("client left before its reply; the engine call was aborted")
            return await result
        finally:
            gone.cancel()


class _Call:
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
        prompts, params = _prepare(sampler, [target], params, None)
        self.pending = _Pending(sampler, prompts, params, adapter)
        self.session, self.base, self.target, self.n = session, base, target, params.num_samples
        self.episodes: asyncio.Future[list[Episode]] = asyncio.get_running_loop().create_future()
        # Retrieved here so that a stream whose client left never logs "exception never retrieved".
        self.episodes.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._recorder = asyncio.ensure_future(self._record())

    async def _record(self) -> None:
        try:
            responses = await self.pending.responses()
            [episodes] = _extend([self.target], responses)
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


def _finish(turn_or_seq: Any, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    return "length" if turn_or_seq.stop_reason == "length" else "stop"


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(
    sampler: Any,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    tool_parser: Any = "hermes",
    on_template_mismatch: OnTemplateMismatch = "raise",
    default_max_tokens: int = 256,
    sessions: SessionStore | None = None,
    max_workers: int = 64,
) -> FastAPI:
    """The OpenAI-compatible application over ``sampler`` (see :func:`twinkle_core.server.serve`)."""
    state = _Server(
        sampler,
        model_name=model_name or "twinkle",
        tool_parser=tool_parser,
        on_template_mismatch=on_template_mismatch,
        default_max_tokens=default_max_tokens,
        sessions=sessions if sessions is not None else SessionStore(),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A sampler without submit() holds a worker thread inside sample() per call in flight; the default
        # pool (a handful of threads on a small machine) would cap how many calls an engine can batch.
        pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="twinkle-serve")
        asyncio.get_running_loop().set_default_executor(pool)
        yield
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="twinkle rollout server", lifespan=lifespan)
    app.state.twinkle = state

    if api_key is not None:
        app.add_middleware(_KeyCheck, api_key=api_key)

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" + (f" (got {_brief(e['input'])})" if "input" in e else ""))
        first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
        param = ".".join(str(x) for x in first if x != "body") or None
        return ApiError(400, "Invalid request: " + "; ".join(parts), param=param).response()

    @app.exception_handler(TwinkleError)
    async def on_twinkle(request: Request, exc: TwinkleError) -> JSONResponse:
        return _twinkle_status(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(
            exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None
        ).response()

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s", request.url.path)  # the traceback goes to the log, not the client
        return ApiError(
            500, f"Internal error ({type(exc).__name__}); the server is still up.", kind="server_error"
        ).response()

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "weights_version": sampler.weights_version}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names = [state.model_name, "base", *sampler.adapters]
        return {
            "object": "list",
            "data": [{"id": n, "object": "model", "created": 0, "owned_by": "twinkle"} for n in names],
        }

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
        adapter = state.adapter(req.model)
        if req.tool_choice not in (None, "auto", "none"):
            raise ApiError(
                400,
                f"tool_choice={req.tool_choice!r} is not supported: use 'auto' or 'none'"
                " (twinkle does not constrain decoding to force a call).",
                param="tool_choice",
            )
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true.", param="top_logprobs")
        params = state.params(req, req.max_completion_tokens or req.max_tokens, req.top_logprobs or 0)
        messages = _openai_messages(req.messages)
        try:
            trajectory = Trajectory(messages=messages, tools=req.tools or [])
        except TwinkleError as exc:
            raise ApiError(400, str(exc), param="tools") from None
        parser = state.no_parser if req.tool_choice == "none" else state.tool_parser
        session_id = request.headers.get(SESSION_HEADER) or req.user
        call = await _start(state, session_id, trajectory, parser, params, adapter)
        rid = "chatcmpl-" + uuid.uuid4().hex
        prompt_len = len(call.target.tokens)
        if req.stream:
            return StreamingResponse(
                _stream_chat(state, rid, req, call, prompt_len, session_id), media_type="text/event-stream"
            )
        await call.pending.until_done_or_gone(request)
        episodes = await call.episodes
        turns = [t for t in (e.last_turn for e in episodes) if t is not None]
        choices = [_chat_choice(state, i, t, bool(req.logprobs)) for i, t in enumerate(turns)]
        completion = sum(len(t.tokens) for t in turns)
        body: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_len,
                "completion_tokens": completion,
                "total_tokens": prompt_len + completion,
            },
            "session_id": session_id,
        }
        return body

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        adapter = state.adapter(req.model)
        if req.stream or req.echo:
            raise ApiError(
                400,
                "stream and echo are not supported on /v1/completions; use /v1/chat/completions for streaming.",
                param="stream" if req.stream else "echo",
            )
        params = state.params(req, req.max_tokens or 16, req.logprobs)
        prompts = (
            req.prompt
            if isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str)
            else [req.prompt]
        )
        features = []
        for p in prompts:
            ids = p if isinstance(p, list) else sampler.template.tokenizer.encode(p, add_special_tokens=False)
            features.append(InputFeature(input_ids=list(ids)))
        try:
            pending = _Pending(sampler, features, params, adapter)
        except UnsupportedFeatureError as exc:
            raise ApiError(400, str(exc)) from None
        responses = await pending.until_done_or_gone(request)
        choices: list[dict[str, Any]] = []
        used = 0
        for resp in responses:
            for seq in resp.sequences:
                used += len(seq.tokens)
                lp = None
                if req.logprobs is not None:
                    lp = {
                        "tokens": [state.token_text(t) for t in seq.tokens],
                        "token_logprobs": seq.logprobs,
                        "top_logprobs": [{state.token_text(a): v for a, v in pos} for pos in seq.top_logprobs]
                        if seq.top_logprobs
                        else None,
                        "text_offset": None,
                    }
                choices.append(
                    {
                        "index": len(choices),
                        "text": seq.text,
                        "finish_reason": _finish(seq, False),
                        "logprobs": lp,
                        "token_ids": seq.tokens,
                        "sampled_logprobs": seq.logprobs,
                        "weights_version": seq.weights_version,
                        "adapter_name": seq.adapter_name,
                    }
                )
        prompt_tokens = sum(len(f.input_ids) for f in features)
        return {
            "id": "cmpl-" + uuid.uuid4().hex,
            "object": "text_completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": used, "total_tokens": prompt_tokens + used},
        }

    @app.get("/v1/sessions")
    async def list_sessions() -> dict[str, Any]:
        return {"object": "list", "data": [s.summary() for s in state.sessions.list()]}

    @app.get("/v1/sessions/export")
    async def export_all() -> PlainTextResponse:
        lines = [json.dumps(r) for s in state.sessions.list() for r in s.export()]
        return PlainTextResponse("".join(line + "\n" for line in lines), media_type="application/x-ndjson")

    def _session(session_id: str) -> Session:
        session = state.sessions.get(session_id)
        if session is None:
            raise ApiError(404, f"No session {session_id!r}.", param="session_id", code="not_found")
        return session

    @app.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str) -> dict[str, Any]:
        session = _session(session_id)
        return {**session.summary(), "data": session.export()}

    @app.get("/v1/sessions/{session_id}/export")
    async def export_session(session_id: str) -> PlainTextResponse:
        lines = [json.dumps(r) for r in _session(session_id).export()]
        return PlainTextResponse("".join(line + "\n" for line in lines), media_type="application/x-ndjson")

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict[str, Any]:
        _session(session_id)
        state.sessions.delete(session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    return app


async def _start(
    state: _Server,
    session_id: str | None,
    trajectory: Trajectory,
    parser: Any,
    params: SamplingParams,
    adapter: str,
) -> _Call:
    """Find or start the episode and submit its next turn (``n > 1`` forks it).

    A session's calls run one at a time: its lock is taken here and released
    by the call's recorder once the turn is in the session.
    """
    session = state.sessions.get_or_create(session_id) if session_id else None
    if session is not None:
        await session.lock.acquire()
    try:
        found = session.match(trajectory.messages) if session is not None else None
        base: Episode | None = None
        if found is not None:
            base, new = found
            target = base.fork()  # extend a copy: a failed call leaves the session as it was
            target.tool_parser = parser
            target.add_messages(new)
        else:
            target = Episode(
                state.sampler, trajectory, tool_parser=parser, on_template_mismatch=state.on_template_mismatch
            )
        return _Call(state.sampler, session, base, target, params, adapter)
    except BaseException as exc:
        if session is not None:
            session.lock.release()
        if isinstance(exc, UnsupportedFeatureError):
            raise ApiError(400, str(exc)) from None
        if isinstance(exc, UnknownAdapterError):
            raise ApiError(404, str(exc), param="model", code="model_not_found") from None
        raise


def _message(turn: Turn) -> dict[str, Any]:
    calls = turn.tool_calls
    return {
        "role": "assistant",
        "content": (turn.message.content or None) if calls else turn.message.content,
        "tool_calls": _openai_calls(calls) if calls else None,
    }


def _extras(turn: Turn) -> dict[str, Any]:
    return {
        "token_ids": turn.tokens,
        "sampled_logprobs": turn.logprobs,
        "weights_version": turn.weights_version,
        "adapter_name": turn.adapter_name,
        "tool_call_errors": turn.tool_call_errors,
    }


def _chat_choice(state: _Server, index: int, turn: Turn, logprobs: bool) -> dict[str, Any]:
    lp = None
    if logprobs:
        lp = {"content": state.logprobs_content(turn.tokens, turn.logprobs, turn.top_logprobs)}
    return {
        "index": index,
        "message": _message(turn),
        "finish_reason": _finish(turn, bool(turn.tool_calls)),
        "logprobs": lp,
        **_extras(turn),
    }


async def _stream_chat(
    state: _Server,
    rid: str,
    req: ChatRequest,
    call: _Call,
    prompt_len: int,
    session_id: str | None,
) -> AsyncIterator[str]:
    """Send each choice as OpenAI chunks as soon as the engine finishes it.

    Starlette cancels this generator when the client disconnects; the
    ``finally`` then aborts the engine call (the recorder still keeps the
    aborted turn in the session).
    """
    created = int(time.time())

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        return _sse(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": req.model,
                "choices": choices,
                **extra,
            }
        )

    decode = state.sampler.template.decode
    completion = 0
    complete = False
    try:
        # The role chunks go out at once: the client sees the stream open before any choice is done.
        for index in range(call.n):
            yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        async for item in call.pending.finished():
            index = item.input_index * call.n + item.sample_index
            turn = call.turn(item)
            completion += len(turn.tokens)
            pieces: list[str] = []
            if turn.tool_calls:
                pieces = [str(turn.message.content)] if turn.message.content else []
            else:
                # One chunk per token: the decoded text grows by each token's share (cut at a stop string).
                shown = 0
                for i in range(1, len(turn.tokens) + 1):
                    text = decode(turn.tokens[:i])[: len(turn.text)]
                    if len(text) > shown and turn.text.startswith(text):
                        pieces.append(text[shown:])
                        shown = len(text)
                if shown < len(turn.text):
                    pieces.append(turn.text[shown:])
            for text in pieces:
                yield chunk([{"index": index, "delta": {"content": text}, "finish_reason": None}])
            if turn.tool_calls:
                calls = [{"index": k, **c} for k, c in enumerate(_openai_calls(turn.tool_calls))]
                yield chunk([{"index": index, "delta": {"tool_calls": calls}, "finish_reason": None}])
            final: dict[str, Any] = {
                "index": index,
                "delta": {},
                "finish_reason": _finish(turn, bool(turn.tool_calls)),
                **_extras(turn),
            }
            if req.logprobs:
                final["logprobs"] = {"content": state.logprobs_content(turn.tokens, turn.logprobs, turn.top_logprobs)}
            yield chunk([final], session_id=session_id)
        if req.stream_options and req.stream_options.get("include_usage"):
            usage = {
                "prompt_tokens": prompt_len,
                "completion_tokens": completion,
                "total_tokens": prompt_len + completion,
            }
            yield chunk([], usage=usage)
        yield "data: [DONE]\n\n"
        complete = True
    finally:
        if not complete and call.pending.abort():
            log.info("client left mid-stream; aborted the engine call of %s", rid)
