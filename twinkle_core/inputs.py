"""What ``sample()`` accepts, normalised, and the checks every engine's inputs pass before any work.

The ``Sampler`` runs these for every engine, so the messages and the error
types are the same whichever engine (or Ray replica) serves the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs

from twinkle_core.data_format import InputFeature, SamplingParams, Trajectory
from twinkle_core.errors import InvalidInputError, InvalidSamplingParams, PromptTooLongError, UnsupportedFeatureError

__all__ = [
    "OnInvalid",
    "SampleInputs",
    "check_alternatives",
    "check_params",
    "check_prompt",
    "normalize_inputs",
    "prompt_too_long",
    "unpadded",
]

#: The most log-prob alternatives (``logprobs`` per generated token, ``prompt_logprobs`` per prompt token)
#: one run may return. Each is a Python pair of some 100-200 bytes in the result, so past this a valid
#: request (every sample of a large ``num_samples`` with the whole vocabulary at every token) would ask for
#: more memory than a machine has; vLLM bounds the same product with ``max_logprobs`` (20 by default).
MAX_ALTERNATIVES = 2**25

# A Sequence, not a list: list is invariant, so a caller's list[Trajectory] would not be a list of the union.
SampleInputs = InputFeature | Trajectory | dict[str, Any] | Sequence[InputFeature | Trajectory | dict[str, Any]]
OnInvalid = Literal["raise", "skip"]


def _one_input(item: Any, index: int) -> InputFeature | Trajectory:
    if isinstance(item, (InputFeature, Trajectory)):
        return item
    if isinstance(item, dict):
        record: type[Trajectory] | type[InputFeature] | None = (
            Trajectory if "messages" in item else InputFeature if "input_ids" in item else None
        )
        if record is not None:
            try:
                return record.from_dict(item)
            except InvalidInputError as exc:
                raise InvalidInputError(f"inputs[{index}] is invalid: {exc}") from None
        if "role" in item:
            raise InvalidInputError(
                f"inputs[{index}] is a single chat message ({item!r:.80}); wrap the conversation in"
                " Trajectory(messages=[...]) or {'messages': [...]}."
            )
    raise InvalidInputError(
        f"inputs[{index}]={item!r:.80} is invalid: expected an InputFeature, a Trajectory, or a dict with"
        " 'messages' or 'input_ids'."
    )


def normalize_inputs(inputs: SampleInputs, *, on_invalid: OnInvalid = "raise") -> list[Any]:
    """Turn what ``sample()`` accepts into a flat list (a single input becomes a list of one).

    With ``on_invalid="skip"``, an input that is not well-formed is kept in
    the list as its ``InvalidInputError`` (``sample()`` answers it with an error
    response) instead of raising.
    """
    if isinstance(inputs, (InputFeature, Trajectory, dict)):
        inputs = [inputs]
    if isinstance(inputs, Sequence) and not isinstance(inputs, str):
        out: list[Any] = []
        for i, x in enumerate(inputs):
            try:
                out.append(_one_input(x, i))
            except InvalidInputError as exc:
                if on_invalid == "raise":
                    raise
                out.append(exc)
        return out
    raise InvalidInputError(
        f"inputs={inputs!r:.80} is invalid: expected an InputFeature, a Trajectory, or a list of either."
    )


#: ``SamplingParams`` fields the sampler itself applies, for every engine (before the engine sees a prompt).
CORE_FIELDS = frozenset({"truncate_prompt_tokens"})


def check_params(params: SamplingParams, supported: frozenset[str], vocab: int | None, engine: str) -> None:
    """Refuse fields the engine does not honour (``supported``), and values beyond its vocabulary.

    ``engine`` names the engine in messages.
    """
    if params.min_tokens > params.max_tokens:
        raise InvalidSamplingParams(
            f"SamplingParams.min_tokens={params.min_tokens} is invalid: expected at most"
            f" max_tokens={params.max_tokens}.",
            field="min_tokens",
        )
    for field in attrs.fields(SamplingParams):
        value = getattr(params, field.name)
        if field.name not in supported and field.name not in CORE_FIELDS and value != field.default:
            raise UnsupportedFeatureError(
                f"SamplingParams.{field.name}={value!r} is not supported by the {engine} engine"
                f" (it honours: {', '.join(sorted(supported))}); leave it at its default"
                f" {field.default!r}."
            )
    if vocab is None:
        return
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > vocab:
            raise InvalidSamplingParams(
                f"SamplingParams.{name}={k} is invalid: expected at most the vocabulary size {vocab}.", field=name
            )
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("logit_bias", [t for t, _ in params.logit_bias]),
    ):
        beyond = [t for t in ids if t >= vocab]
        if beyond:
            raise InvalidSamplingParams(
                f"SamplingParams.{name} contains {beyond[0]}, outside the vocabulary [0, {vocab}).", field=name
            )


def check_alternatives(prompt_lengths: Sequence[int], params: SamplingParams, max_model_len: int) -> None:
    """Refuse a run whose log-prob alternatives would pass :data:`MAX_ALTERNATIVES` (at most: every completion
    at its full length), before any work.

    Raises:
        InvalidSamplingParams: naming ``logprobs`` or ``prompt_logprobs``, whichever asks for more.
    """
    generated = prompted = 0
    if params.logprobs and params.max_tokens:
        room = sum(max(0, min(params.max_tokens, max_model_len - n)) for n in prompt_lengths)
        generated = params.num_samples * room * params.logprobs
    if params.prompt_logprobs:
        prompted = sum(prompt_lengths) * params.prompt_logprobs
    if generated + prompted <= MAX_ALTERNATIVES:
        return
    field = "logprobs" if generated >= prompted else "prompt_logprobs"
    raise InvalidSamplingParams(
        f"SamplingParams.{field}={getattr(params, field)} asks for up to {generated + prompted:,} log-prob"
        f" alternatives in one run ({len(prompt_lengths)} prompt(s), num_samples={params.num_samples},"
        f" max_tokens={params.max_tokens}), more than the {MAX_ALTERNATIVES:,} a run may return (each holds memory"
        " until the call returns). Ask for fewer alternatives, samples or tokens, or split the call.",
        field=field,
    )


def truncate_prompt(feature: InputFeature, params: SamplingParams, limit: int) -> InputFeature:
    """``feature`` cut to its last ``params.truncate_prompt_tokens`` tokens (``-1``: to ``limit``)."""
    keep = params.truncate_prompt_tokens
    if keep is None:
        return feature
    keep = limit if keep == -1 else keep
    if len(feature.input_ids) <= keep:
        return feature
    return attrs.evolve(
        feature,
        input_ids=feature.input_ids[-keep:],
        attention_mask=None if feature.attention_mask is None else feature.attention_mask[-keep:],
        labels=None if feature.labels is None else feature.labels[-keep:],
    )


def unpadded(feature: InputFeature, index: int) -> InputFeature:
    """The prompt without the padding its ``attention_mask`` marks (0s before or after the 1s).

    A batch tokenized with padding (Hugging Face's ``padding=True``) gives
    features whose masks mark pads: the prompt is the unmasked run. A mask
    with other values, or 0s between 1s, has no meaning for a prompt and is
    refused, never ignored. ``index`` names the input in messages.

    Raises:
        InvalidInputError: such a mask.
    """
    mask = feature.attention_mask
    if mask is None or mask.count(1) == len(mask):  # the usual case, in one pass in C
        return feature
    if any(m not in (0, 1) for m in mask):
        raise InvalidInputError(
            f"inputs[{index}].attention_mask holds {next(m for m in mask if m not in (0, 1))!r}: expected 1 for the"
            " prompt's tokens and 0 for padding."
        )
    start = mask.index(1) if 1 in mask else len(mask)
    end = len(mask) - mask[::-1].index(1) if 1 in mask else start
    if 0 in mask[start:end]:
        raise InvalidInputError(
            f"inputs[{index}].attention_mask has 0 at position {start + mask[start:end].index(0)}, between the"
            " prompt's tokens: a prompt's mask may only mark padding before or after it."
        )
    labels = feature.labels[start:end] if feature.labels is not None else None
    return attrs.evolve(feature, input_ids=feature.input_ids[start:end], attention_mask=mask[start:end], labels=labels)


def check_prompt(feature: InputFeature, index: int, *, limit: int, vocab: int | None, max_model_len: int) -> None:
    """Refuse an empty prompt, a token id outside the vocabulary, or more than ``limit`` tokens.

    ``index`` names the input in messages (``inputs[index]``).
    """
    if not feature.input_ids:
        raise InvalidInputError(f"inputs[{index}] has no tokens: a prompt needs at least one.")
    if vocab is not None:
        bad = [t for t in feature.input_ids if t < 0 or t >= vocab]
        if bad:
            raise InvalidInputError(f"inputs[{index}] has token id {bad[0]} outside the vocabulary [0, {vocab}).")
    if len(feature.input_ids) > limit:
        raise prompt_too_long(index, len(feature.input_ids), limit, max_model_len)


def prompt_too_long(
    index: int, length: int, limit: int, max_model_len: int, *, at_least: bool = False
) -> PromptTooLongError:
    """The error for input ``index`` of ``length`` tokens (``at_least``: counted only that far) over ``limit``."""
    count = f"more than {limit} prompt tokens (at least {length}: a text this long is not tokenized whole)"
    return PromptTooLongError(
        f"inputs[{index}] has {count if at_least else f'{length} prompt tokens'} but the model accepts at most"
        f" {limit} (max_model_len={max_model_len}). Shorten it, or pass on_invalid='skip' to"
        " sample the other inputs.",
        index=index,
        length=length,
        limit=limit,
        at_least=at_least,
    )
