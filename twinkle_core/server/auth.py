"""The API key check of ``twinkle serve --api-key``."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from twinkle_core.server.protocol import ApiError

__all__ = ["KeyCheck"]


class KeyCheck:
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
