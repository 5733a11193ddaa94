"""A reference of the processed distribution, in plain Python, for the conformance suite.

``docs/concepts.md`` defines what ``logprobs_mode="processed"`` means: the
log-probs of the distribution a token was actually drawn from, after, in this
order,

1. the repetition penalty (the CTRL / Hugging Face rule: a token already in the
   context has its logit divided by the penalty when positive, multiplied by it
   otherwise); greedy decoding stops here;
2. temperature (logits divided by it);
3. top-k (the k largest logits survive);
4. top-p over what top-k left, renormalised (a token survives when the mass of
   the tokens more likely than it is below ``top_p``);
5. min-p (a token survives when its probability is at least ``min_p`` times the
   largest one's).

Removed tokens get ``-inf``. :func:`processed_logprobs` computes that from an
engine's *raw* log-probs over the whole vocabulary, so the suite can check an
engine's processed numbers against its own raw ones.

The logit offset. The repetition penalty acts on logits, and whether a logit
is positive cannot be read from log-probs: ``logprob = logit - c`` with ``c``
the log-sum-exp of the logits, unknown to the caller. The reference therefore
takes ``c`` as ``logit_offset``; every other step is invariant to it. The
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

from twinkle_core.data_format import SamplingParams

__all__ = ["NEG_INF", "ambiguous_tokens", "fit_logit_offset", "processed_logprobs", "reference_error"]

NEG_INF = float("-inf")


def _log_softmax(scores: Sequence[float]) -> list[float]:
    finite = [x for x in scores if x != NEG_INF]
    peak = max(finite)
    norm = peak + math.log(math.fsum(math.exp(x - peak) for x in finite))
    return [x - norm if x != NEG_INF else NEG_INF for x in scores]


def _penalised(raw_logprobs: Sequence[float], context: Iterable[int], penalty: float, offset: float) -> list[float]:
    logits = [lp + offset for lp in raw_logprobs]
    if penalty != 1.0:
        for t in set(context):
            if 0 <= t < len(logits):
                z = logits[t]
                logits[t] = z / penalty if z > 0 else z * penalty
    return logits


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

    Returns:
        One log-prob per token id; ``-inf`` for the tokens the processing removes.
    """
    scores = _penalised(raw_logprobs, context, params.repetition_penalty, logit_offset)
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
    scores = _penalised(raw_logprobs, context, params.repetition_penalty, logit_offset)
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
) -> float:
    """The logit offset ``c`` under which the reference best explains ``observed``.

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

    Returns:
        ``c``; 0 when there is no repetition penalty (nothing depends on it).
    """
    penalty = params.repetition_penalty
    if penalty == 1.0:
        return 0.0
    seen = {t for t in context if 0 <= t < len(raw_logprobs)}
    temperature = 1.0 if params.greedy else params.temperature

    def error(c: float) -> float:
        return reference_error(processed_logprobs(raw_logprobs, params, seen, logit_offset=c), observed)

    def factors(token: int) -> list[tuple[float, int]]:
        # (multiplier of the logit, required sign of the logit: 1 positive, -1 not, 0 any)
        return [(1.0 / penalty, 1), (penalty, -1)] if token in seen else [(1.0, 0)]

    finite = sorted((v, t) for t, v in observed.items() if v != NEG_INF)
    candidates: list[float] = []
    if finite:
        anchor_value, anchor = finite[-1]
        for value, token in finite[:-1]:
            d = (value - anchor_value) * temperature  # = s_i (lp_i + c) - s_a (lp_a + c)
            lp_i, lp_a = raw_logprobs[token], raw_logprobs[anchor]
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
    breaks = sorted({-raw_logprobs[t] for t in seen})
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
    return min(candidates, key=error)
