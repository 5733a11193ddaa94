"""Stop strings: incremental detokenisation and matching across token boundaries.

A stop string can be split over several tokens ("</answ" + "er>"), so it is
matched against the decoded text, not the token ids. Decoding the whole
completion after every step would cost O(length^2); instead each row keeps a
small window of recent tokens and decodes only that (the same technique as
streaming detokenisers): the text of ``tokens[prefix:]`` minus the text of
``tokens[prefix:read]`` is what the newest tokens added. A window whose text
ends in an incomplete UTF-8 sequence (``"\ufffd"``) waits for more tokens.
"""

from __future__ import annotations

from typing import Any

__all__ = ["StopStringMatcher"]

_REPLACEMENT = "\ufffd"


class _RowText:
    """The decoded text of one row, grown a few tokens at a time."""

    __slots__ = ("prefix", "read", "text", "tokens")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.text = ""
        self.prefix = 0
        self.read = 0


class StopStringMatcher:
    """Finds the first stop string in each row's completion as tokens arrive.

    Args:
        tokenizer: a Hugging Face tokenizer.
        stops: the stop strings (non-empty).
        rows: how many rows to track.
        skip_special_tokens: decode as the template does (special tokens dropped).
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], rows: int, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self.stops = tuple(stops)
        self._longest = max(len(s) for s in self.stops)
        self._skip = skip_special_tokens
        self._rows = [_RowText() for _ in range(rows)]

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip))

    def push(self, row: int, token: int) -> tuple[str, int] | None:
        """Add one generated token to ``row``.

        Returns:
            ``(stop_string, position)`` when the row's text now contains a stop
            string (the earliest one; ``position`` is where it starts), else ``None``.
        """
        state = self._rows[row]
        state.tokens.append(token)
        before = self._decode(state.tokens[state.prefix : state.read])
        window = self._decode(state.tokens[state.prefix :])
        if len(window) <= len(before) or window.endswith(_REPLACEMENT):
            return None  # nothing printable yet (a partial character or a skipped special token)
        old_len = len(state.text)
        state.text += window[len(before) :]
        state.prefix, state.read = state.read, len(state.tokens)
        return self._find(state.text, max(0, old_len - self._longest + 1))

    def _find(self, text: str, start: int) -> tuple[str, int] | None:
        best: tuple[str, int] | None = None
        for stop in self.stops:
            pos = text.find(stop, start)
            if pos >= 0 and (best is None or pos < best[1]):
                best = (stop, pos)
        return best

    def text(self, row: int) -> str:
        """The text of ``row`` decoded so far."""
        return self._rows[row].text

    def final_text(self, tokens: list[int], stop: str, fallback_end: int, row: int) -> str:
        """The completion text cut before its first stop string.

        The whole completion is decoded once more, so the text is exactly
        what ``Template.decode`` gives, cut at the earliest stop string; if
        that decode disagrees with the incremental one, the incremental text is used.
        """
        full = self._decode(tokens)
        found = self._find(full, 0)
        if found is not None:
            return full[: found[1]]
        return self._rows[row].text[:fallback_end]
