"""``SamplingParams``: what to generate and how, validated at construction."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import attrs

from twinkle_core.data_format._base import Record
from twinkle_core.data_format.structured import StructuredOutputs
from twinkle_core.errors import InvalidSamplingParams, UnknownSamplingParamError

__all__ = ["LogprobsMode", "SamplingParams", "bad_word_token_ids", "check_constraints", "resolve_params"]

LogprobsMode = Literal["processed", "raw"]

#: Bounds a value must stay within to pass validation (documented in docs/concepts.md). They keep a value
#: that passes from crashing an engine or exhausting memory: past them the arithmetic overflows (a
#: temperature of 1e-300 turns every logit into inf) or one call asks for more than any machine holds.
MIN_TEMPERATURE = 1e-3
MAX_TEMPERATURE = 1e4
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 1e2
MAX_TOKENS_LIMIT = 2**31 - 1
MAX_NUM_SAMPLES = 4096
#: vLLM's ranges: presence and frequency penalties in [-2, 2], a logit bias in [-100, 100].
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
#: Bad words, and the token sequences they become (vLLM's ``VLLM_MAX_NUM_BAD_WORDS``).
MAX_BAD_WORDS = 128
#: Stop strings per call: each is looked for after every token of every sequence.
MAX_STOP_STRINGS = 1024
#: Characters in one stop string or bad word: a marker, not a document (a bad word is tokenized before the call
#: runs, and a stop string longer than a context's text could never end a sequence).
MAX_WORD_CHARS = 16384
#: Characters of a refused value shown in an error message (a hostile value may be megabytes long).
_SHOWN_CHARS = 200


def _shown(value: Any) -> str:
    """``repr(value)``, cut to :data:`_SHOWN_CHARS` characters with its full length said."""
    text = repr(value)
    if len(text) <= _SHOWN_CHARS:
        return text
    return f"{text[:_SHOWN_CHARS]}... ({len(text):,} characters)"


def _bad(field: str, value: Any, accepted: str) -> InvalidSamplingParams:
    return InvalidSamplingParams(
        f"SamplingParams.{field}={_shown(value)} is invalid: expected {accepted}.", field=field
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_float(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Any:
    left, right = "(" if lo_open else "[", ")" if hi_open else "]"
    accepted = f"a number in {left}{lo:g}, {'inf' if hi == math.inf else f'{hi:g}'}{right}"

    def check(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if not _is_number(value):
            raise _bad(attribute.name, value, accepted)
        if value < lo or value > hi or (lo_open and value == lo) or (hi_open and value == hi):
            raise _bad(attribute.name, value, accepted)

    return check


def _check_int(lo: int, hi: int | None = None, *, optional: bool = False) -> Any:
    accepted = (f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]") + (
        " or None" if optional else ""
    )

    def check(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if not _is_int(value) or value < lo or (hi is not None and value > hi):
            raise _bad(attribute.name, value, accepted)

    return check


def _check_temperature(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not _is_number(value) or not (value == 0 or MIN_TEMPERATURE <= value <= MAX_TEMPERATURE):
        raise _bad(
            attribute.name,
            value,
            f"0 (greedy) or a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] (below {MIN_TEMPERATURE:g}"
            " sampling is greedy in all but name and the logits overflow; use 0)",
        )


def _check_top_k(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not _is_int(value) or value == 0 or value < -1:
        raise _bad(attribute.name, value, "-1 (disabled) or an integer >= 1")


def _check_seed(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not _is_int(value):
        raise _bad(attribute.name, value, "an integer or None")


def _encodable(text: str) -> bool:
    """Whether ``text`` is text a tokenizer can encode (a lone surrogate, ``"\\ud83d"``, is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _stop_strings(value: Any) -> tuple[str, ...]:
    # Validated while converting, so the error shows the value the user passed.
    items = (value,) if isinstance(value, str) else value
    accepted = (
        f"a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings (valid Unicode text)"
        f" of at most {MAX_WORD_CHARS} characters each"
    )
    if (
        not isinstance(items, (list, tuple))
        or len(items) > MAX_STOP_STRINGS
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_WORD_CHARS and _encodable(s) for s in items)
    ):
        raise _bad("stop", value, accepted)
    return tuple(items)


