"""twinkle ``SamplingParams`` -> vLLM ``SamplingParams``, and vLLM outputs back.

Every twinkle field is mapped; what vLLM cannot do natively is emulated here
(and only where the emulation is exact), else refused with a typed error:

* ``temperature`` outside vLLM's ``[0.01, 2]``: run at 1 and let
  :class:`twinkle_vllm._logits.TemperatureProcessor` divide the logits.
* ``min_p`` with ``top_p``: vLLM applies min-p before top-p, twinkle after it
  (the nucleus differs); the processor then does temperature, top-k, top-p and
  min-p itself, in twinkle's order, with vLLM's own switched off.
* ``num_samples > 1`` with greedy decoding (vLLM refuses ``n > 1`` there) or
  when scoring: run once and copy; such samples are identical by definition.
* ``max_tokens=0`` (scoring): vLLM needs at least one step, so it generates
  one token that is dropped.
* ``logprobs_mode="raw"``: the engine runs with processed log-probs; a raw
  request re-scores its completions (prompt + completion as a prompt, whose
  prompt log-probs are the raw log-softmax at each position).
"""

from __future__ import annotations

import copy
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

from twinkle_core.data_format import SamplingParams
from twinkle_core.data_format.structured import no_token_left
from twinkle_core.engine import EngineRun
from twinkle_core.errors import InvalidSamplingParams, NumericalError, TwinkleError, UnsupportedFeatureError
from twinkle_vllm._logits import EXTRA_ARG

__all__ = [
    "SEED_MODULUS",
    "Plan",
    "flat_entries",
    "make_plan",
    "report_completion",
    "report_final",
    "scoring_params",
    "vllm_seed",
]

#: vLLM gives the i-th of n samples ``seed + i``; keep that inside 64 bits.
SEED_MODULUS = 1 << 62


