"""Every error twinkle raises on purpose.

One base class, :class:`TwinkleError`, and specific subclasses that also derive
from the matching builtin, so callers can catch either ``TwinkleError`` or the
builtin they already handle (``ValueError``, ``LookupError``, ``TimeoutError``).
Each message names the offending value and what would have been accepted.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = [
    "AdapterError",
    "ConfigError",
    "DuplicateSamplerError",
    "EngineDeadError",
    "HubUnavailableError",
    "IncompleteUpdateError",
    "InvalidInputError",
    "InvalidMediaError",
    "InvalidMeshError",
    "InvalidModelIdError",
    "InvalidSamplingParams",
    "MergedAdapterError",
    "ModelNotFoundError",
    "NumericalError",
    "PluginLoadError",
    "PolicyMismatchError",
    "PromptTooLongError",
    "SamplerClosedError",
    "StalePolicyError",
    "TemplateError",
    "TwinkleError",
    "UnknownAdapterError",
    "UnknownFieldError",
    "UnknownSamplerError",
    "UnknownSamplingParamError",
    "UnknownTemplateError",
    "UnsupportedFeatureError",
    "WeightSyncTimeoutError",
    "WeightUpdateError",
    "did_you_mean",
]


def did_you_mean(name: str, choices: Iterable[str], *, n: int = 1) -> str:
    """Return ``" Did you mean 'x'?"`` for the closest of ``choices`` (up to ``n`` of them), or ``""``.

    The one spelling helper of the project: every "unknown name" message uses it.
    """
    close = difflib.get_close_matches(str(name), sorted({str(c) for c in choices}), n=n, cutoff=0.6)
    if not close:
        return ""
    return " Did you mean " + " or ".join(repr(c) for c in close) + "?"


class TwinkleError(Exception):
    """Base class of every error raised by twinkle itself."""

    def __str__(self) -> str:
        # LookupError subclasses would otherwise be fine, but KeyError-style
        # repr() quoting must never mangle multi-line messages.
        return self.args[0] if len(self.args) == 1 else super().__str__()


class ConfigError(TwinkleError, ValueError):
    """A configuration file, mapping or environment variable is invalid."""


class InvalidSamplingParams(TwinkleError, ValueError):
    """A sampling parameter has a bad value or an unknown name.

    Attributes:
        field: the ``SamplingParams`` field at fault (``None`` when no one field is).
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args[0], {"field": self.field}))


class InvalidInputError(TwinkleError, ValueError):
    """An input to ``sample`` (trajectory, feature, message) is malformed."""


class InvalidMediaError(InvalidInputError):
    """An image or video in a prompt cannot be used: undecodable, truncated, of a format not accepted, too large,
    too many, remote, or a video with no frames.

    Attributes:
        part: where it is, e.g. ``"Trajectory.messages[0].content[2]"`` or ``"Trajectory.images[1]"``.
    """

    def __init__(self, message: str, *, part: str = "") -> None:
        super().__init__(message)
        self.part = part

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args[0], {"part": self.part}))


class UnknownFieldError(InvalidInputError, TypeError):
    """A data record (``Trajectory``, ``Message``, ...) was given a key it has no field for.

    Also a ``TypeError``: what Python raises for an unexpected keyword argument.
    """


class UnknownSamplingParamError(InvalidSamplingParams, TypeError):
    """``SamplingParams`` (or its ``structured_outputs``) was given a key it has no field for.

    Also a ``TypeError``: what Python raises for an unexpected keyword argument.
    """


class PromptTooLongError(InvalidInputError):
    """A prompt does not fit in the model's context window.

    Attributes:
        index: position of the offending input in the call.
        length: the prompt length in tokens; with ``at_least``, a lower bound.
        limit: the longest prompt the engine accepts.
        at_least: the prompt was refused before it was tokenized whole, so
            ``length`` counts only the tokens read before it was clear that
            the prompt cannot fit (a text far longer than any context is
            never tokenized whole).
    """

    def __init__(self, message: str, *, index: int, length: int, limit: int, at_least: bool = False) -> None:
        super().__init__(message)
        self.index = index
        self.length = length
        self.limit = limit
        self.at_least = at_least

    def __reduce__(self) -> tuple[object, ...]:
        # keyword-only attributes survive pickling (errors cross process boundaries on Ray)
        fields = {"index": self.index, "length": self.length, "limit": self.limit, "at_least": self.at_least}
        return (_rebuild, (type(self), self.args[0], fields))


