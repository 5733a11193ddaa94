"""``CharTokenizer``: one token per character, for engines in tests that need a template but no model."""

from __future__ import annotations

from typing import Any

__all__ = ["CharTokenizer"]


class CharTokenizer:
    """One token per character (code point modulo 256); id 0 ends a sequence. Enough for a ``Template``."""

    chat_template = "ascii"
    eos_token_id = 0

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ">"
