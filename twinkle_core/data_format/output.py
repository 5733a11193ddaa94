"""What ``sample()`` returns: ``SampledSequence`` and ``SampleResponse``."""

from __future__ import annotations

import itertools
from typing import Any, Literal

import attrs

from twinkle_core.data_format._base import Record
from twinkle_core.data_format.feature import InputFeature
from twinkle_core.data_format.routes import to_routes
from twinkle_core.errors import InvalidInputError

__all__ = ["SampleResponse", "SampledSequence", "SamplingMask", "StopReason", "TopLogprobs"]

StopReason = Literal["stop", "length", "abort"]
#: Per position, the top-k ``(token_id, logprob)`` pairs, most likely first.
TopLogprobs = list[list[tuple[int, float]]]
#: Per prompt position, the top-k pairs; ``None`` at the first position.
PromptTopLogprobs = list[list[tuple[int, float]] | None]


def _to_feature(value: Any) -> Any:
    return InputFeature.from_dict(value) if isinstance(value, dict) else value


def _to_top(value: Any) -> Any:
    if value is None:
        return None
    return [[(int(t), float(lp)) for t, lp in pos] if pos is not None else None for pos in value]


def _to_spans(value: Any) -> Any:
    if value is None:
        return None
    return [(int(start), int(version)) for start, version in value]


