"""The engine contract: what a plugin implements so that a :class:`~twinkle_core.Sampler` can run it.

An engine is a small object. The ``Sampler`` the user holds owns everything
that is the same for every engine (input normalisation and validation, the
adapter table, versions, the readers-writer lock, in-flight policies, submit,
streaming, abort, resume); the engine only generates, and optionally loads
adapters and takes new weights::

    from twinkle_core.engine import BatchEngine, EngineContext, EngineInfo

    class MyEngine(BatchEngine):
        def __init__(self, context: EngineContext, model_id: str, **options):
            super().__init__(context)
            ...  # load the model
            context.init_template(options.get("template"), model_dir)
            self.info = EngineInfo(name="mine", max_model_len=4096, vocab_size=32000,
                                   supported_params=frozenset({"max_tokens", "temperature", ...}))

        def generate(self, prompts, params, adapter_name):
            return [...]  # one SampleResponse per prompt, sequences from context.make_sequence

An engine that streams subclasses :class:`Engine` and reports each sequence
once, as it ends, with one line: ``run.report(prompt, sample, tokens,
stop_reason=...)``; the sampler builds the sequence (text, version, training
feature) and assembles the responses.

    sampler = twinkle_core.Sampler(MyEngine, "my-model")   # or create_sampler("mine", "my-model")

The ``Sampler`` builds the engine: ``MyEngine(context, *args, **kwargs)``.

An engine imports this module (and ``twinkle_core.errors``,
``twinkle_core.data_format`` and ``twinkle_core.hub``) and nothing else of
the core. ``__all__`` below is the whole contract; ``docs/writing-a-plugin.md``
documents each name (a test keeps the two in step).

Locking, as the sampler guarantees it:

* :meth:`Engine.run` is called with the sampler's lock held shared: no
  adapter, weight or template change happens meanwhile, the adapter it names
  exists and ``weights_version`` is stable. Runs overlap only if
  ``EngineInfo.concurrent`` says they may.
* :meth:`Engine.load_adapter`, :meth:`Engine.remove_adapter`,
  :meth:`Engine.update_weights` and :meth:`Engine.template_changed` are
  called with the lock held exclusively: no run is in progress.
* :meth:`Engine.after_death` is called with no lock held; an engine that
  restarts itself takes :meth:`EngineContext.exclusive` there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Any

import attrs

from twinkle_core.adapter_input import AdapterInput
from twinkle_core.data_format import InputFeature, SampledSequence, SampleResponse, SamplingMask, SamplingParams
from twinkle_core.errors import ConfigError, EngineDeadError, UnsupportedFeatureError
from twinkle_core.merge import AdapterMerger
from twinkle_core.mesh import DeviceMesh
from twinkle_core.requests import EngineRun
from twinkle_core.weights import TensorSpec, check_update

__all__ = [
    "AdapterInput",
    "AdapterMerger",
    "BatchEngine",
    "DeviceMesh",
    "Engine",
    "EngineContext",
    "EngineInfo",
    "EngineRun",
    "TensorSpec",
    "check_update",
]

#: Fields every engine honours: the length of a completion and how many per prompt.
BASE_PARAMS = frozenset({"max_tokens", "num_samples"})


def _frozen_names(value: Any) -> frozenset[str]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"EngineInfo supported_params={value!r} is invalid: expected a set of field names.")
    return frozenset(value) | BASE_PARAMS


def _media_names(value: Any) -> frozenset[str]:
    from twinkle_core.data_format.media import MEDIA_KINDS

    if isinstance(value, str) or not all(v in MEDIA_KINDS for v in value):
        raise ConfigError(f"EngineInfo media={value!r} is invalid: expected a set of {', '.join(MEDIA_KINDS)}.")
    return frozenset(value)


def _positive(_self: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"EngineInfo {attribute.name}={value!r} is invalid: expected an integer >= 1.")


def _vocab(_self: Any, attribute: Any, value: Any) -> None:
    if value is not None:
        _positive(_self, attribute, value)


def _dtype_name(value: Any) -> str | None:
    """A dtype (``torch.bfloat16``) or its name, as the name (``"bfloat16"``)."""
    return None if value is None else str(value).removeprefix("torch.")


@attrs.frozen
class EngineInfo:
    """What the sampler needs to know about an engine; set as ``engine.info`` once the engine is built.

    Attributes:
        name: the registry name (``"torch"``, ``"vllm"``), used in messages.
        max_model_len: the longest prompt + completion, in tokens.
        vocab_size: token ids must be below it (``None``: unchecked). The
            sampler also refuses ``logprobs`` / ``prompt_logprobs`` above it
            and ``stop_token_ids`` outside it.
        supported_params: the ``SamplingParams`` fields the engine honours
            (``max_tokens`` and ``num_samples`` always). A call that sets any
            other field to a non-default value is refused with
            ``UnsupportedFeatureError`` before any work, so a field added to
            ``SamplingParams`` later is never silently dropped.
        concurrent: whether :meth:`Engine.run` may run in several threads at
            once; otherwise the sampler runs one at a time.
        streams_weights: :meth:`Engine.update_weights` takes an iterator of
            ``(name, tensor)`` pairs and reads it once, as it goes (a sharded
            trainer's stream is then never gathered whole); otherwise the
            sampler hands it a list.
        weights_dtype: the floating dtype the engine holds weights in (its
            name, e.g. ``"bfloat16"``), or ``None`` if unknown. The sampler's
            finite-value check then reads update and adapter tensors as they
            will be after the engine's cast: a float64 ``1e300`` is finite
            until it becomes a float32.
        media: the media the engine passes to its model (``"image"``,
            ``"video"``); none by default. A prompt carrying any other is
            refused with ``UnsupportedFeatureError`` before any work, so no
            engine silently samples from a prompt without its images.
    """

    name: str
    max_model_len: int = attrs.field(validator=_positive)
    vocab_size: int | None = attrs.field(default=None, validator=_vocab)
    supported_params: frozenset[str] = attrs.field(default=BASE_PARAMS, converter=_frozen_names)
    concurrent: bool = False
    streams_weights: bool = False
    weights_dtype: str | None = attrs.field(default=None, converter=_dtype_name)
    media: frozenset[str] = attrs.field(default=frozenset(), converter=_media_names)


class EngineContext(ABC):
    """What an engine may use of the sampler that holds it; the sampler passes one to the engine's constructor."""

    @abstractmethod
    def init_template(self, template: Any, model_dir: Any = None, *, tokenizer: Any = None) -> None:
        """Set up the tokenizer and the chat template.

        Args:
            template: what the user passed (a registered name, a ``Template``
                class or instance), or ``None`` for the tokenizer's own chat template.
            model_dir: a model folder whose Hugging Face tokenizer is loaded.
            tokenizer: a tokenizer object instead (an engine with its own).
        """

    @property
    @abstractmethod
    def template(self) -> Any:
        """The chat template (``twinkle_core.template.Template``): encodes, decodes, knows the EOS id."""

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The tokenizer the template wraps."""

    @property
    @abstractmethod
    def weights_version(self) -> int:
        """The version the sampler's weights are at (stable during a run)."""

    @abstractmethod
    def make_sequence(
        self,
        prompt_ids: list[int],
        tokens: list[int],
        *,
        stop_reason: str,
        adapter_name: str,
        params: SamplingParams | None = None,
        text: str | None = None,
        stop: str | int | None = None,
        logprobs: list[float] | None = None,
        top_logprobs: Any = None,
        sampling_mask: SamplingMask | None = None,
        routed_experts: Any = None,
    ) -> SampledSequence:
        """A finished ``SampledSequence``: its text, version and training feature.

        ``stop_reason`` is ``"stop"``, ``"length"`` or ``"abort"``; ``stop``
        the token id or string that ended it; ``adapter_name`` the adapter
        that produced it (``""``: the base model). The text, unless given, is
        the completion's text under ``params``' text options (cut at a stop
        string), or the plain decode without ``params``. An engine that
        streams needs none of this: :meth:`EngineRun.report` builds the
        sequence from the run's own prompt, parameters and adapter.
        """

    @abstractmethod
    def exclusive(self) -> AbstractContextManager[None]:
        """Hold the sampler's lock exclusively (no run, no other change) for the engine's own state changes."""

    @abstractmethod
    def restore_version(self, version: int) -> None:
        """State the version a rebuilt engine replayed its weights to (the sampler never lowers it)."""

    @property
    @abstractmethod
    def placement(self) -> Any:
        """Where the engine runs: a ``ReplicaContext`` inside a Ray replica (rank, devices), else ``None``."""


class Engine(ABC):
    """An engine: generates, and optionally loads adapters and takes weights.

    Subclasses call ``super().__init__(context)``, build their model, and set
    :attr:`info` before the constructor returns. Only :meth:`run` is required.
    """

    info: EngineInfo

    def __init__(self, context: EngineContext) -> None:
        self.context = context

    @abstractmethod
    def run(self, run: EngineRun) -> list[SampleResponse] | None:
        """Generate ``run``, reporting into it; the sampler assembles the responses from the reports.

        The engine reports each final sequence once, as soon as it is final:
        ``run.report(prompt, sample, tokens, stop_reason=..., ...)`` (the
        sampler builds it), ``run.report_empty(prompt, stop_reason)`` for a
        prompt that generates nothing, and a prompt's scores with
        ``run.report_scores``. ``run.params.num_samples`` sequences per
        prompt; ``max_tokens=0`` means score the prompt only (with
        ``prompt_logprobs``) and report empty sequences. Between steps the
        engine checks ``run.stopped()`` and then ends its unfinished sequences
        with ``stop_reason="abort"`` and their partial tokens; it honours
        ``run.max_tokens`` per prompt and, for seeded sampling, keys its
        randomness on ``run.sample_base`` and ``run.generated`` so that a
        continued sequence draws what the uninterrupted one would have.

        Returns ``None``. (Responses returned instead, as engines written
        before reporting did, are reported for them.) An engine that only
        generates whole batches subclasses :class:`BatchEngine`.
        """

    def max_prompt_len(self, params: SamplingParams) -> int:
        """The longest prompt accepted for ``params``: room for one generated token when generating."""
        return self.info.max_model_len - (1 if params.max_tokens > 0 else 0)

    def load_adapter(self, adapter: AdapterInput, *, version: int, **kwargs: Any) -> str:
        """Load (or replace) a LoRA adapter; return its source, for listings.

        ``adapter`` is already read and checked (floating point, finite);
        ``kwargs`` are the engine's own options of ``add_adapter_to_model``:
        refuse unknown ones. ``version`` is the ``weights_version`` the change
        will carry. Lock held exclusively.
        """
        raise UnsupportedFeatureError(f"The {self.info.name} engine has no LoRA support.")

    def remove_adapter(self, name: str) -> None:
        """Unload the adapter ``name`` (it is loaded). Lock held exclusively."""
        raise UnsupportedFeatureError(f"The {self.info.name} engine has no LoRA support.")

    def update_weights(self, named_tensors: list[tuple[str, Any]], *, version: int) -> None:
        """Validate (see :func:`check_update`) then apply new base weights, all or nothing. Lock held exclusively.

        A twinkle error (``WeightUpdateError``...) says nothing changed. An
        engine that fails after changing some tensors, and cannot put them back,
        raises ``IncompleteUpdateError`` (any other error counts as such too):
        the sampler then refuses to sample until those tensors are pushed again.
        """
        raise UnsupportedFeatureError(f"The {self.info.name} engine cannot update weights.")

    def template_changed(self) -> None:
        """After ``set_template``, lock held exclusively (an engine caching tokenizer data refreshes it)."""
        return None

    def after_death(self, error: EngineDeadError) -> BaseException:
        """A run raised ``EngineDeadError``; restart here if the engine can. Returns what the call raises."""
        return error

    def close(self) -> None:
        """Release the engine's resources (called once, by ``Sampler.close()``)."""
        return None


class BatchEngine(Engine):
    """An engine that generates whole batches: implement :meth:`generate`, not :meth:`run`.

    An abort then acts before a batch starts, and sequences stream when their batch ends.
    """

    @abstractmethod
    def generate(self, prompts: list[InputFeature], params: SamplingParams, adapter_name: str) -> list[SampleResponse]:
        """One ``SampleResponse`` per prompt, in order, each with ``params.num_samples`` sequences."""

    def run(self, run: EngineRun) -> None:
        run_in_batches(run, self.generate)


def run_in_batches(run: EngineRun, generate: Any) -> None:
    """Run ``run`` through a whole-batch ``generate(prompts, params, adapter_name)``, reporting each batch.

    What :meth:`BatchEngine.run` does.

    Continued sequences of one run can have different budgets (``run.max_tokens``),
    and have generated some tokens already (``run.generated``): each call's
    ``max_tokens`` is its budget and its ``min_tokens`` what is left of the
    request's, so ``generate`` needs to know nothing of continuations.
    """
    groups: dict[tuple[int, int], list[int]] = {}
    for k, (budget, done) in enumerate(zip(run.max_tokens, run.generated)):
        groups.setdefault((budget, min(done, run.params.min_tokens)), []).append(k)
    for (budget, done), picked in sorted(groups.items()):
        params = run.params.replace(max_tokens=budget, min_tokens=min(budget, run.params.min_tokens - done))
        part = generate([run.prompts[k] for k in picked], params, run.adapter_name)
        for k, response in zip(picked, part):
            for s, sequence in enumerate(response.sequences):
                run.finish(k, s, sequence)
            if response.prompt_logprobs is not None:
                run.report_scores(k, response.prompt_logprobs, response.prompt_top_logprobs)