def _stop_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in value):
        raise _bad("stop_token_ids", value, "a list of token ids (integers >= 0)")
    return tuple(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (ids may be strings of digits, as JSON gives them) as sorted ``(id, bias)`` pairs."""
    accepted = f"a mapping of token ids (integers >= 0) to biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
    if value is None:
        return ()
    items = value.items() if isinstance(value, dict) else value
    try:
        pairs = [(k, b) for k, b in items]
    except (TypeError, ValueError):
        raise _bad("logit_bias", value, accepted) from None
    out: dict[int, float] = {}
    for key, bias in pairs:
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not _is_int(token) or token < 0 or not _is_number(bias) or abs(bias) > MAX_LOGIT_BIAS:
            raise _bad("logit_bias", value, accepted)
        if token in out:
            raise _bad("logit_bias", value, f"{accepted}, each id once")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def _allowed_ids(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value or not all(_is_int(t) and t >= 0 for t in value):
        raise _bad("allowed_token_ids", value, "None or a non-empty list of token ids (integers >= 0)")
    return tuple(dict.fromkeys(value))


def _bad_words(value: Any) -> tuple[str, ...]:
    # a word of only whitespace is refused: its stripped form, the one every engine bans, is empty
    accepted = (
        f"a list of at most {MAX_BAD_WORDS} strings with text other than whitespace (valid Unicode text) of at"
        f" most {MAX_WORD_CHARS} characters each"
    )
    items = (value,) if isinstance(value, str) else value
    if items is None:
        return ()
    if not isinstance(items, (list, tuple)) or not all(
        isinstance(w, str) and len(w) <= MAX_WORD_CHARS and w.strip() and _encodable(w) for w in items
    ):
        raise _bad("bad_words", value, accepted)
    words = tuple(dict.fromkeys(items))
    if len(words) > MAX_BAD_WORDS:
        raise _bad("bad_words", value, accepted)
    return words


def _check_truncate(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (not _is_int(value) or not (value >= 1 or value == -1)):
        raise _bad(attribute.name, value, "None, -1 (the longest prompt the engine takes) or an integer >= 1")


def _structured(value: Any) -> StructuredOutputs | None:
    return StructuredOutputs.coerce(value)


def _check_bool(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise _bad(attribute.name, value, "True or False")


def _check_mode(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in ("processed", "raw"):
        raise _bad(attribute.name, value, "'processed' or 'raw'")


@attrs.frozen(kw_only=True)
class SamplingParams(Record):
    """How to sample. Every field is checked when the object is built.

    Attributes:
        max_tokens: most tokens to generate per sequence (at most ``2**31 - 1``;
            a sequence also ends at the model's context window); 0 scores the
            prompt only (with ``prompt_logprobs``) and generates nothing. Alias
            (a keyword or a dict key): ``max_new_tokens``.
        temperature: 0 means greedy decoding; otherwise logits are divided by
            it, within ``[0.001, 10000]``.
        top_p: nucleus sampling mass in (0, 1]; 1 disables it.
        top_k: keep the k most likely tokens; -1 disables it.
        min_p: drop tokens whose probability is below ``min_p`` times the top
            token's; 0 disables it.
        repetition_penalty: > 1 discourages tokens already in the prompt or the
            completion (the CTRL / Hugging Face rule); 1 disables it. Within ``[0.01, 100]``.
        seed: makes the request reproducible whatever else is batched with it
            (any integer: engines reduce it to the width their generators take).
            With ``num_samples > 1`` the samples still differ from each other.
        stop: strings that end a sequence. The text is cut before the stop
            string; the tokens keep everything generated up to and including
            the token that completed it (what the model actually emitted).
        stop_token_ids: token ids that end a sequence (kept in ``tokens``).
        ignore_eos: keep generating past the model's end-of-sequence token.
        logprobs: ``None`` returns no log-probs; ``0`` returns the sampled
            token's log-prob at each position; ``k > 0`` also returns the top-k
            alternatives, sorted, in ``SampledSequence.top_logprobs``. A run
            returns at most ``2**25`` alternatives in all (``logprobs`` per
            generated token plus ``prompt_logprobs`` per prompt token, counting
            every sample at ``max_tokens``); a call past that is refused
            before any work (see ``twinkle_core.inputs.MAX_ALTERNATIVES``).
        prompt_logprobs: ``None`` returns none; ``k >= 0`` returns each prompt
            token's log-prob given the tokens before it (the first is ``None``),
            and with ``k > 0`` the top-k alternatives too.
        logprobs_mode: ``"processed"`` (default): log-probs under the
            distribution the token was drawn from, after repetition penalty,
            temperature, top-k, top-p and min-p (masked tokens are ``-inf``).
            Greedy decoding (temperature 0) applies the repetition penalty
            only. ``"raw"``: log-softmax of the model's raw logits.
        num_samples: completions per input, at most 4096. Alias: ``n``.
        return_sampling_mask: also return, per generated position, the token
            ids the sampler kept after the token constraints, top-k, top-p and
            min-p (the support the token was drawn from) in
            ``SampledSequence.sampling_mask``, so a trainer can recompute
            log-probs over exactly that support (see
            ``twinkle_core.rl.replay_logprobs``). Engines that cannot see the
            kept set refuse it with ``UnsupportedFeatureError``.
        return_routed_experts: also return, for every token forwarded (prompt
            and completion), the experts each mixture-of-experts layer routed
            it to, in ``SampledSequence.routed_experts`` (vLLM's
            ``routed_experts``), so a trainer can replay them
            (``twinkle_core.rl.RoutingReplay``). Engines that cannot record
            them, and models without MoE layers, refuse it with ``UnsupportedFeatureError``.
        presence_penalty: subtracted from the logit of every token already in
            the completion (vLLM / OpenAI); in ``[-2, 2]``, 0 disables it.
        frequency_penalty: subtracted from a token's logit once per time it is
            already in the completion; in ``[-2, 2]``, 0 disables it.
        min_tokens: the end-of-sequence and ``stop_token_ids`` tokens cannot be
            drawn, and stop strings do not end the sequence, until this many
            tokens are generated (counting any generated before a
            continuation); at most ``max_tokens`` (checked when sampling).
        logit_bias: ``{token id: bias}`` added to those logits before
            sampling, each bias in ``[-100, 100]`` (vLLM clamps larger ones;
            twinkle refuses them). JSON's string keys (``{"42": -5}``) are accepted.
        allowed_token_ids: only these tokens can be drawn (``None``: any).
        bad_words: token sequences the completion may not contain (vLLM's
            rule): each word is tokenized as written, and with a leading space
            when that gives a different first token and as many tokens; the
            last token of such a sequence cannot follow the rest of it (a
            one-token word is never drawn). Other tokenizations of the word
            can still appear (``"Paris"`` as two tokens bans neither a
            one-token ``" Paris"`` nor ``"paris"``). At most 128, and 128 token
            sequences.
        include_stop_str_in_output: keep the stop string at the end of the
            text (the tokens always keep it).
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: put spaces between special tokens in
            the text (with ``skip_special_tokens=False``; tokenizers that
            decode fast may ignore it).
        truncate_prompt_tokens: keep only the last k tokens of each prompt
            (``-1``: the longest prompt the engine takes), before the length
            checks; ``None`` keeps the whole prompt.
        structured_outputs: constrain the completion to a JSON schema, a
            regex, a choice or a grammar (a ``StructuredOutputs`` or its dict,
            vLLM's shape: ``{"json": schema}``, ``{"regex": "..."}``,
            ``{"choice": [...]}``, ``{"grammar": "..."}``,
            ``{"json_object": True}``); every engine compiles it with xgrammar.
    """

    _error = InvalidSamplingParams
    _unknown_error = UnknownSamplingParamError
    _aliases: ClassVar[dict[str, str]] = {"max_new_tokens": "max_tokens", "n": "num_samples"}

    max_tokens: int = attrs.field(default=256, validator=_check_int(0, MAX_TOKENS_LIMIT))
    temperature: float = attrs.field(default=1.0, validator=_check_temperature)
    top_p: float = attrs.field(default=1.0, validator=_check_float(0.0, 1.0, lo_open=True))
    top_k: int = attrs.field(default=-1, validator=_check_top_k)
    min_p: float = attrs.field(default=0.0, validator=_check_float(0.0, 1.0))
    repetition_penalty: float = attrs.field(
        default=1.0, validator=_check_float(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
    )
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_stop_strings)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_stop_ids)
    ignore_eos: bool = attrs.field(default=False, validator=_check_bool)
    logprobs: int | None = attrs.field(default=None, validator=_check_int(0, optional=True))
    prompt_logprobs: int | None = attrs.field(default=None, validator=_check_int(0, optional=True))
    logprobs_mode: LogprobsMode = attrs.field(default="processed", validator=_check_mode)
    num_samples: int = attrs.field(default=1, validator=_check_int(1, MAX_NUM_SAMPLES))
    return_sampling_mask: bool = attrs.field(default=False, validator=_check_bool)
    return_routed_experts: bool = attrs.field(default=False, validator=_check_bool)
    presence_penalty: float = attrs.field(default=0.0, validator=_check_float(-MAX_PENALTY, MAX_PENALTY))
    frequency_penalty: float = attrs.field(default=0.0, validator=_check_float(-MAX_PENALTY, MAX_PENALTY))
    min_tokens: int = attrs.field(default=0, validator=_check_int(0, MAX_TOKENS_LIMIT))
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_logit_bias)
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_allowed_ids)
    bad_words: tuple[str, ...] = attrs.field(default=(), converter=_bad_words)
    include_stop_str_in_output: bool = attrs.field(default=False, validator=_check_bool)
    skip_special_tokens: bool = attrs.field(default=True, validator=_check_bool)
    spaces_between_special_tokens: bool = attrs.field(default=True, validator=_check_bool)
    truncate_prompt_tokens: int | None = attrs.field(default=None, validator=_check_truncate)
    structured_outputs: StructuredOutputs | None = attrs.field(default=None, converter=_structured)

    @property
    def greedy(self) -> bool:
        """True when decoding is greedy (temperature 0)."""
        return self.temperature == 0.0

    def replace(self, **changes: Any) -> SamplingParams:
        """Return a copy with ``changes`` applied (and validated)."""
        return attrs.evolve(self, **self._check_keys(changes))

    @classmethod
    def coerce(cls, value: SamplingParams | dict[str, Any] | None) -> SamplingParams:
        """Accept a ``SamplingParams``, a plain dict or ``None`` (defaults)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        raise InvalidSamplingParams(
            f"sampling_params={_shown(value)} is invalid: expected a SamplingParams, a dict or None."
        )


def resolve_params(sampling_params: SamplingParams | dict[str, Any] | None, num_samples: int | None) -> SamplingParams:
    """Merge ``sampling_params`` and the ``num_samples`` keyword.

    Raises:
        InvalidSamplingParams: bad values, or ``num_samples`` given both ways with different values.
    """
    params = SamplingParams.coerce(sampling_params)
    if num_samples is None:
        return params
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise InvalidSamplingParams(
            f"num_samples={num_samples!r} is invalid: expected an integer >= 1.", field="num_samples"
        )
    explicit = sampling_params is not None and (
        (isinstance(sampling_params, dict) and ("num_samples" in sampling_params or "n" in sampling_params))
        or (isinstance(sampling_params, SamplingParams) and params.num_samples != 1)
    )
    if explicit and params.num_samples != num_samples:
        raise InvalidSamplingParams(
            f"num_samples={num_samples} conflicts with SamplingParams.num_samples={params.num_samples}:"
            " give it once, or give the same value.",
            field="num_samples",
        )
    return params.replace(num_samples=num_samples)


def bad_word_token_ids(tokenizer: Any, words: Sequence[str], vocab: int) -> list[list[int]]:
    """The token sequences ``SamplingParams.bad_words`` bans, by vLLM's rule (what every engine uses).

    Each word is tokenized as written (leading spaces stripped), and with one
    leading space when that gives a different first token and as many tokens
    (the word in the middle of a text).

    Raises:
        InvalidSamplingParams: a word that tokenizes to nothing, too many
            sequences, or a token id outside the vocabulary.
    """
    out: list[list[int]] = []
    for word in words:
        for prefix in ("", " "):
            ids = [int(t) for t in tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)]
            if not ids:
                if not prefix:
                    raise InvalidSamplingParams(
                        f"SamplingParams.bad_words={list(words)!r} is invalid: {word!r} tokenizes to no tokens.",
                        field="bad_words",
                    )
                continue
            if not prefix or (ids[0] != out[-1][0] and len(ids) == len(out[-1])):
                out.append(ids)
    if len(out) > MAX_BAD_WORDS:
        raise InvalidSamplingParams(
            f"SamplingParams.bad_words={list(words)!r} is invalid: it tokenizes to {len(out)} token sequences,"
            f" more than the {MAX_BAD_WORDS} accepted.",
            field="bad_words",
        )
    beyond = [t for ids in out for t in ids if not 0 <= t < vocab]
    if beyond:
        raise InvalidSamplingParams(
            f"SamplingParams.bad_words={list(words)!r} is invalid: token id {beyond[0]} is outside the"
            f" vocabulary [0, {vocab}).",
            field="bad_words",
        )
    return out


def check_constraints(params: SamplingParams, bad_words: Sequence[Sequence[int]], held_back: Sequence[int]) -> None:
    """Refuse token constraints that leave nothing to draw at the first position, before any work.

    ``bad_words`` are the token sequences of ``params.bad_words``
    (:func:`bad_word_token_ids`); ``held_back`` what ``min_tokens`` holds back
    (the engine's end-of-sequence ids and ``stop_token_ids``). Engines check
    every later position as they go.

    Raises:
        InvalidSamplingParams: every allowed token is removed.
    """
    if params.allowed_token_ids is None:
        return
    removed = {ids[0] for ids in bad_words if len(ids) == 1}
    if params.min_tokens:
        removed |= set(held_back)
    if not set(params.allowed_token_ids) - removed:
        raise InvalidSamplingParams(
            f"SamplingParams.allowed_token_ids={list(params.allowed_token_ids)!r} leaves no token to draw:"
            f" bad_words={list(params.bad_words)!r}"
            + (
                f" and min_tokens={params.min_tokens} (which holds back ids {sorted(held_back)})"
                if params.min_tokens
                else ""
            )
            + " remove every one of them. Allow a token they do not remove.",
            field="allowed_token_ids",
        )
