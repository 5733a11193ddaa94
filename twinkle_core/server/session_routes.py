"""``/v1/sessions``: the episodes the server recorded, listed, exported as JSON lines, or deleted."""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from twinkle_core.server.protocol import ApiError
from twinkle_core.server.sessions import Session
from twinkle_core.server.state import ServerState

__all__ = ["add_session_routes"]


def add_session_routes(app: FastAPI, state: ServerState) -> None:
    """Add the session routes to ``app``."""

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
