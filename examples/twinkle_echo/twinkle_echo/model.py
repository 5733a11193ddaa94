"""``EchoModel``: a deterministic toy language model in pure Python.

It stands in for a neural network: ``logits(context)`` returns one float per
token id and depends only on the token ids given, so scoring a sequence
(``prompt_logprobs``) sees exactly the distributions generation sampled from.

How it "thinks":

* In an assistant turn (the context ends inside ``<|im_start|>assistant\\n...``)
  it echoes the latest user (or tool) message, then ``<|im_end|>``; with
  ``ignore_eos`` it starts over. Position ``m`` of the turn points at token
  ``m`` of that message.
* Anywhere else it continues the text like an induction head: it finds the
  most recent earlier occurrence of the last 4, 3, 2 or 1 tokens and points at
  the token that followed it.
* The pointed-at token gets a large bonus (:data:`ECHO_BONUS`) on top of
  hash-seeded noise that depends on the last two tokens, so distributions are
  peaked but never one-hot: greedy decoding echoes, sampling at temperature 1
  strays now and then, and high temperatures wander.
* After ``.``, ``!`` or ``?`` the end-of-turn token gets a bonus: sampled text
  sometimes ends early, as a real chat model's would.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

from twinkle_echo.tokenizer import IM_END_ID, IM_START_ID, NUM_BYTES, PAD_ID

__all__ = ["ECHO_BONUS", "NOISE_SCALE", "EchoModel"]

#: Logit bonus of the token the model means to echo.
ECHO_BONUS = 8.0
#: Hash-seeded noise is uniform in ``[0, NOISE_SCALE)``.
NOISE_SCALE = 3.0
#: Bonus of ``<|im_end|>`` right after sentence-ending punctuation.
EOS_AFTER_PUNCTUATION = 4.0
#: How far back the induction rule matches.
MAX_MATCH = 4

_ASSISTANT_HEADER = tuple(b"assistant\n")
_SOURCE_ROLES = (tuple(b"user\n"), tuple(b"tool\n"))
_SENTENCE_END = frozenset(b".!?")


def _prior(token_id: int) -> float:
    """A fixed per-token offset: printable text likely, odd bytes and reserved ids not."""
    if token_id < NUM_BYTES:
        if 32 <= token_id < 127 or token_id == 10:
            return 0.0
        return -3.0 if token_id < 128 else -5.0
    return {IM_START_ID: -2.0, IM_END_ID: -1.0, PAD_ID: -4.0}.get(token_id, -10.0)


class EchoModel:
    """Next-token logits as a deterministic function of the token ids.

    Args:
        vocab_size: number of token ids (the tokenizer's length).
        seed: selects the noise table: different seeds are different "models".
        name: mixed into the seed, so two model ids give two models.
    """

    def __init__(self, vocab_size: int, *, seed: int = 0, name: str = "") -> None:
        self.vocab_size = vocab_size
        # zlib.crc32 is stable across runs and platforms, unlike hash(str).
        self._salt = (int(seed) * 1_000_003 + zlib.crc32(name.encode("utf-8"))) & 0xFFFFFFFFFFFF
        self._prior = [_prior(t) for t in range(vocab_size)]

    def logits(self, context: Sequence[int]) -> list[float]:
        """The next-token logits after ``context`` (a non-empty list of ids)."""
        a = context[-2] if len(context) > 1 else -1
        b = context[-1] if context else -1
        rng = random.Random((self._salt * 65_537 + (a + 1) * 4_099 + (b + 1)) & 0xFFFFFFFFFFFFFFFF)
        out = [p + NOISE_SCALE * rng.random() for p in self._prior]
        target = self.echo_target(context)
        if target is not None and target < self.vocab_size:
            out[target] += ECHO_BONUS
        if b in _SENTENCE_END:
            out[IM_END_ID] += EOS_AFTER_PUNCTUATION
        return out

    def echo_target(self, context: Sequence[int]) -> int | None:
        """The token the model would echo next, or ``None`` when it has no idea."""
        start = _last_index(context, IM_START_ID)
        if start is not None:
            header_end = start + 1 + len(_ASSISTANT_HEADER)
            if tuple(context[start + 1 : header_end]) == _ASSISTANT_HEADER and len(context) >= header_end:
                source = [*_latest_message(context, start), IM_END_ID]
                return source[(len(context) - header_end) % len(source)]
        return _induction(context)


def _last_index(context: Sequence[int], token_id: int, end: int | None = None) -> int | None:
    for i in range(len(context) - 1 if end is None else end - 1, -1, -1):
        if context[i] == token_id:
            return i
    return None


def _latest_message(context: Sequence[int], before: int) -> list[int]:
    """Content of the last user or tool turn that starts before ``before``."""
    end = before
    while True:
        start = _last_index(context, IM_START_ID, end)
        if start is None:
            return []
        for role in _SOURCE_ROLES:
            if tuple(context[start + 1 : start + 1 + len(role)]) == role:
                body_start = start + 1 + len(role)
                stop = _first_index(context, IM_END_ID, body_start, before)
                return list(context[body_start:stop])
        end = start


def _first_index(context: Sequence[int], token_id: int, start: int, end: int) -> int:
    for i in range(start, end):
        if context[i] == token_id:
            return i
    return end


def _induction(context: Sequence[int]) -> int | None:
    n = len(context)
    for length in range(min(MAX_MATCH, n - 1), 0, -1):
        suffix = list(context[n - length :])
        for j in range(n - length - 1, -1, -1):
            if list(context[j : j + length]) == suffix:
                return context[j + length]
    return None
