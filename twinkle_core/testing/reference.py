"""A reference of the processed distribution, in plain Python, for the conformance suite.

``docs/concepts.md`` defines what ``logprobs_mode="processed"`` means: the
log-probs of the distribution a token was actually drawn from, after, in this
order,

1. the token constraints: what the ``structured_outputs`` grammar cannot take
   next, tokens outside ``allowed_token_ids``, the last token
   of a bad word whose other tokens end the completion, and (while the
   completion is shorter than ``min_tokens``) the end-of-sequence and stop ids
   are removed;
2. ``logit_bias`` (added to the logits);
3. the repetition penalty (the CTRL / Hugging Face rule: a token already in the
   context has its logit divided by the penalty when positive, multiplied by it
   otherwise);
4. the frequency and presence penalties (subtracted: ``frequency_penalty``
   times the token's count in the completion, ``presence_penalty`` if it is in
   the completion at all); greedy decoding stops here;
5. temperature (logits divided by it);
6. top-k (the k largest logits survive);
7. top-p over what top-k left, renormalised (a token survives when the mass of
   the tokens more likely than it is below ``top_p``);
8. min-p (a token survives when its probability is at least ``min_p`` times the
   largest one's).

Removed tokens get ``-inf``. :func:`processed_logprobs` computes that from an
engine's *raw* log-probs over the whole vocabulary, so the suite can check an
engine's processed numbers against its own raw ones.

The logit offset. The repetition penalty acts on logits, and whether a logit
is positive cannot be read from log-probs: ``logprob = logit - c`` with ``c``
the log-sum-exp of the logits, unknown to the caller. The reference therefore
takes ``c`` as ``logit_offset``; every other step is invariant to it (the
bias and the other penalties add constants per token). The
suite does not guess ``c``: :func:`fit_logit_offset` solves for the one ``c``
that explains the engine's reported numbers (exactly, from one context token
and one other token with finite processed log-probs), and the suite then
requires *every* reported number to match the reference under that single
``c``. One scalar per position is fitted; the tens of numbers checked against
it are not. An engine that ignores the penalty is caught anyway: its
normaliser differs from the reference's unless every context logit is exactly
0, and the suite separately checks that the penalty changes the output.

Importing this module imports nothing heavy (no torch): it runs on any
engine's numbers as lists of floats.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from twinkle_core.data_format import SamplingParams

__all__ = [
    "NEG_INF",
    "Completion",
    "ambiguous_tokens",
    "fit_logit_offset",
    "fit_logit_offsets",
    "processed_logprobs",
    "reference_error",
]

NEG_INF = float("-inf")


def _log_softmax(scores: Sequence[float]) -> list[float]:
    finite = [x for x in scores if x != NEG_INF]
    peak = max(finite)
    norm = peak + math.log(math.fsum(math.exp(x - peak) for x in finite))
    return [x - norm if x != NEG_INF else NEG_INF for x in scores]


def _ids(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)


def _id_set(values: Iterable[int]) -> frozenset[int]:
    return frozenset(values)


def _sequences(words: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(w) for w in words)


@attrs.frozen
class Completion:
    """What the steps before the temperature read besides the logits, at one position.

    Attributes:
        tokens: the completion so far (every token generated before this position).
        held_back: the ids ``min_tokens`` removes while the completion is
            shorter (the engine's end-of-sequence ids and ``stop_token_ids``).
        bad_words: the token sequences of ``bad_words``
            (``twinkle_core.data_format.bad_word_token_ids``).
        grammar_allows: with ``structured_outputs``, the ids its grammar
            takes at this position (``None``: no grammar).
    """

    tokens: tuple[int, ...] = attrs.field(default=(), converter=_ids)
    held_back: frozenset[int] = attrs.field(default=frozenset(), converter=_id_set)
    bad_words: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_sequences)
    grammar_allows: frozenset[int] | None = None


def _removed(params: SamplingParams, vocab: int, completion: Completion) -> set[int]:
    """Step 1: the ids the constraints remove."""
    removed: set[int] = set()
    if completion.grammar_allows is not None:
        removed.update(t for t in range(vocab) if t not in completion.grammar_allows)
    if params.allowed_token_ids is not None:
        allowed = set(params.allowed_token_ids)
        removed.update(t for t in range(vocab) if t not in allowed)
    done = completion.tokens
    for word in completion.bad_words:
        *prefix, last = word
        if len(done) >= len(prefix) and list(done[len(done) - len(prefix) :]) == prefix:
            removed.add(last)
    if len(done) < params.min_tokens:
        held = set(completion.held_back)
        # vLLM's rule: with a grammar, min_tokens does not remove the stop ids where nothing else is left
        if completion.grammar_allows is None or len(removed | held) < vocab:
            removed |= held
    return {t for t in removed if 0 <= t < vocab}


def _shifts(params: SamplingParams, vocab: int, completion: Completion) -> tuple[list[float], list[float]]:
    """Per token: what step 2 adds before the repetition penalty, and what step 4 subtracts after it."""
    before = [0.0] * vocab
    for token, bias in params.logit_bias:
        if token < vocab:
            before[token] += bias
    after = [0.0] * vocab
    counts: dict[int, int] = {}
    for t in completion.tokens:
        counts[t] = counts.get(t, 0) + 1
    for t, n in counts.items():
        if 0 <= t < vocab:
            after[t] = params.frequency_penalty * n + params.presence_penalty
    return before, after


def _penalised(
    raw_logprobs: Sequence[float],
    context: Iterable[int],
    params: SamplingParams,
    offset: float,
    completion: Completion = Completion(),
) -> list[float]:
    """Steps 1 to 4: the logits greedy decoding takes the argmax of."""
    vocab = len(raw_logprobs)
    before, after = _shifts(params, vocab, completion)
    logits = [lp + offset + b for lp, b in zip(raw_logprobs, before)]
    for t in _removed(params, vocab, completion):
        logits[t] = NEG_INF
    penalty = params.repetition_penalty
    if penalty != 1.0:
        for t in set(context):
            if 0 <= t < vocab and logits[t] != NEG_INF:
                z = logits[t]
                logits[t] = z / penalty if z > 0 else z * penalty
    return [z - a if z != NEG_INF else NEG_INF for z, a in zip(logits, after)]


def _truncated(scores: list[float], top_k: int, top_p: float, min_p: float) -> list[float]:
    """Temperature-scaled ``scores`` with top-k, top-p and min-p applied (``-inf`` = removed)."""
    vocab = len(scores)
    order = sorted(range(vocab), key=lambda i: -scores[i])
    keep = [True] * vocab
    if 0 < top_k < vocab:
        for i in order[top_k:]:
            keep[i] = False
    if top_p < 1.0:
        survivors = [scores[i] if keep[i] else NEG_INF for i in range(vocab)]
        probs = [math.exp(x) for x in _log_softmax(survivors)]
        above = 0.0  # mass of the tokens ranked before this one
        for i in order:
            if not keep[i]:
                continue
            if above >= top_p:
                keep[i] = False
            above += probs[i]
    if min_p > 0.0:
        survivors = [scores[i] if keep[i] else NEG_INF for i in range(vocab)]
        probs = [math.exp(x) for x in _log_softmax(survivors)]
        floor = min_p * max(probs)
        for i in range(vocab):
            if keep[i] and probs[i] < floor:
                keep[i] = False
    return [scores[i] if keep[i] else NEG_INF for i in range(vocab)]


def processed_logprobs(
    raw_logprobs: Sequence[float],
    params: SamplingParams,
    context: Iterable[int] = (),
    *,
    logit_offset: float = 0.0,
    completion: Completion = Completion(),
) -> list[float]:
    """The processed log-probs over the whole vocabulary at one position.

    Args:
        raw_logprobs: the log-softmax of the model's logits at this position,
            one entry per token id (the whole vocabulary).
        params: the request's sampling parameters (only the sampling fields
            matter: temperature, top_k, top_p, min_p, repetition_penalty).
        context: the tokens before this position (prompt and completion so far),
            for the repetition penalty.
        logit_offset: ``c`` in ``logit = logprob + c`` (see the module docstring);
            it matters only with a repetition penalty.
        completion: the completion so far and what the constraints need (see
            :class:`Completion`); the default is an empty completion.

    Returns:
        One log-prob per token id; ``-inf`` for the tokens the processing removes.
    """
    scores = _penalised(raw_logprobs, context, params, logit_offset, completion)
    if params.greedy:
        return _log_softmax(scores)
    scores = [x / params.temperature for x in scores]
    return _log_softmax(_truncated(scores, params.top_k, params.top_p, params.min_p))


def ambiguous_tokens(
    raw_logprobs: Sequence[float],
    params: SamplingParams,
    context: Iterable[int] = (),
    *,
    logit_offset: float = 0.0,
    completion: Completion = Completion(),
    slack: float = 1e-4,
) -> frozenset[int]:
    """Tokens whose survival flips when the top-p and min-p thresholds move by ``slack``.

    Float rounding differs between engines and this reference; a token that
    sits on a threshold may go either way, and the suite does not hold it
    against an engine.
    """
    if params.greedy or (params.top_p >= 1.0 and params.min_p <= 0.0):
        return frozenset()
    context = list(context)
    scores = _penalised(raw_logprobs, context, params, logit_offset, completion)
    scores = [x / params.temperature for x in scores]
    # Fewer survivors: a smaller nucleus, a higher floor; more survivors: the opposite.
    top_p, min_p = params.top_p, params.min_p
    tight = _truncated(
        scores,
        params.top_k,
        top_p if top_p >= 1.0 else max(top_p - slack, slack),
        min(min_p + slack, 1.0) if min_p else 0.0,
    )
    loose = _truncated(scores, params.top_k, min(top_p + slack, 1.0), max(min_p - slack, 0.0))
    return frozenset(i for i, (a, b) in enumerate(zip(tight, loose)) if (a == NEG_INF) != (b == NEG_INF))


def reference_error(reference: Sequence[float], observed: Mapping[int, float]) -> float:
    """The largest disagreement between ``reference`` and ``observed`` (``inf`` when masking differs)."""
    worst = 0.0
    for token, value in observed.items():
        ref = reference[token]
        if (ref == NEG_INF) != (value == NEG_INF):
            return math.inf
        if ref != NEG_INF:
            worst = max(worst, abs(ref - value))
    return worst


def fit_logit_offset(
    raw_logprobs: Sequence[float],
    params: SamplingParams,
    context: Iterable[int],
    observed: Mapping[int, float],
    completion: Completion = Completion(),
) -> float:
    """The logit offset ``c`` under which the reference best explains ``observed`` (see :func:`fit_logit_offsets`)."""
    return fit_logit_offsets(raw_logprobs, params, context, observed, completion)[0]


def fit_logit_offsets(
    raw_logprobs: Sequence[float],
    params: SamplingParams,
    context: Iterable[int],
    observed: Mapping[int, float],
    completion: Completion = Completion(),
    tolerance: float = 0.0,
    top_values: Sequence[float] = (),
) -> list[float]:
    """The logit offsets ``c`` under which the reference explains ``observed``, best first.

    Several may explain the observed tokens equally (within ``tolerance``)
    while placing an unobserved context token on either side of zero, where
    the repetition penalty acts differently: the caller may try each. At
    least the best one is returned.

    Between two tokens the engine kept, the processed log-probs differ by the
    difference of their processed logits over the temperature, whatever the
    normaliser; for a context token that difference is linear in ``c`` once
    the sign of its logit is fixed. So each pair of observed tokens whose
    penalties differ gives ``c`` exactly; the candidate explaining all
    observations best wins. Where the observed tokens share one penalty,
    ``c`` only moves the normaliser: it is also searched between the points
    where a context logit changes sign.

    Args:
        raw_logprobs: raw log-probs over the whole vocabulary at this position.
        params: the request's sampling parameters.
        context: the tokens before this position.
        observed: the engine's processed log-probs by token id (sampled token
            and top alternatives).
        completion: as for :func:`processed_logprobs`.

        tolerance: how far from ``observed`` a candidate may be and still be returned.
        top_values: the engine's top-k log-probs, sorted: a candidate must
            also reproduce them (where no observed token is in the context,
            only they tell which context tokens the penalty raised or lowered).

    Returns:
        The candidates for ``c``; ``[0.0]`` when there is no repetition penalty (nothing depends on it).
    """
    penalty = params.repetition_penalty
    if penalty == 1.0:
        return [0.0]
    vocab = len(raw_logprobs)
    removed = _removed(params, vocab, completion)
    seen = {t for t in context if 0 <= t < vocab and t not in removed}
    temperature = 1.0 if params.greedy else params.temperature
    before, after = _shifts(params, vocab, completion)
    # the logit before the penalty is lp + before + c; the penalty's result loses `after`
    shifted = [lp + b for lp, b in zip(raw_logprobs, before)]

    def error(c: float) -> float:
        ref = processed_logprobs(raw_logprobs, params, seen, logit_offset=c, completion=completion)
        worst = reference_error(ref, observed)
        if top_values:
            want = sorted(ref, reverse=True)[: len(top_values)]
            worst = max(worst, reference_error(want, dict(enumerate(top_values))))
        return worst

    def factors(token: int) -> list[tuple[float, int]]:
        # (multiplier of the logit, required sign of the logit: 1 positive, -1 not, 0 any)
        return [(1.0 / penalty, 1), (penalty, -1)] if token in seen else [(1.0, 0)]

    finite = sorted((v, t) for t, v in observed.items() if v != NEG_INF)
    candidates: list[float] = []
    if finite:
        anchor_value, anchor = finite[-1]
        for value, token in finite[:-1]:
            # = s_i (lp_i + c) - after_i - s_a (lp_a + c) + after_a, lp counting the bias
            d = (value - anchor_value) * temperature + after[token] - after[anchor]
            lp_i, lp_a = shifted[token], shifted[anchor]
            for s_i, sign_i in factors(token):
                for s_a, sign_a in factors(anchor):
                    if s_i == s_a:
                        continue
                    c = (d - s_i * lp_i + s_a * lp_a) / (s_i - s_a)
                    if sign_i * (lp_i + c) >= -1e-9 and sign_a * (lp_a + c) >= -1e-9:
                        candidates.append(c)
    # A pair pins c only if both tokens sit where the sign guess says; when every observed
    # token shares one penalty, c only moves the normaliser. So also search the stretches
    # where no context logit changes sign: their middles first, then refine the best few
    # (inside a stretch the error is smooth in c).
    breaks = sorted({-shifted[t] for t in seen})
    if not breaks:
        return [0.0]
    edges = [breaks[0] - 10.0, *breaks, breaks[-1] + 10.0]
    stretches = sorted(itertools.pairwise(edges), key=lambda pair: error((pair[0] + pair[1]) / 2))
    for lo, hi in stretches[:3]:
        for _ in range(40):
            m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            if error(m1) <= error(m2):
                hi = m2
            else:
                lo = m1
        candidates.append((lo + hi) / 2)
    ranked = sorted(set(candidates), key=error)
    close = [c for c in ranked if error(c) <= tolerance]
    return close or ranked[:1]
