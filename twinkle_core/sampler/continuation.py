"""Continuing aborted sequences: what a continuation run needs, and how a sequence and its continuation join.

A sequence stopped part-way (``in_flight="keep"`` across a weight change, or
``resume()`` after an abort) is continued as a new prompt: the original prompt
(with its processed media, from the sequence's training feature) and its
partial tokens, one sample, what is left of its budget. The engine
keys its randomness on the sample index and the position, so a seeded
continuation draws what the uninterrupted sequence would have.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from twinkle_core.data_format import InputFeature, SampledSequence, SampleResponse, SamplingMask, SamplingParams
from twinkle_core.requests import CallFeed, Finished

__all__ = ["RunSpec", "merge_sequences", "plan_continuation"]


@attrs.frozen
class RunSpec:
    """A continuation run: per prompt, where its sequence sits in ``responses`` and how far it got.

    ``responses=None``: report each continuation as it is, under its prompt's
    index (a Ray replica running its share; the driver merges).
    """

    feed: CallFeed
    sample_base: list[int]
    generated: list[int]
    budgets: list[int]
    slots: list[tuple[int, int]]
    responses: list[SampleResponse] | None


def merge_sequences(
    prompt_ids: list[int],
    first: SampledSequence,
    rest: SampledSequence,
    *,
    params: SamplingParams,
    template: Any,
    make_sequence: Callable[..., SampledSequence],
) -> SampledSequence:
    """One sequence from a partial one and its continuation, as the uninterrupted sequence would be.

    Tokens, log-probs and masks are joined; ``version_spans`` says where the
    weights version changed. Routed experts keep ``first``'s rows (the
    weights that produced its tokens) and take ``rest``'s from the row that
    produced its first token on: the continuation's prefill routed the
    earlier tokens again, under its own weights, and those rows are dropped. A stop string that spans the join (begun by
    ``first``, completed by ``rest``) ends it there: the continuation's
    engine saw only its own tokens, so it could not. The text is the
    template's ``completion_text`` of the whole (``params``' text options);
    ``make_sequence`` builds the result (the sampler's, so the training
    feature is built as for any sequence).
    """
    keep, stop, stop_reason = len(rest.tokens), rest.stop, rest.stop_reason
    spanning = _stop_across(first.tokens, rest.tokens, params, template)
    if spanning is not None:
        keep, stop, stop_reason = spanning[1], spanning[0], "stop"
    tokens = [*first.tokens, *rest.tokens[:keep]]
    logprobs = None if first.logprobs is None else [*first.logprobs, *(rest.logprobs or [])[:keep]]
    top = None if first.top_logprobs is None else [*first.top_logprobs, *(rest.top_logprobs or [])[:keep]]
    spans = list(first.version_spans or ([(0, first.weights_version)] if first.tokens else []))
    if keep and (not spans or spans[-1][1] != rest.weights_version):
        spans.append((len(first.tokens), rest.weights_version))
    if not spans:
        spans = [(0, rest.weights_version)]
    mask = None
    if first.sampling_mask is not None and rest.sampling_mask is not None:
        mask = SamplingMask.from_rows(
            [first.sampling_mask.kept(i) for i in range(len(first.sampling_mask))]
            + [rest.sampling_mask.kept(i) for i in range(min(keep, len(rest.sampling_mask)))]
        )
    routes = None
    if first.routed_experts is not None and rest.routed_experts is not None:
        import numpy as np

        ahead = len(prompt_ids) + len(first.tokens) - 1  # rows first's forwards produced its tokens from
        routes = np.concatenate([first.routed_experts[:ahead], rest.routed_experts[ahead : ahead + keep]])
    merged = make_sequence(
        _prompt(first, prompt_ids),
        tokens,
        stop_reason=stop_reason,
        stop=stop,
        text=template.completion_text(tokens, params, stop),
        adapter_name=rest.adapter_name,
        logprobs=logprobs,
        top_logprobs=top,
        weights_version=min(v for _, v in spans),
        sampling_mask=mask,
    )
    return attrs.evolve(merged, version_spans=spans if len(spans) > 1 else None, routed_experts=routes)


def _prompt(sequence: SampledSequence, ids: list[int]) -> InputFeature | list[int]:
    """``ids`` with the media of ``sequence``'s prompt, if it had any: a continuation's prefill reads them again.

    Both what the torch engine's forward takes (the processed inputs) and what
    vLLM takes (the images they came from) go along.
    """
    feature = sequence.training_feature
    if feature is None or not feature.multimodal:
        return ids
    return InputFeature(input_ids=ids, multimodal=feature.multimodal, images=list(feature.images))


def _stop_across(first: list[int], rest: list[int], params: SamplingParams, template: Any) -> tuple[str, int] | None:
    """A stop string begun in ``first``'s text and completed by ``rest``'s: ``(stop, rest tokens up to it)``.

    Only the first tokens of ``rest`` can complete one (each adds at least a
    character, bar special tokens), so only they are decoded again. Stop
    strings do not count before ``params.min_tokens`` tokens, as in
    ``Template.completion_text``.
    """
    if not params.stop or not first or not rest:
        return None
    options = {
        "skip_special_tokens": params.skip_special_tokens,
        "spaces_between_special_tokens": params.spaces_between_special_tokens,
    }
    longest = max(len(s) for s in params.stop)
    before = template.decode(first, **options)
    counted = len(template.decode(first[: params.min_tokens], **options)) if params.min_tokens else 0
    # each stop string must begin in first's text and end past it (and past the first min_tokens tokens' text)
    starts = {s: max(0, len(before) - len(s) + 1, counted - len(s) + 1) for s in params.stop}
    for k in range(1, min(len(rest), 2 * longest + 8) + 1):
        text = template.decode([*first, *rest[:k]], **options)
        hits = [(pos, s) for s in params.stop if 0 <= (pos := text.find(s, starts[s])) < len(before)]
        if hits:
            return min(hits)[1], k
    return None


def plan_continuation(
    feed: CallFeed, responses: list[SampleResponse], params: SamplingParams, limit: int, *, emit_all: bool
) -> tuple[list[SampleResponse], tuple[list[InputFeature], SamplingParams, RunSpec] | None]:
    """What continuing every aborted sequence of ``responses`` runs: its prompts, parameters and spec.

    Returns copies of the responses (the continued sequences are merged into
    them later) and ``None`` when nothing is left to run. A sequence whose
    budget is spent, or whose prompt plus tokens exceed ``limit``, ends with
    ``stop_reason="length"`` here; those (and, with ``emit_all``, every
    finished one) are reported to ``feed`` at once.
    """
    todo: list[tuple[int, int]] = []
    prompts: list[InputFeature] = []
    base: list[int] = []
    generated: list[int] = []
    out = [attrs.evolve(r, sequences=list(r.sequences)) for r in responses]
    for i, response in enumerate(out):
        for j, seq in enumerate(response.sequences):
            if seq.stop_reason != "abort":
                if emit_all:
                    feed.emit(Finished(i, j, seq))
                continue
            left = params.max_tokens - len(seq.tokens)
            ids = [*response.prompt_token_ids, *seq.tokens]
            if left <= 0 or len(ids) > limit:
                done = attrs.evolve(seq, stop_reason="length")
                response.sequences[j] = done
                feed.emit(Finished(i, j, done))
                continue
            todo.append((i, j))
            prompt = _prompt(seq, ids)
            prompts.append(prompt if isinstance(prompt, InputFeature) else InputFeature(input_ids=prompt))
            base.append(j)
            generated.append(len(seq.tokens))
    if not todo:
        return out, None
    budgets = [params.max_tokens - g for g in generated]
    # the prompts are the (already truncated) prompts and their partial completions: never cut again
    cont_params = params.replace(
        max_tokens=max(budgets), num_samples=1, prompt_logprobs=None, truncate_prompt_tokens=None
    )
    return out, (prompts, cont_params, RunSpec(feed, base, generated, budgets, todo, out))
