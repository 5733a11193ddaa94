"""``twinkle serve``: an OpenAI-compatible rollout server over any twinkle sampler.

Needs the ``server`` extra (``pip install "twinkle-core[server]"``: FastAPI and
uvicorn). Nothing here is imported by ``import twinkle_core``; FastAPI is
imported when an app is built.

The server speaks vLLM's protocol (``docs/server.md`` has every route and
field): ``/v1/completions`` and ``/v1/chat/completions`` with vLLM's
extensions (``server/protocol.py`` says how each field is treated), the
tokenizer, RL-control and runtime-LoRA routes of ``vllm serve``
(``server/control.py``), and twinkle's sessions: ``GET /v1/sessions``,
``GET /v1/sessions/{id}`` (the episodes with their training features),
``GET /v1/sessions/{id}/export`` and ``GET /v1/sessions/export`` (JSONL),
``DELETE /v1/sessions/{id}``. ``/health`` never needs the key. A chat call
joins session ``id`` through the ``X-Session-Id`` header, the body's
``session_id``, or its ``user`` field.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Mapping
from typing import Any

from twinkle_core.errors import ConfigError
from twinkle_core.net import check_port, is_loopback
from twinkle_core.server.sessions import Session, SessionStore

__all__ = [
    "API_KEY_ENV",
    "RunningServer",
    "Session",
    "SessionStore",
    "create_app",
    "is_loopback",
    "resolve_key",
    "serve",
    "start_server",
]

#: The environment variable read when no ``api_key`` is passed.
API_KEY_ENV = "TWINKLE_API_KEY"


def resolve_key(host: str, api_key: str | None) -> str | None:
    """The API key a server bound to ``host`` checks: ``api_key``, else :data:`API_KEY_ENV`; required off loopback.

    Raises:
        ConfigError: an empty key, or none for an address beyond this machine.
    """
    key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    if key is not None and (not isinstance(key, str) or not key.strip()):
        raise ConfigError(f"api_key={key!r} is invalid: expected a non-empty string.")
    if key is None and not is_loopback(host):
        raise ConfigError(
            f"Binding to {host!r} exposes the server beyond this machine, so an API key is required: pass"
            f" --api-key / api_key=..., or set {API_KEY_ENV}. Without one, bind to 127.0.0.1."
        )
    return key


def create_app(sampler: Any, **kwargs: Any) -> Any:
    """The FastAPI application over ``sampler`` (see :func:`serve` for the options)."""
    try:
        from twinkle_core.server.app import create_app as build
    except ImportError as exc:
        raise ConfigError(
            f'twinkle serve needs FastAPI and uvicorn ({exc}); install them with: pip install "twinkle-core[server]"'
        ) from exc
    return build(sampler, **kwargs)


def _config(sampler: Any, host: str, port: int, api_key: str | None, log_level: str, kwargs: dict[str, Any]) -> Any:
    import uvicorn

    check_port(port)
    app = create_app(sampler, api_key=resolve_key(host, api_key), **kwargs)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def serve(
    sampler: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    api_key: str | None = None,
    model_name: str | None = None,
    tool_parser: Any = "hermes",
    on_template_mismatch: str = "raise",
    default_max_tokens: int = 256,
    max_logprobs: int = 20,
    sessions: SessionStore | None = None,
    log_level: str = "info",
    weight_transfer: Mapping[str, Any] | None = None,
    max_body_bytes: int | None = None,
    max_pending_requests: int | None = None,
    request_timeout: float | None = None,
    max_stored_responses: int | None = None,
    allowed_local_media_path: str | os.PathLike[str] | None = None,
    allow_remote_media: bool = False,
) -> None:
    """Serve ``sampler`` over the OpenAI API until interrupted (blocking).

    Run it in a thread (or use :func:`start_server`) to keep training in the
    same process: weight and adapter updates pushed into ``sampler`` apply to
    the calls after them, and every reply carries its ``weights_version``.

    Args:
        sampler: any twinkle sampler (local or ``remote_group``).
        host: the address to bind; anything but loopback needs an API key.
        port: the TCP port.
        api_key: required as ``Authorization: Bearer <key>`` on every route but
            ``/health``; default: ``$TWINKLE_API_KEY``.
        model_name: the name the base model is listed under (``base`` also works);
            adapters are selected by their names.
        tool_parser: how tool calls are read (a registered name or a parser).
        on_template_mismatch: ``"raise"`` or ``"keep_sampled"`` (see ``twinkle_core.episode``).
        default_max_tokens: ``max_tokens`` when a call gives none.
        max_logprobs: the most log-prob alternatives a call may ask for per position
            (``logprobs``, ``top_logprobs``, ``prompt_logprobs``); vLLM's default, 20.
        sessions: a store to record sessions in (the caller keeps a handle to it).
        log_level: uvicorn's log level.
        weight_transfer: ``{"backend": "gloo"}`` turns on vLLM's weight-transfer
            routes (a trainer in another process pushes weights with
            :class:`twinkle_core.client.WeightClient`); see :mod:`twinkle_core.server.weights`.
        max_body_bytes: the largest request body (413 past it, checked while
            reading); default 32 MiB.
        max_pending_requests: the most sampling calls held at once, running or
            waiting; one more is answered 503 with ``Retry-After``; default 512.
        request_timeout: seconds after which a sampling call is aborted, its
            reply holding what was sampled by then (``None``: no deadline).
            See :mod:`twinkle_core.server.limits`.
        max_stored_responses: the most ``/v1/responses`` replies kept for
            ``previous_response_id``, the oldest evicted first; default 1024.
        allowed_local_media_path: the folder a request's images may name local
            files in (``file://`` or a path); ``None``: no local file is read.
        allow_remote_media: fetch a request's ``http(s)`` image URLs (off: a 400).
            See :mod:`twinkle_core.server.media`.

    Raises:
        ConfigError: a non-loopback host without an API key, or FastAPI/uvicorn missing.
    """
    import uvicorn

    options = {
        "model_name": model_name,
        "tool_parser": tool_parser,
        "on_template_mismatch": on_template_mismatch,
        "default_max_tokens": default_max_tokens,
        "max_logprobs": max_logprobs,
        "sessions": sessions,
        "weight_transfer": weight_transfer,
        "request_timeout": request_timeout,
        "allowed_local_media_path": allowed_local_media_path,
        "allow_remote_media": allow_remote_media,
    }
    for name, value in (
        ("max_body_bytes", max_body_bytes),
        ("max_pending_requests", max_pending_requests),
        ("max_stored_responses", max_stored_responses),
    ):
        if value is not None:  # None: the app's default
            options[name] = value
    uvicorn.Server(_config(sampler, host, port, api_key, log_level, options)).run()


class RunningServer:
    """A server running in a background thread (from :func:`start_server`).

    Attributes:
        url: ``http://host:port``.
        sessions: the session store, readable while it runs.
    """

    def __init__(self, server: Any, thread: threading.Thread, url: str, sessions: SessionStore) -> None:
        self._server, self._thread, self.url, self.sessions = server, thread, url, sessions

    def stop(self) -> None:
        """Shut the server down and wait for its thread."""
        self._server.should_exit = True
        self._thread.join()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    sampler: Any, host: str = "127.0.0.1", port: int = 0, *, api_key: str | None = None, **kwargs: Any
) -> RunningServer:
    """Start the server in a background thread and return once it accepts connections.

    ``port=0`` picks a free port (see ``RunningServer.url``). Other options as :func:`serve`.
    """
    import uvicorn

    sessions = kwargs.pop("sessions", None) or SessionStore()
    log_level = kwargs.pop("log_level", "warning")
    config = _config(sampler, host, port, api_key, log_level, {**kwargs, "sessions": sessions})
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    started = threading.Event()
    failed: list[BaseException] = []

    class _Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            started.set()

    server = _Server(config)

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:
            failed.append(exc)
        finally:
            started.set()

    thread = threading.Thread(target=run, name="twinkle-serve", daemon=True)
    thread.start()
    started.wait()
    if failed or not server.started:
        raise ConfigError(f"The server did not start on {host}:{port}: {failed[0] if failed else 'see the log'}.")
    bound_host, bound_port = sock.getsockname()[:2]
    return RunningServer(server, thread, f"http://{bound_host}:{bound_port}", sessions)
