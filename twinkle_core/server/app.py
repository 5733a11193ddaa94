"""The FastAPI application of ``twinkle serve``: OpenAI routes over episodes.

The server is a thin layer: a chat call becomes an :class:`~twinkle_core.episode.Episode`
(new, or the session's episode it continues), one turn is submitted to the
engine with ``Sampler.submit()`` (concurrent calls are batched by engines
that batch), and the reply is built from the turn. Each choice carries,
besides the OpenAI fields, the sampled ``token_ids``, their
``sampled_logprobs``, the ``weights_version`` and ``adapter_name`` that
produced them, and ``tool_call_errors``.

Every call is a :class:`~twinkle_core.server.turns.TurnCall`: the engine's handle plus a task that, once
the handle is done, extends the episode and records it in the session (and
only then lets the session's next call in). A client that goes away, while
it waits for a whole reply or mid-stream, aborts the handle: the engine
stops generating, and the turn is still recorded, with what was sampled up
to then and ``stop_reason="abort"``. Streaming sends each choice as soon as
the engine finishes it (``async for`` over the handle), as one chunk per
token of its text. A sampler without ``submit()`` (the Ray front end today)
runs ``sample()`` in a worker thread instead; its calls cannot be aborted.

This module only assembles the app. The state every route shares is
:mod:`~twinkle_core.server.state`; each group of routes is added by the
module that holds it (``chat``, ``completions``, ``responses``,
``session_routes``, ``control``, ``weights``), and errors become OpenAI
error bodies in :mod:`~twinkle_core.server.refusals`.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

import attrs
from fastapi import FastAPI

from twinkle_core.data_format.media_loading import MediaLimits
from twinkle_core.episode import OnTemplateMismatch
from twinkle_core.server.auth import KeyCheck
from twinkle_core.server.chat import add_chat_routes
from twinkle_core.server.completions import add_completion_routes
from twinkle_core.server.control import add_control_routes
from twinkle_core.server.limits import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PENDING_REQUESTS, Limits, LimitsMiddleware
from twinkle_core.server.media import MediaAccess
from twinkle_core.server.refusals import add_error_handlers
from twinkle_core.server.responses import add_response_routes
from twinkle_core.server.session_routes import add_session_routes
from twinkle_core.server.sessions import SessionStore
from twinkle_core.server.state import ServerState
from twinkle_core.server.weights import add_weight_routes
from twinkle_core.server.weights import check_config as check_weight_config

__all__ = ["create_app"]


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
    allowed_local_media_path: str | os.PathLike[str] | None = None,
    allow_remote_media: bool = False,
) -> FastAPI:
    """The OpenAI-compatible application over ``sampler`` (see :func:`twinkle_core.server.serve`)."""
    transfer_config = check_weight_config(weight_transfer)
    media_access = MediaAccess(allowed_local_media_path=allowed_local_media_path, allow_remote_media=allow_remote_media)
    template_limits = getattr(sampler.template, "limits", None)
    if allow_remote_media and isinstance(template_limits, MediaLimits):  # the template fetches what is allowed
        sampler.template.limits = attrs.evolve(template_limits, allow_remote_urls=True)
    limits = Limits(max_body_bytes, max_pending_requests, request_timeout)
    state = ServerState(
        sampler,
        model_name=model_name or "twinkle",
        tool_parser=tool_parser,
        on_template_mismatch=on_template_mismatch,
        default_max_tokens=default_max_tokens,
        max_logprobs=max_logprobs,
        sessions=sessions if sessions is not None else SessionStore(),
        limits=limits,
        media_access=media_access,
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
        app.add_middleware(KeyCheck, api_key=api_key)
    add_error_handlers(app, limits)
    _add_model_routes(app, state)
    add_control_routes(app, state, transfer_config)
    add_weight_routes(app, state, transfer_config)
    add_response_routes(app, state, max_stored_responses)
    add_chat_routes(app, state)
    add_completion_routes(app, state)
    add_session_routes(app, state)
    return app


def _add_model_routes(app: FastAPI, state: ServerState) -> None:
    """``/health`` and ``/v1/models``: the base model under its served name and ``base``, then each adapter."""
    sampler = state.sampler

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
