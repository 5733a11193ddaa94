"""Tokenizing a text that may be far longer than any context, without tokenizing it whole.

A tokenizer's time and memory grow with its input: a 64 MiB chat message
took a fast tokenizer 139 s and 9 GB of resident memory, to learn that a
prompt of 32 million tokens does not fit a context of a few thousand. What a
sampler needs of a long text is only ever one end of its tokens: the first
``limit + 1`` (to know it cannot fit), or the first or last ``keep`` (to
truncate it). Both come from a window of the text at that end.

Why a window's tokens are the text's: a tokenizer cuts a text into
pre-tokens (words, runs of spaces, special tokens) and tokenizes each on its
own, so cutting the text changes only the tokens near the cut. The tokens at
the window's far end are therefore the text's, unless the cut reaches them.
Rather than trust a bound on how far a cut reaches (which depends on the
tokenizer's rules), the tokens wanted are read from two windows, one twice
the other: they are taken only when both windows give the same ones, and a
window larger than the text is the text. A window starts at
:data:`START_CHARS_PER_TOKEN` characters per token wanted and doubles until
it holds enough tokens, so a text is read at most a few times the length
that holds the tokens wanted, whatever its characters per token; a prompt
that fits is tokenized once, whole, as before.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["START_CHARS_PER_TOKEN", "first_tokens", "last_tokens"]

#: Characters per wanted token in the first window: about what a token covers in prose. A text with more
#: characters per token only costs more doublings (each window twice the last, so their sum stays under
#: twice the last); a larger start would make every window of a dense text needlessly large.
START_CHARS_PER_TOKEN = 4
#: Tokens beyond those wanted that a window must hold, so the cut is away from them.
_SLACK = 16

Encode = Callable[[str], list[int]]


def _end_tokens(encode: Encode, text: str, count: int, *, last: bool) -> tuple[list[int], bool]:
    window = (count + _SLACK) * START_CHARS_PER_TOKEN
    agreed: list[int] | None = None
    while window < len(text):
        ids = encode(text[-window:] if last else text[:window])
        if len(ids) > count + _SLACK:
            end = ids[-count:] if last else ids[:count]
            if end == agreed:
                return end, False
            agreed = end
        window *= 2
    return encode(text), True


def first_tokens(encode: Encode, text: str, count: int) -> tuple[list[int], bool]:
    """The first ``count`` tokens of ``text``, tokenizing no more of it than it takes.

    Returns:
        ``(ids, whole)``: with ``whole``, ``ids`` are all of the text's tokens
        (maybe more than ``count``: the caller cuts); without, exactly the
        first ``count``, and the text has more.
    """
    return _end_tokens(encode, text, count, last=False)


def last_tokens(encode: Encode, text: str, count: int) -> tuple[list[int], bool]:
    """The last ``count`` tokens of ``text``, as :func:`first_tokens` gives the first."""
    return _end_tokens(encode, text, count, last=True)
