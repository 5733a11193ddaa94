"""Sessions of the rollout server: consecutive calls of one client joined into token-exact episodes.

An agent framework resends the whole conversation on every call. A session
keeps the episodes it has produced; a call whose messages start with one of
them (the messages the server answered, the client's copy of the assistant
turns included) extends that episode with only the new messages, through the
template's delta. A call that extends none of them (a retry, a rewritten
history) starts a new episode in the same session, so nothing sampled is
ever re-tokenized. Forks (``n > 1``) are all kept; the client's next call
picks the one it continues by sending it back.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

from twinkle_core.data_format import Message
from twinkle_core.episode import Episode

__all__ = ["Session", "SessionStore", "message_key"]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    return json.dumps(content, sort_keys=True)


def _args(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than the parser goes
            return str(arguments)
    return json.dumps(arguments, sort_keys=True)


def message_key(message: Message) -> tuple[Any, ...]:
    """What must agree for a client's copy of a message to count as the stored one.

    Tool-call ids and whitespace around the content are left out: clients
    regenerate or trim them, and neither changes what the model sampled.
    """
    calls = tuple(
        (c.get("function", c).get("name"), _args(c.get("function", c).get("arguments", {})))
        for c in message.tool_calls or []
    )
    return (message.role, message.name, _text(message.content), calls)


class Session:
    """The episodes of one session id, and the lock that orders its calls."""

    def __init__(self, session_id: str) -> None:
        self.id = session_id
        self.episodes: list[Episode] = []
        self._lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        """Held while a call of this session samples (created in the server's event loop)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def match(self, messages: list[Message]) -> tuple[Episode, list[Message]] | None:
        """The episode ``messages`` continue (the longest), and the messages it lacks."""
        keys = [message_key(m) for m in messages]
        best: tuple[Episode, list[Message]] | None = None
        for ep in self.episodes:
            n = len(ep.messages)
            if ep.awaiting_sample or n >= len(messages) or keys[:n] != [message_key(m) for m in ep.messages]:
                continue
            new = messages[n:]
            if any(m.role == "assistant" for m in new):
                continue
            if best is None or n > len(best[0].messages):
                best = (ep, new)
        return best

    def summary(self) -> dict[str, Any]:
        """Counts for listings."""
        return {
            "id": self.id,
            "episodes": len(self.episodes),
            "turns": sum(len(e.turns) for e in self.episodes),
            "tokens": sum(len(e.tokens) for e in self.episodes),
        }

    def export(self) -> list[dict[str, Any]]:
        """Each episode as a JSON-ready record (messages, tools, training feature)."""
        return [{"session_id": self.id, "episode": i, **e.to_dict()} for i, e in enumerate(self.episodes)]


class SessionStore:
    """Sessions by id; thread-safe, so the trainer can read them while the server runs."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def get_or_create(self, session_id: str) -> Session:
        """The session ``session_id``, created empty if new."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                session = self._sessions[session_id] = Session(session_id)
            return session

    def get(self, session_id: str) -> Session | None:
        """The session, or ``None``."""
        with self._lock:
            return self._sessions.get(session_id)

    def delete(self, session_id: str) -> bool:
        """Forget a session; whether it existed."""
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def list(self) -> list[Session]:
        """Every session, oldest first."""
        with self._lock:
            return list(self._sessions.values())
