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
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from twinkle_core.data_format import SamplingParams, Trajectory
from twinkle_core.episode import OnTemplateMismatch, Turn
from twinkle_core.errors import (
    ConfigError,
    EngineDeadError,
    IncompleteUpdateError,
    InvalidInputError,
    NumericalError,
    PromptTooLongError,
    SamplerClosedError,
    TwinkleError,
    UnknownAdapterError,
)
from twinkle_core.server.calls import Pending
from twinkle_core.server.completions import complete
from twinkle_core.server.constraints import constrain
from twinkle_core.server.control import add_control_routes
from twinkle_core.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PENDING_REQUESTS, Limits, LimitsMiddleware
from twinkle_core.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Route,
    body_names,
    brief,
    in_body_terms,
    input_index,
    input_name,
    neutral_violation,
    openai_messages,
    openai_tools,
)
from twinkle_core.server.sessions import Session, SessionStore
from twinkle_core.server.shapes import TokenNames
from twinkle_core.server.turns import (
    _Call,
    _extras,
    _openai_calls,
    _session_id,
    _sse,
    _start,
    _text_pieces,
)
from twinkle_core.server.weights import add_weight_routes
from twinkle_core.server.weights import check_config as check_weight_config
from twinkle_core.tools import get_tool_parser

__all__ = ["create_app"]

log = logging.getLogger("twinkle.server")


def _twinkle_status(exc: TwinkleError, names: Mapping[str, str] | None = None) -> ApiError:
    """The answer to an error of twinkle's; a sampling field is named as the body names it (``names``)."""
    if isinstance(exc, (SamplerClosedError, EngineDeadError)):
        return ApiError(503, str(exc), kind="server_error", code="engine_unavailable")
    if isinstance(exc, IncompleteUpdateError):  # until a weight push repairs it
        return ApiError(503, str(exc), kind="server_error", code="weights_incomplete")
    if isinstance(exc, NumericalError):  # the served weights overflow: not the request's fault, nor one to retry
        return ApiError(500, str(exc), kind="server_error", code="numerical_error")
    if isinstance(exc, UnknownAdapterError):
        return ApiError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, LookupError):
        return ApiError(404, str(exc), code="not_found")
    names = body_names(None) if names is None else names
    if isinstance(exc, PromptTooLongError):  # the engine's advice (on_invalid='skip') means nothing here
        where = input_name(exc.index, names)
        what = "messages render to" if where == "messages" else f"{where} has"
        count = f"at least {exc.length}" if exc.at_least else str(exc.length)
        return ApiError(
            400,
            f"The {what} {count} tokens, but this model takes at most {exc.limit} prompt tokens (its"
            f" context, max_model_len, less one token to generate). Shorten {where}.",
            param=where.split("[")[0],
            code="context_length_exceeded",  # OpenAI's code for this refusal
        )
    if isinstance(exc, InvalidInputError) and not getattr(exc, "field", None):
        index = input_index(str(exc))
        if index is not None:  # a bad prompt (no tokens, a token id outside the vocabulary)
            where = input_name(index, names)
            return ApiError(400, in_body_terms(str(exc), names), param=where.split("[")[0])
    field = getattr(exc, "field", None)
    return ApiError(400, in_body_terms(str(exc), names), param=names.get(field, field) if field else None)