def _check_reason(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in ("stop", "length", "abort"):
        raise ValueError(f"stop_reason={value!r} is invalid: expected 'stop', 'length' or 'abort'.")


def _int_list(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else value


def _check_mask(inst: SamplingMask, attribute: attrs.Attribute[Any], value: Any) -> None:
    offsets, ids = inst.offsets, inst.token_ids
    if not isinstance(offsets, list) or not isinstance(ids, list):
        raise InvalidInputError(
            f"SamplingMask(offsets={offsets!r:.60}, token_ids={ids!r:.60}) is invalid: expected two lists of integers."
        )
    if not offsets or offsets[0] != 0 or offsets[-1] != len(ids) or any(b < a for a, b in itertools.pairwise(offsets)):
        raise InvalidInputError(
            f"SamplingMask.offsets={offsets!r:.80} is invalid: expected a non-decreasing list starting at 0 and"
            f" ending at len(token_ids)={len(ids)}."
        )
    if any(t < 0 for t in ids):
        raise InvalidInputError("SamplingMask.token_ids holds a negative id: expected token ids >= 0.")


@attrs.define(kw_only=True)
class SamplingMask(Record):
    """The token ids the sampler kept at each generated position, CSR style.

    Position ``i`` kept ``token_ids[offsets[i]:offsets[i + 1]]`` (ascending):
    the support of the truncated, renormalised distribution (after top-k,
    top-p and min-p) that token ``i`` was drawn from. An **empty row means the
    whole vocabulary**: nothing was truncated there. That is the case at every
    position of greedy decoding (its processed log-probs are over the whole
    vocabulary) and of sampling without top-k, top-p or min-p. A kept set is
    never empty (it holds the sampled token), so the convention is unambiguous.

    Attributes:
        offsets: ``len(tokens) + 1`` non-decreasing integers, from 0 to ``len(token_ids)``.
        token_ids: the kept ids of every position, one row after another.
    """

    _error = InvalidInputError

    offsets: list[int] = attrs.field(converter=_int_list, validator=_check_mask)
    token_ids: list[int] = attrs.field(converter=_int_list, validator=_check_mask)

    def __len__(self) -> int:
        """The number of positions."""
        return len(self.offsets) - 1

    def kept(self, position: int) -> list[int]:
        """The ids kept at ``position`` (empty: the whole vocabulary)."""
        return self.token_ids[self.offsets[position] : self.offsets[position + 1]]

    @classmethod
    def from_rows(cls, rows: list[list[int]]) -> SamplingMask:
        """Build the mask from one list of kept ids per position (``[]``: the whole vocabulary)."""
        offsets, ids = [0], []
        for row in rows:
            ids.extend(sorted(row))
            offsets.append(len(ids))
        return cls(offsets=offsets, token_ids=ids)


def _to_mask(value: Any) -> Any:
    return SamplingMask.from_dict(value) if isinstance(value, dict) else value


def _routes_key(value: Any) -> Any:
    # arrays compare element-wise; sequences compare their routes by shape, dtype and bytes
    return None if value is None else (value.shape, value.dtype.str, value.tobytes())


@attrs.define(kw_only=True)
class SampledSequence(Record):
    """One completion.

    Attributes:
        tokens: the generated token ids, including a stop token or the token
            that completed a stop string (exactly what the model emitted).
        text: the decoded completion; a matched stop string is cut off.
        logprobs: with ``SamplingParams.logprobs`` set, the log-prob of each
            generated token, one per entry of ``tokens``, in the mode asked.
        top_logprobs: with ``logprobs=k > 0``, the k most likely
            ``(token_id, logprob)`` pairs at each position, sorted descending.
            The sampled token is always in ``logprobs``, whether or not it is
            among them.
        stop_reason: ``"stop"`` (EOS, a stop token or a stop string),
            ``"length"`` (``max_tokens`` or the context window) or ``"abort"``.
        stop: the stop string or token id that ended the sequence, if any.
        weights_version: the version of the weights that produced it. A
            sequence continued under newer weights (``in_flight="keep"``, or
            ``resume``) has several: then this is the oldest one (so a
            staleness check is never optimistic) and ``version_spans`` says
            which tokens each produced.
        version_spans: ``None`` when one version produced every token;
            otherwise ``(first token index, version)`` pairs in order: version
            ``v`` produced the tokens from its index up to the next pair's.
        adapter_name: the LoRA adapter used (``""`` for the base model).
        training_feature: prompt + completion as one :class:`InputFeature`,
            labels ``-100`` on the prompt and the tokens on the completion.
        sampling_mask: with ``SamplingParams.return_sampling_mask``, the token
            ids kept at each position (one row per entry of ``tokens``); see
            :class:`SamplingMask`. ``None`` otherwise.
        routed_experts: with ``SamplingParams.return_routed_experts``, a numpy
            integer array ``[len(prompt) + len(tokens) - 1, moe_layers, top_k]``:
            per token forwarded (the prompt, then every generated token but
            the last), the expert ids each MoE layer routed it to, in the
            router's order. The row of position ``i`` was computed by the
            forward that produced token ``i + 1``, so for completion token
            ``j`` (row ``len(prompt) + j - 1``) ``token_versions()[j]`` says
            which weights. To the trainer: :class:`twinkle_core.rl.RoutingReplay`.
            Serialised as the base64 text of its ``.npy`` bytes (see
            :mod:`twinkle_core.data_format.routes`).
    """

    tokens: list[int]
    text: str
    logprobs: list[float] | None = None
    top_logprobs: TopLogprobs | None = attrs.field(default=None, converter=_to_top)
    stop_reason: StopReason = attrs.field(default="length", validator=_check_reason)
    stop: str | int | None = None
    weights_version: int = 0
    version_spans: list[tuple[int, int]] | None = attrs.field(default=None, converter=_to_spans)
    adapter_name: str = ""
    training_feature: InputFeature | None = attrs.field(default=None, converter=_to_feature)
    sampling_mask: SamplingMask | None = attrs.field(default=None, converter=_to_mask)
    routed_experts: Any = attrs.field(default=None, converter=to_routes, eq=_routes_key)

    def token_versions(self) -> list[int]:
        """The version that produced each token, one per entry of ``tokens``."""
        if not self.version_spans:
            return [self.weights_version] * len(self.tokens)
        out: list[int] = []
        bounds = [*self.version_spans[1:], (len(self.tokens), -1)]
        for (start, version), (end, _) in zip(self.version_spans, bounds):
            out.extend([version] * (end - start))
        return out


def _to_sequences(value: Any) -> Any:
    return [SampledSequence.from_dict(v) if isinstance(v, dict) else v for v in value]


@attrs.define(kw_only=True)
class SampleResponse(Record):
    """The result for one input of ``sample()``.

    Attributes:
        prompt_token_ids: the prompt as the engine saw it.
        sequences: exactly ``num_samples`` completions (none if ``error``).
        prompt_logprobs: with ``prompt_logprobs`` set, the log-prob of each
            prompt token given those before it; the first entry is ``None``.
        prompt_top_logprobs: with ``prompt_logprobs=k > 0``, the top-k pairs
            per prompt position (the first entry is ``None``).
        error: set only when ``sample(..., on_invalid="skip")`` skipped this
            input; says why.
    """

    prompt_token_ids: list[int]
    sequences: list[SampledSequence] = attrs.field(factory=list, converter=_to_sequences)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: PromptTopLogprobs | None = attrs.field(default=None, converter=_to_top)
    error: str | None = None
