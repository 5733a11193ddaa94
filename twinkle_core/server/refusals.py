"""How the server refuses: twinkle's errors as OpenAI error answers, and the app's exception handlers.

An engine's error names its own fields (``SamplingParams.num_samples``,
``inputs[2]``); the answer names them as the request body did (``n``,
``prompt[2]``), with the HTTP status and OpenAI ``code`` a client expects.
Every refusal is counted by :class:`~twinkle_core.server.limits.Limits`
(``/metrics``) by its reason.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from twinkle_core.errors import (
    EngineDeadError,
    IncompleteUpdateError,
    InvalidInputError,
    NumericalError,
    PromptTooLongError,
    SamplerClosedError,
    TwinkleError,
    UnknownAdapterError,
)
from twinkle_core.server.limits import Limits
from twinkle_core.server.protocol import ApiError, Route, body_names, brief, in_body_terms, input_index, input_name

__all__ = ["add_error_handlers", "error_answer", "route_of"]

log = logging.getLogger("twinkle.server")


def error_answer(exc: TwinkleError, names: Mapping[str, str] | None = None) -> ApiError:
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


def route_of(path: str) -> Route | None:
    """The sampling route a request path is (its body's names are that route's), or ``None``."""
    return "chat" if path.endswith("/chat/completions") else "completions" if path.endswith("/completions") else None


def _validation_answer(exc: RequestValidationError) -> ApiError:
    """A body FastAPI could not read into the route's model, as one 400 naming every bad field."""
    parts = []
    for e in exc.errors():
        if e.get("type") == "json_invalid":  # its loc is a character position, not a field
            where = e.get("loc", ("body", "?"))[-1]
            why = (e.get("ctx") or {}).get("error", "")
            return ApiError(
                400,
                f"Invalid request: the body is not valid JSON ({why or e.get('msg')}, at character {where}).",
            )
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" + (f" (got {brief(e['input'])})" if "input" in e else ""))
    first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
    param = ".".join(str(x) for x in first if x != "body") or None
    return ApiError(400, "Invalid request: " + "; ".join(parts), param=param)


def add_error_handlers(app: FastAPI, limits: Limits) -> None:
    """Answer every error a route raises as OpenAI's error body, counting each refusal in ``limits``."""

    def refused(error: ApiError) -> JSONResponse:
        limits.refuse_answer(error)
        return error.response()

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, exc: ApiError) -> JSONResponse:
        return refused(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refused(_validation_answer(exc))

    @app.exception_handler(TwinkleError)
    async def on_twinkle(request: Request, exc: TwinkleError) -> JSONResponse:
        return refused(error_answer(exc, body_names(route_of(request.url.path))))

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