def _route(path: str) -> Route | None:
    return "chat" if path.endswith("/chat/completions") else "completions" if path.endswith("/completions") else None


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
        max_logprobs: int,
        sessions: SessionStore,
        limits: Limits,
    ) -> None:
        self.sampler = sampler
        self.limits = limits
        self.model_name = model_name
        self.tool_parser = get_tool_parser(tool_parser)
        self.no_parser = get_tool_parser("none")
        self.on_template_mismatch = on_template_mismatch
        if isinstance(default_max_tokens, bool) or not isinstance(default_max_tokens, int) or default_max_tokens < 1:
            raise ConfigError(
                f"default_max_tokens={default_max_tokens!r} is invalid: expected an integer >= 1 (max_tokens for a"
                " request that gives none)."
            )
        self.default_max_tokens = default_max_tokens
        if isinstance(max_logprobs, bool) or not isinstance(max_logprobs, int) or max_logprobs < 0:
            raise ConfigError(
                f"max_logprobs={max_logprobs!r} is invalid: expected an integer >= 0 (the most log-prob"
                " alternatives a request may ask for per position)."
            )
        self.max_logprobs = max_logprobs
        self.sessions = sessions
        #: the calls in flight by request id (the server's own calls only)
        self.in_flight: dict[str, list[Pending]] = {}
        #: set while the server takes new calls; cleared by /pause (made in the app's event loop)
        self.running = asyncio.Event()
        self.running.set()
        self.pause_mode: str | None = None
        self.waiting = 0  # calls held by /pause
        self.prompt_tokens = self.generated_tokens = self.finished_calls = 0

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

    def params(
        self,
        req: Any,
        route: Route,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        default_max_tokens: int | None = None,
    ) -> SamplingParams:
        """The engine's ``SamplingParams`` for a body (a 400 naming the field it cannot honour).

        ``max_tokens``: the body's (``None`` when it gives none: ``default_max_tokens``,
        else the server's ``--max-tokens``, is used then).
        """
        bad = neutral_violation(route, req.model_dump(exclude_unset=True))
        if bad is not None:
            raise ApiError(400, bad, param=bad.split("=", 1)[0])
        limit = self.sampler.max_model_len
        if max_tokens is not None and max_tokens > limit:
            # As vLLM's server answers. A budget within the context is cut to what the prompt leaves.
            name = body_names(route, req).get("max_tokens", "max_tokens")
            raise ApiError(
                400,
                f"{name}={max_tokens} is more than this model's context of {limit} tokens (max_model_len, the"
                f" prompt included): ask for at most {limit}; a reply ends where the context does.",
                param=name,
            )
        if req.stream and req.prompt_logprobs is not None:
            raise ApiError(
                400,
                "stream with prompt_logprobs is not supported: the prompt's log-probs come with whole replies;"
                " ask without stream.",
                param="prompt_logprobs",
            )
        for field, count in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            # Each alternative is a row per position per choice of the reply: a client cannot ask for the vocabulary.
            if count is not None and count > self.max_logprobs:
                name = body_names(route).get(field, field)
                raise ApiError(
                    400,
                    f"{name}={count} is more than this server allows: at most {self.max_logprobs} log-prob"
                    f" alternatives per position (start it with --max-logprobs {count} for more).",
                    param=name,
                )
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options needs stream=true.", param="stream_options")
        if req.stream_options is not None and set(req.stream_options) - {"include_usage"}:
            raise ApiError(
                400,
                f"stream_options={brief(req.stream_options)}: only 'include_usage' is supported.",
                param="stream_options",
            )
        fields: dict[str, Any] = {
            "num_samples": req.n,
            "max_tokens": max_tokens if max_tokens is not None else default_max_tokens or self.default_max_tokens,
            # the sampled token's log-prob always comes back (as sampled_logprobs)
            "logprobs": logprobs if logprobs is not None else 0,
            "prompt_logprobs": prompt_logprobs,
            "ignore_eos": req.ignore_eos,
        }
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "min_tokens",
            "logit_bias",
            "allowed_token_ids",
            "bad_words",
        ):
            if getattr(req, name) is not None:
                fields[name] = getattr(req, name)
        if req.top_k is not None:
            fields["top_k"] = -1 if req.top_k == 0 else req.top_k  # vLLM: 0 and -1 both mean off
        if req.stop is not None and req.stop != []:  # "" is refused below, as [""] is: it never matches
            fields["stop"] = req.stop
        if req.stop_token_ids:
            fields["stop_token_ids"] = req.stop_token_ids
        if req.return_routed_experts:
            fields["return_routed_experts"] = True
        structured = _structured_outputs(req.structured_outputs, req.response_format)
        if structured is not None:
            fields["structured_outputs"] = structured
        try:
            return SamplingParams(**fields)
        except TwinkleError as exc:
            raise _twinkle_status(exc, body_names(route, req)) from None

    def template_with(self, options: dict[str, Any] | None) -> Any:
        """The sampler's template with a body's ``chat_template_kwargs`` (``None`` when it sets none)."""
        if not options:
            return None
        try:
            return self.sampler.template.with_options(**options)
        except TwinkleError as exc:
            raise ApiError(400, str(exc), param="chat_template_kwargs") from None

    def check_parts(self, parts: int, names: Mapping[str, str]) -> None:
        """Refuse a conversation of more messages and tools than the context has tokens, before any is
        converted or rendered: each renders to a token at least."""
        limit = self.sampler.max_model_len - 1
        if parts > limit:
            raise self.refusal(PromptTooLongError("", index=0, length=parts, limit=limit, at_least=True), names)

    def refusal(self, exc: BaseException, names: Mapping[str, str] | None = None) -> BaseException:
        """What a route raises for an engine call refused at submission (the error itself if unexpected).

        ``names``: :func:`body_names` of the call's body.
        """
        if isinstance(exc, TwinkleError):
            return _twinkle_status(exc, names)
        return exc

    def stream_error(self, exc: Exception, names: Mapping[str, str] | None = None) -> str:
        """A call that failed after its stream's 200 went out: the error as the stream's last events, then ``[DONE]``.

        A refused input (a token id out of the vocabulary, a prompt too long, a
        bad grammar) is found by the engine once the call runs; the client gets
        the same error body a call without ``stream`` gets, not a cut connection.
        """
        error = self.refusal(exc, names)
        if not isinstance(error, ApiError):
            log.error("a streamed call failed", exc_info=exc)
            error = ApiError(
                500, f"Internal error ({type(exc).__name__}); the server is still up.", kind="server_error"
            )
        self.limits.refuse_answer(error)
        return error.event() + "data: [DONE]\n\n"

    # -- calls in flight, pause --------------------------------------------------------------------
    @contextmanager
    def tracked(self, request_id: str, pending: Pending) -> Iterator[None]:
        """Name a call in flight (``/abort_requests`` takes the name) while the block runs; abort it at the
        deadline (``--request-timeout``)."""
        self.in_flight.setdefault(request_id, []).append(pending)
        deadline = self.limits.deadline(pending.abort)
        try:
            yield
        finally:
            if deadline is not None:
                deadline.cancel()
            calls = self.in_flight.get(request_id, [])
            if pending in calls:
                calls.remove(pending)
            if not calls:
                self.in_flight.pop(request_id, None)

    async def unpaused(self) -> None:
        """Wait while the server is paused (``/pause``): new calls start after ``/resume``."""
        if self.running.is_set():
            return
        self.waiting += 1
        try:
            await self.running.wait()
        finally:
            self.waiting -= 1

    def count(self, prompt_tokens: int, generated_tokens: int) -> None:
        """Add a finished call to ``/metrics``."""
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated_tokens
        self.finished_calls += 1


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


