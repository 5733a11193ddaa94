"""The server's own bounds on a request: its body's size, the calls held at once, and a deadline.

A request must not cost the server more than a bound it can state in advance,
whatever the client sends. The engine's checks bound the work of a call once
its body is read (a prompt that cannot fit is refused before it is tokenized
whole, see :mod:`twinkle_core.template.bounds`); these bound the rest:

* **The body** (``max_body_bytes``): a declared ``Content-Length`` over it is
  answered 413 before a byte is read; a body sent without one is counted
  while it is read and answered 413 the moment it passes the bound. Nothing
  is parsed until the whole body is in, so no JSON of any size is built.
* **Calls held at once** (``max_pending_requests``): the sampling routes'
  calls, running or waiting for the engine. One more is answered 503 with
  ``Retry-After``, at once, instead of joining a queue that grows without
  bound. The other routes (health, metrics, weights, sessions) always answer.
* **A deadline** (``request_timeout``, seconds; none by default): a call still
  running then is aborted, as ``/abort_requests`` would: its reply holds what
  was sampled until then, each unfinished choice with ``finish_reason`` of
  ``"abort"``, and the session keeps that turn.

Each refusal is counted by reason for ``/metrics``
(``twinkle:requests_refused_total``). A body of more than a mebibyte that
was refused gives its memory back to the system (``malloc_trim``), so a burst
of oversized requests does not ratchet up the server's resident memory.

The middleware is pure ASGI: it hands the route a ``receive`` that replays the
body and then passes the client's own messages on, so the routes still see a
client that disconnects.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import gc
import math
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from twinkle_core.errors import ConfigError
from twinkle_core.server.protocol import ApiError

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_MAX_PENDING_REQUESTS", "SAMPLING_PATHS", "Limits", "LimitsMiddleware"]

#: The largest request body by default: room for long prompts (a context of 128k tokens is well under a MiB of
#: text) and a few images as data URLs; parsing this much costs a few hundred MiB at most.
DEFAULT_MAX_BODY_BYTES = 32 * 2**20
#: The most sampling calls held at once by default (running, or waiting for the engine).
DEFAULT_MAX_PENDING_REQUESTS = 512

#: The routes whose calls run the engine: the ones ``max_pending_requests`` counts.
SAMPLING_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
#: Seconds a client told the server is busy is asked to wait.
RETRY_AFTER_S = 1
#: A refused body at least this large gives its memory back to the system.
_TRIM_BYTES = 2**20


class Limits:
    """The bounds, and the count of what they refused (for ``/metrics``).

    Args:
        max_body_bytes: the largest request body, in bytes.
        max_pending_requests: the most sampling calls held at once.
        request_timeout: seconds after which a sampling call is aborted (``None``: never).

    Raises:
        ConfigError: a bound that is not a positive number.
    """

    def __init__(self, max_body_bytes: int, max_pending_requests: int, request_timeout: float | None) -> None:
        for name, value in (("max_body_bytes", max_body_bytes), ("max_pending_requests", max_pending_requests)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} is invalid: expected an integer >= 1.")
        if request_timeout is not None and (
            isinstance(request_timeout, bool)
            or not isinstance(request_timeout, (int, float))
            or not math.isfinite(request_timeout)
            or request_timeout <= 0
        ):
            raise ConfigError(
                f"request_timeout={request_timeout!r} is invalid: expected seconds > 0, or None for no deadline."
            )
        self.max_body_bytes = max_body_bytes
        self.max_pending_requests = max_pending_requests
        self.request_timeout = None if request_timeout is None else float(request_timeout)
        #: sampling calls held now
        self.pending = 0
        #: refusals by reason: body_too_large, server_busy, deadline, context_length_exceeded, invalid_request...
        self.refused: collections.Counter[str] = collections.Counter()

    def refuse(self, reason: str) -> None:
        """Count one refusal."""
        self.refused[reason] += 1

    def refuse_answer(self, error: ApiError) -> None:
        """Count an error answer, by its code (else ``invalid_request`` or ``server_error``, by its status)."""
        self.refuse(error.code or ("invalid_request" if error.status < 500 else "server_error"))

    def deadline(self, abort: Any) -> asyncio.TimerHandle | None:
        """Call ``abort()`` (a pending call's) at the deadline; the handle cancels it (``None``: no deadline)."""
        if self.request_timeout is None:
            return None

        def expire() -> None:
            if abort():
                self.refuse("deadline")

        return asyncio.get_running_loop().call_later(self.request_timeout, expire)


class LimitsMiddleware:
    """Pure ASGI middleware applying :class:`Limits` (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: Limits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.limits
        sampling = scope["method"] == "POST" and scope["path"] in SAMPLING_PATHS
        if sampling and limits.pending >= limits.max_pending_requests:
            await self._refuse(scope, receive, send, self._busy(), "server_busy")
            return
        size = 0
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(scope, receive, send)
            if body is None:
                return
            size = sum(len(m.get("body", b"")) for m in body)
            receive = _replay(body, receive)
            del body
        limits.pending += sampling
        try:
            await self.app(scope, receive, send)
        finally:
            limits.pending -= sampling
            if size >= _TRIM_BYTES:  # a large body's parse leaves freed heap behind: give it back
                give_back_memory()

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> list[Message] | None:
        """The body's messages, or ``None`` once a 413 has gone out (or the client left mid-body)."""
        limit = self.limits.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, self._too_large(int(declared)), "body_too_large")
            return None
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body was in: no one to answer
                return None
            messages.append(message)
            size += len(message.get("body", b""))
            if size > limit:
                messages.clear()  # its memory is what the bound protects
                await self._refuse(scope, receive, send, self._too_large(size, at_least=True), "body_too_large")
                if size >= _TRIM_BYTES:
                    give_back_memory()
                return None
            if not message.get("more_body", False):
                return messages

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, error: ApiError, reason: str) -> None:
        self.limits.refuse(reason)
        response = error.response()
        if reason == "server_busy":
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        await response(scope, receive, send)

    def _too_large(self, size: int, *, at_least: bool = False) -> ApiError:
        what = f"more than {size - 1:,}" if at_least else f"{size:,}"
        return ApiError(
            413,
            f"The request body has {what} bytes, more than this server accepts: at most"
            f" {self.limits.max_body_bytes:,} (start it with --max-body-mib for more).",
            code="body_too_large",
        )

    def _busy(self) -> ApiError:
        return ApiError(
            503,
            f"The server holds {self.limits.max_pending_requests} sampling calls already, its bound"
            f" (--max-pending-requests); retry after {RETRY_AFTER_S} s.",
            kind="server_error",
            code="server_busy",
        )


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that gives the body's messages, then the client's own (its disconnect)."""
    queue = collections.deque(messages)

    async def replay() -> Message:
        if queue:
            return queue.popleft()
        return await receive()

    return replay


def give_back_memory() -> None:
    """Collect garbage and return the freed heap to the system (glibc's ``malloc_trim``; elsewhere, collect only)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass
