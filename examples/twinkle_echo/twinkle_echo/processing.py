"""Turning logits into a sampled token and its log-probs, in pure Python.

This is the part of an engine that the log-probability contract is about, so
it is spelled out step by step, in the order twinkle documents:

1. repetition penalty (the CTRL / Hugging Face rule) on every token already
   in the prompt or the completion;
2. greedy decoding stops here: the token is the argmax, and its ``processed``
   log-prob is that of the penalised distribution;
3. otherwise temperature, then top-k, top-p and min-p, each removing tokens
   (their logit becomes ``-inf``); the token is drawn from what is left, and
   the ``processed`` log-probs are that distribution's.

``raw`` log-probs are always the log-softmax of the model's logits.

Ties are broken towards the lower token id everywhere, so the greedy token
is always the first of the sorted top-k alternatives.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence

from twinkle_core.data_format import SamplingParams

__all__ = ["NEG_INF", "Choice", "choose", "log_softmax", "ranked", "top_alternatives"]

NEG_INF = float("-inf")


def log_softmax(logits: Sequence[float]) -> list[float]:
    """Log-probabilities of ``logits`` (``-inf`` entries stay ``-inf``)."""
    peak = max(logits)
    total = math.fsum(math.exp(x - peak) for x in logits if x != NEG_INF)
    norm = peak + math.log(total)
    return [x - norm for x in logits]


def ranked(values: Sequence[float]) -> list[int]:
    """Token ids, largest value first (ties: lower id first)."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))


def top_alternatives(logprobs: Sequence[float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely ``(token_id, logprob)`` pairs, sorted descending."""
    return [(i, logprobs[i]) for i in ranked(logprobs)[:k]]


def _penalise(logits: Sequence[float], seen: Iterable[int], penalty: float) -> list[float]:
    out = list(logits)
    for t in set(seen):
        if 0 <= t < len(out):
            out[t] = out[t] / penalty if out[t] > 0 else out[t] * penalty
    return out


def _truncate(logits: list[float], params: SamplingParams) -> list[float]:
    """Apply temperature, top-k, top-p and min-p; removed tokens become ``-inf``."""
    out = [x / params.temperature for x in logits]
    if params.top_k != -1 and params.top_k < len(out):
        keep = set(ranked(out)[: params.top_k])
        out = [x if i in keep else NEG_INF for i, x in enumerate(out)]
    if params.top_p < 1.0:
        probs = [math.exp(lp) for lp in log_softmax(out)]
        keep, mass = set(), 0.0
        # the smallest set of most likely tokens whose mass reaches top_p
        for i in ranked(probs):
            if mass >= params.top_p or probs[i] == 0.0:
                break
            keep.add(i)
            mass += probs[i]
        out = [x if i in keep else NEG_INF for i, x in enumerate(out)]
    if params.min_p > 0.0:
        probs = [math.exp(lp) for lp in log_softmax(out)]
        floor = params.min_p * max(probs)
        out = [x if probs[i] >= floor else NEG_INF for i, x in enumerate(out)]
    return out


class Choice:
    """One decoding step's outcome.

    Attributes:
        token: the chosen token id.
        logprob: its log-prob in the mode asked for.
        logprobs: the whole log-prob row in that mode (for top-k alternatives).
    """

    __slots__ = ("logprob", "logprobs", "token")

    def __init__(self, token: int, logprobs: list[float]) -> None:
        self.token = token
        self.logprobs = logprobs
        self.logprob = logprobs[token]


def choose(logits: Sequence[float], params: SamplingParams, context: Sequence[int], rng: random.Random) -> Choice:
    """Pick the next token from ``logits`` as ``params`` say.

    Args:
        logits: the model's raw logits.
        params: the sampling parameters.
        context: prompt + completion so far (for the repetition penalty).
        rng: the sequence's own random stream (unused when greedy).

    Returns:
        The token with its log-probs in ``params.logprobs_mode``.
    """
    scores = list(logits)
    if params.repetition_penalty != 1.0:
        scores = _penalise(scores, context, params.repetition_penalty)
    if params.greedy:
        processed = log_softmax(scores)
        token = ranked(scores)[0]
    else:
        processed = log_softmax(_truncate(scores, params))
        token = _draw(processed, rng.random())
    row = log_softmax(logits) if params.logprobs_mode == "raw" else processed
    return Choice(token, row)


def _draw(logprobs: Sequence[float], u: float) -> int:
    """Inverse-CDF sampling over token ids in order; ``u`` uniform in ``[0, 1)``."""
    cumulative, last = 0.0, 0
    for i, lp in enumerate(logprobs):
        if lp == NEG_INF:
            continue
        cumulative += math.exp(lp)
        last = i
        if u < cumulative:
            return i
    return last  # rounding left u above the total: the last possible token