def _finish(turn_or_seq: Any, has_calls: bool) -> str:
    if has_calls:
        return "tool_calls"
    reason = turn_or_seq.stop_reason
    return reason if reason in ("length", "abort") else "stop"


def create_app(
    sampler: Any,
    *,
    model_name: str | None = None,
    api_key: str | None = None,
    tool_parser: Any = "hermes",
    on_template_mismatch: OnTemplateMismatch = "raise",
    default_max_tokens: int = 256,
    max_logprobs: int = 20,
    sessions: SessionStore | None = None,
    max_workers: int = 64,
    weight_transfer: Mapping[str, Any] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_pending_requests: int = DEFAULT_MAX_PENDING_REQUESTS,
    request_timeout: float | None = None,
    max_stored_responses: int = 1024,
) -> FastAPI:
    """The OpenAI-compatible application over ``sampler`` (see :func:`twinkle_core.server.serve`)."""
    transfer_config = check_weight_config(weight_transfer)
    limits = Limits(max_body_bytes, max_pending_requests, request_timeout)
    state = _Server(
        sampler,
        model_name=model_name or "twinkle",
        tool_parser=tool_parser,
        on_template_mismatch=on_template_mismatch,
        default_max_tokens=default_max_tokens,
        max_logprobs=max_logprobs,
        sessions=sessions if sessions is not None else SessionStore(),
        limits=limits,
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

    app.add_middleware(LimitsMiddleware, limits=limits)
    if api_key is not None:  # added last, so it runs first: a client without the key costs no body read
        app.add_middleware(_KeyCheck, api_key=api_key)

    def refused(error: ApiError) -> JSONResponse:
        limits.refuse_answer(error)
        return error.response()

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return refused(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors():
            if e.get("type") == "json_invalid":  # its loc is a character position, not a field
                where = e.get("loc", ("body", "?"))[-1]
                why = (e.get("ctx") or {}).get("error", "")
                return refused(
                    ApiError(
                        400,
                        f"Invalid request: the body is not valid JSON ({why or e.get('msg')}, at character {where}).",
                    )
                )
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {e.get('msg')}" + (f" (got {brief(e['input'])})" if "input" in e else ""))
        first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
        param = ".".join(str(x) for x in first if x != "body") or None
        return refused(ApiError(400, "Invalid request: " + "; ".join(parts), param=param))

    @app.exception_handler(TwinkleError)
    async def on_twinkle(request: Request, exc: TwinkleError) -> JSONResponse:
        return refused(_twinkle_status(exc, body_names(_route(request.url.path))))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own refusals: an unknown route, a body it could not parse (nested deeper than the parser goes)
        return refused(ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None))

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
        base = {"object": "model", "created": 0, "owned_by": "twinkle", "max_model_len": sampler.max_model_len}
        data = [
            {"id": state.model_name, **base, "root": state.model_name, "parent": None},
            {"id": "base", **base, "root": state.model_name, "parent": None},
        ]
        for name, info in sampler.adapters.items():
            data.append({"id": name, **base, "root": info.source, "parent": state.model_name})
        return {"object": "list", "data": data}

    add_control_routes(app, state, transfer_config)
    add_weight_routes(app, state, transfer_config)
    from twinkle_core.server.responses import add_response_routes  # it builds on this module's calls

    add_response_routes(app, state, max_stored_responses)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, request: Request) -> Any:
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
        try:
            trajectory = Trajectory(messages=messages, tools=openai_tools(req.tools))
        except TwinkleError as exc:
            raise ApiError(400, str(exc), param="tools") from None
        parser = state.no_parser if req.tool_choice == "none" else state.tool_parser
        fields = body_names("chat", req)
        params, constraint = constrain(
            params, state.tool_parser, req.tools, req.tool_choice, req.parallel_tool_calls, fields
        )
        session_id = _session_id(request, req)
        template = state.template_with(req.chat_template_kwargs)
        await state.unpaused()
        call = await _start(state, session_id, trajectory, parser, params, adapter, template, fields, constraint)
        rid = req.request_id or ("chatcmpl-" + uuid.uuid4().hex)
        prompt_ids = list(call.target.tokens)
        names = TokenNames(sampler.template, bool(req.return_tokens_as_token_ids))
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

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await complete(state, req, request)

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

    # Ids may hold "/" (say "run-3/episode-17"): the routes take the rest of the path, the export suffix first.
    @app.get("/v1/sessions/{session_id:path}/export")
    async def export_session(session_id: str) -> PlainTextResponse:
        lines = [json.dumps(r) for r in _session(session_id).export()]
        return PlainTextResponse("".join(line + "\n" for line in lines), media_type="application/x-ndjson")

    @app.get("/v1/sessions/{session_id:path}")
    async def get_session(session_id: str) -> dict[str, Any]:
        session = _session(session_id)
        return {**session.summary(), "data": session.export()}

    @app.delete("/v1/sessions/{session_id:path}")
    async def delete_session(session_id: str) -> dict[str, Any]:
        _session(session_id)
        state.sessions.delete(session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    return app


def _message(turn: Turn) -> dict[str, Any]:
    calls = turn.tool_calls
    return {
        "role": "assistant",
        # without calls, the text as sampled (the stream sends the same; the parser may have trimmed it)
        "content": (turn.message.content or None) if calls else turn.text,
        "tool_calls": _openai_calls(calls) if calls else None,
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
        **_extras(turn),
    }


async def _stream_chat(
    state: _Server,
    rid: str,
    req: ChatRequest,
    call: _Call,
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
        return _sse(
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
                    for text in _text_pieces(decode, turn):
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


def _structured_outputs(structured: dict[str, Any] | None, response_format: dict[str, Any] | None) -> Any:
    """vLLM's ``structured_outputs``, or OpenAI's ``response_format``, as ``SamplingParams.structured_outputs``."""
    if response_format is None or response_format.get("type") == "text":
        return structured  # {} is refused by SamplingParams (a constraint names exactly one kind), not dropped
    if structured is not None:
        raise ApiError(400, "Give structured_outputs or response_format, not both.", param="response_format")
    kind = response_format.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(
                400,
                f"response_format={brief(response_format)}: a json_schema needs json_schema.schema, a JSON schema.",
                param="response_format",
            )
        return {"json": schema}
    raise ApiError(
        400,
        f"response_format={brief(response_format)}: expected type 'text', 'json_object' or 'json_schema'.",
        param="response_format",
    )