def vllm_seed(seed: int) -> int:
    """The seed vLLM gets for twinkle's ``seed``: a hash of it, below :data:`SEED_MODULUS`.

    vLLM seeds sample ``i`` with ``seed + i``, so passing the seed through
    would give sample ``i`` of seed ``s`` the very draws of sample 0 of seed
    ``s + i``: an RL loop seeding each step with its number would train on
    repeated samples. Hashed, two seeds' runs of ``n`` overlap only by chance
    (about ``n / 2**62``).
    """
    raw = seed.to_bytes(seed.bit_length() // 8 + 1, "little", signed=True)  # any integer, however wide
    digest = hashlib.blake2b(raw, digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_MODULUS


VLLM_MIN_TEMPERATURE = 0.01
VLLM_MAX_TEMPERATURE = 2.0


@dataclass
class Plan:
    """How one ``sample()`` call runs on vLLM.

    Attributes:
        params: the user's parameters.
        vllm: keyword arguments of ``vllm.SamplingParams`` (``max_tokens`` may be
            lowered per prompt, see :meth:`for_prompt`).
        copies: how many times each vLLM sample is repeated (greedy ``num_samples``).
        scoring: ``max_tokens == 0``: drop the one generated token.
        rescore_raw: re-score completions for raw log-probs.
    """

    params: SamplingParams
    vllm: dict[str, Any] = field(default_factory=dict)
    copies: int = 1
    scoring: bool = False
    rescore_raw: bool = False

    def for_prompt(self, prompt_len: int, max_model_len: int) -> dict[str, Any] | None:
        """The vLLM keyword arguments for one prompt, or ``None`` if nothing can be generated.

        Raw re-scoring submits prompt + completion as one prompt, which vLLM
        accepts only up to ``max_model_len - 1`` tokens; raw requests therefore
        stop one token before the context window (``stop_reason="length"``).
        """
        if not self.rescore_raw:
            return self.vllm
        room = max_model_len - 1 - prompt_len
        if room <= 0:
            return None
        if self.vllm["max_tokens"] <= room:
            return self.vllm
        return {**self.vllm, "max_tokens": room}


def make_plan(
    params: SamplingParams,
    *,
    max_logprobs: int,
    vocab_size: int,
    temperature_processor: bool,
    seeds_crash: str = "",
) -> Plan:
    """Map ``params`` onto vLLM, or raise if the engine cannot honour them.

    Raises:
        InvalidSamplingParams: a stop token id outside the vocabulary.
        UnsupportedFeatureError: more log-probs than the engine's ``max_logprobs``,
            a temperature vLLM cannot reach when the temperature processor is off,
            or a seed where ``seeds_crash`` says why the engine cannot take one.
    """
    _refuse(params, max_logprobs=max_logprobs, vocab_size=vocab_size, seeds_crash=seeds_crash)
    plan = Plan(params=params)
    greedy = params.greedy
    raw = params.logprobs_mode == "raw"
    plan.scoring = params.max_tokens == 0
    plan.rescore_raw = raw and params.logprobs is not None and not plan.scoring
    # Greedy samples are identical, and scoring generates nothing: one request, copied.
    single = greedy or plan.scoring
    plan.copies = params.num_samples if single else 1

    kw: dict[str, Any] = {
        "n": 1 if single else params.num_samples,
        "top_p": params.top_p,
        # a top-k of the whole vocabulary or more keeps every token: off (vLLM overflows on 2**64)
        "top_k": params.top_k if 0 < params.top_k < vocab_size else 0,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "seed": None if params.seed is None else vllm_seed(params.seed),
        "stop": list(params.stop),
        "stop_token_ids": list(params.stop_token_ids),
        # Under a constraint an end token is allowed only once it is complete, and then ends the completion
        # (twinkle's rule; vLLM with ignore_eos would sample on past it): ignore_eos changes nothing else.
        "ignore_eos": params.ignore_eos and params.structured_outputs is None,
        "max_tokens": max(params.max_tokens, 1),
        # Always the drawn token's at least: from NaN logits vLLM draws token 0, and only its NaN log-prob tells.
        # Raw log-probs come from re-scoring; the sampling request needs no more than that one.
        "logprobs": 0 if plan.rescore_raw or params.logprobs is None else params.logprobs,
        "prompt_logprobs": params.prompt_logprobs,
        "flat_logprobs": True,
        # Text is decoded once by the template; vLLM needs it only to match stop strings.
        "detokenize": bool(params.stop),
        "include_stop_str_in_output": False,  # the text is cut here, the tokens are the same
        "skip_special_tokens": params.skip_special_tokens,
        "spaces_between_special_tokens": params.spaces_between_special_tokens,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "min_tokens": params.min_tokens,  # per prompt: less what a continuation generated before
        "logit_bias": dict(params.logit_bias) or None,
        "allowed_token_ids": list(params.allowed_token_ids) if params.allowed_token_ids is not None else None,
        "bad_words": list(params.bad_words) or None,
        # vLLM's StructuredOutputsParams, built where vLLM is imported (RunRequests.request)
        "structured_outputs": params.structured_outputs.to_vllm() if params.structured_outputs is not None else None,
    }
    _set_temperature(kw, params, temperature_processor=temperature_processor)
    plan.vllm = kw
    return plan


def _refuse(params: SamplingParams, *, max_logprobs: int, vocab_size: int, seeds_crash: str) -> None:
    """Raise if the engine cannot honour ``params`` (see :func:`make_plan`)."""
    if params.seed is not None and seeds_crash:
        raise UnsupportedFeatureError(f"SamplingParams.seed={params.seed} cannot be used here: {seeds_crash}")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > max_logprobs:
            raise UnsupportedFeatureError(
                f"SamplingParams.{name}={k} exceeds this engine's max_logprobs={max_logprobs}:"
                f" start the sampler with engine_args={{'max_logprobs': {k}}} (or more)."
            )
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise InvalidSamplingParams(
            f"SamplingParams.stop_token_ids={list(params.stop_token_ids)!r} is invalid: token id {bad[0]} is"
            f" outside the vocabulary [0, {vocab_size}).",
            field="stop_token_ids",
        )


def _set_temperature(kw: dict[str, Any], params: SamplingParams, *, temperature_processor: bool) -> None:
    """Put the temperature into ``kw``: vLLM's own where it can, else twinkle's processor (then min-p too)."""
    greedy = params.greedy
    temperature = params.temperature
    reorder = not greedy and params.min_p > 0.0 and params.top_p < 1.0
    in_range = VLLM_MIN_TEMPERATURE <= temperature <= VLLM_MAX_TEMPERATURE
    if greedy or (in_range and not reorder):
        kw["temperature"] = temperature
    elif temperature_processor:
        kw["temperature"] = 1.0
        kw["min_p"] = 0.0  # applied by the processor, after the real temperature
        kw["extra_args"] = {EXTRA_ARG: [temperature, params.min_p]}
        if reorder:  # top-k and top-p too, so that min-p comes after them
            top_k = kw["top_k"]
            kw["top_k"], kw["top_p"] = 0, 1.0
            kw["extra_args"][EXTRA_ARG] += [top_k, params.top_p]
    elif in_range:  # only the order of min-p needs the processor
        raise UnsupportedFeatureError(
            f"SamplingParams.min_p={params.min_p!r} with top_p={params.top_p!r} needs twinkle's logits"
            " processor (vLLM applies min-p before top-p), which is off here"
            " (speculative decoding disables custom logits processors): drop one of them."
        )
    else:
        raise UnsupportedFeatureError(
            f"SamplingParams.temperature={temperature!r} is outside vLLM's range"
            f" [{VLLM_MIN_TEMPERATURE}, {VLLM_MAX_TEMPERATURE}] and twinkle's temperature processor is off"
            " (speculative decoding disables custom logits processors)."
        )


def scoring_params(num_logprobs: int) -> dict[str, Any]:
    """vLLM keyword arguments of a raw re-scoring request (prompt log-probs only)."""
    return {
        "n": 1,
        "temperature": 0.0,
        "max_tokens": 1,
        "prompt_logprobs": num_logprobs,
        "flat_logprobs": True,
        "detokenize": False,
    }


def flat_entries(
    flat: Any, positions: range, want_top: bool
) -> tuple[list[float], list[list[tuple[int, float]]] | None, list[int]]:
    """Read positions of a vLLM ``FlatLogprobs``.

    vLLM stores, per position, the chosen token first (sampled or prompt token)
    and then the top-k in descending order; the chosen token's entry is there
    whether or not it is in the top k.

    Returns:
        The chosen tokens' log-probs, the top-k ``(id, logprob)`` lists (or
        ``None`` when ``want_top`` is false), and the chosen token ids.
    """
    starts, ends = flat.start_indices, flat.end_indices
    ids, values = flat.token_ids, flat.logprobs
    chosen: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    tokens: list[int] = []
    for i in positions:
        s, e = starts[i], ends[i]
        chosen.append(values[s])
        tokens.append(ids[s])
        if want_top:
            tops.append([(ids[j], values[j]) for j in range(s + 1, e)])
    return chosen, (tops if want_top else None), tokens


def _drawn_nan(flat: Any, positions: range) -> bool:
    """Whether the chosen token's log-prob is NaN at any of ``positions`` of a vLLM ``FlatLogprobs``."""
    values, starts = flat.logprobs, flat.start_indices
    return any(math.isnan(values[starts[i]]) for i in positions)


# -- vLLM outputs -> twinkle sequences ------------------------------------------------------
def report_final(
    run: EngineRun, p: int, prompt_ids: list[int], result: tuple[Any, list[Any] | None], plan: Plan
) -> None:
    """Report what prompt ``p``'s final vLLM output adds: completions not reported as they ended, and scores."""
    params = plan.params
    final, rescored = result
    if final is None:  # a raw request whose prompt leaves no room to generate (see Plan.for_prompt)
        run.report_empty(p, "length")
        return
    if final.prompt_logprobs is not None and _drawn_nan(final.prompt_logprobs, range(1, len(prompt_ids))):
        # a prompt token's NaN log-prob: NaN logits, as for a drawn token
        raise NumericalError.in_logits(run.adapter_name)
    for index, output in enumerate(final.outputs):
        if not run.reported(p, output.index * plan.copies):
            raw = rescored[index] if rescored is not None else None
            report_completion(run, p, list(prompt_ids), output, raw, plan)
    if params.prompt_logprobs is not None and final.prompt_logprobs is not None:
        values, tops, _ = flat_entries(final.prompt_logprobs, range(1, len(prompt_ids)), params.prompt_logprobs > 0)
        run.report_scores(p, [None, *values], [None, *tops] if tops is not None else None)


def report_completion(run: EngineRun, p: int, prompt_ids: list[int], output: Any, raw: Any, plan: Plan) -> None:
    """Report one finished vLLM completion of prompt ``p`` (``raw``: its re-score, for raw log-probs).

    A completion vLLM generated once for several samples (``plan.copies``) is reported as each of them.
    """
    params = plan.params
    tokens = [] if plan.scoring else list(output.token_ids)
    reason = "length" if plan.scoring else (output.finish_reason or "length")
    if reason not in ("stop", "length", "abort"):
        if params.structured_outputs is not None:  # vLLM ends a request whose grammar admits no next token
            raise no_token_left(params.structured_outputs, len(output.token_ids))
        raise TwinkleError(f"vLLM ended a request with finish_reason={reason!r}.")
    stop: str | int | None = None
    if reason == "stop":
        # vLLM reports None for the model's own EOS; name the token instead.
        stop = output.stop_reason if output.stop_reason is not None else (tokens[-1] if tokens else None)
    # A drawn token has a probability: a NaN log-prob means the logits were NaN, and vLLM drew token 0 from them.
    # Every request asks for the drawn tokens' (make_plan), so this holds whether or not the call wants log-probs,
    # and for the token a scoring request draws and drops.
    if output.logprobs is not None and _drawn_nan(output.logprobs, range(len(output.token_ids))):
        raise NumericalError.in_logits(run.adapter_name)
    logprobs: list[float] | None = None
    top: list[list[tuple[int, float]]] | None = None
    if params.logprobs is not None:
        want_top = params.logprobs > 0
        if plan.scoring:
            logprobs, top = [], ([] if want_top else None)
        else:
            flat = raw.prompt_logprobs if raw is not None else output.logprobs
            positions = range(len(prompt_ids), len(prompt_ids) + len(tokens)) if raw is not None else range(len(tokens))
            logprobs, top, _ = flat_entries(flat, positions, want_top)
    first = output.index * plan.copies
    sequence = run.report(p, first, tokens, stop_reason=reason, stop=stop, logprobs=logprobs, top_logprobs=top)
    for s in range(first + 1, first + plan.copies):  # each sample its own object
        run.finish(p, s, copy.deepcopy(sequence))