class UnknownSamplerError(TwinkleError, LookupError):
    """No engine is registered under the requested name."""


class DuplicateSamplerError(TwinkleError, LookupError):
    """Two distributions register an engine (or template) under one name."""


class PluginLoadError(TwinkleError, ImportError):
    """A plugin or the engine it registers failed to import."""


class UnknownTemplateError(TwinkleError, LookupError):
    """No chat template is registered under the requested name."""


class TemplateError(TwinkleError, ValueError):
    """A template cannot encode the input (e.g. the model has no chat template)."""


class UnknownAdapterError(TwinkleError, LookupError):
    """The requested LoRA adapter is not loaded."""


class AdapterError(TwinkleError, ValueError):
    """A LoRA adapter could not be loaded (missing folder, bad config, bad weights)."""


class MergedAdapterError(TwinkleError, RuntimeError):
    """A call needs weights other than the merged ones (``add_adapter_to_model(..., merge=True)``).

    While an adapter is merged into the base weights, the base model (and any
    other adapter) is not available: remove the merged adapter first.
    """


class InvalidModelIdError(TwinkleError, ValueError):
    """A model id has an unknown scheme or is malformed."""


class ModelNotFoundError(TwinkleError, FileNotFoundError):
    """A model folder does not exist, or the hub has no such model."""


class HubUnavailableError(TwinkleError, ConnectionError):
    """A model hub could not be reached and the model is not in the local cache."""


class InvalidMeshError(TwinkleError, ValueError):
    """A device mesh or device group is invalid, or does not fit its group."""


class WeightUpdateError(TwinkleError, ValueError):
    """A weight update was rejected (unknown name, wrong shape or dtype, bad checksum)."""


class IncompleteUpdateError(TwinkleError, RuntimeError):
    """A weight update failed part-way (not refused: interrupted, or the engine failed while applying it).

    The engine may hold some of its tensors and not others, a policy no
    version names, so the sampler refuses to sample until an update that
    pushes those tensors again succeeds.

    Attributes:
        tensors: the weights an engine may have left part-changed, when it
            names them (a merge or unmerge it could not undo); the sampler
            refuses to sample until they are pushed again.
    """

    def __init__(self, message: str, *, tensors: Iterable[str] = ()) -> None:
        super().__init__(message)
        self.tensors = tuple(tensors)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args[0], {"tensors": self.tensors}))


class WeightSyncTimeoutError(TwinkleError, TimeoutError):
    """A worker did not answer a weight-sync message in time.

    Attributes:
        stage: the step of the protocol that timed out.
    """

    def __init__(self, message: str, *, stage: str) -> None:
        super().__init__(message)
        self.stage = stage

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (type(self), self.args[0], {"stage": self.stage}))


class NumericalError(TwinkleError, ArithmeticError):
    """The model computed NaN or infinity where a token was to be drawn.

    Finite weights can still overflow in the forward (an update or adapter
    with values too large): the call that hit it fails, and the engine goes on.
    """

    @classmethod
    def in_logits(cls, adapter: str = "") -> NumericalError:
        """The error of a call whose logits (with ``adapter``, if any) hold NaN or infinity."""
        return cls(
            "The model's logits hold NaN or infinity"
            + (f" with adapter {adapter!r}" if adapter else "")
            + ": its weights hold NaN, or values large enough to overflow in the forward (a weight update or adapter"
            " scaled too far). Nothing more was sampled for this call; the engine goes on."
        )


class UnsupportedFeatureError(TwinkleError, NotImplementedError):
    """The engine cannot honour a requested feature or parameter."""


class StalePolicyError(TwinkleError, RuntimeError):
    """A sample was produced by weights (or an adapter) other than the ones the trainer last pushed."""


class PolicyMismatchError(TwinkleError, RuntimeError):
    """The sampler's log-probs of its own samples differ from the trainer's by more than the tolerance:
    the sampler is not running the trainer's policy."""


class SamplerClosedError(TwinkleError, RuntimeError):
    """The sampler was used after ``close()``."""


class EngineDeadError(TwinkleError, RuntimeError):
    """The engine behind a sampler died (its process was killed or crashed).

    The message says whether the sampler restarted the engine and what to do next.
    """


def _rebuild(cls: type[TwinkleError], message: str, kwargs: dict[str, object]) -> TwinkleError:
    return cls(message, **kwargs)
