"""The ``Sampler`` users hold, around an engine, and the input handling every engine shares.

An engine is a :class:`twinkle_core.engine.Engine` object, built by
``Sampler(EngineClass, *args, **kwargs)``; ``Sampler`` itself is final (a
subclass may only name an engine's constructor). Everything a user calls
(``sample``, ``add_adapter_to_model``, ``update_weights``...) lives here, so
input normalisation, validation, error messages, versioning and locking are
the same for every engine.

``from twinkle_core.sampler import vLLMSampler, TorchSampler`` resolves the
engine classes lazily through the registry: importing one never imports the
other.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from twinkle_core.adapter_input import AdapterInput
from twinkle_core.calls import Calls
from twinkle_core.data_format import (
    InputFeature,
    SampledSequence,
    SampleResponse,
    SamplingMask,
    SamplingParams,
    Trajectory,
    training_feature,
)
from twinkle_core.data_format.params import resolve_params
from twinkle_core.engine import Engine, EngineContext, EngineInfo
from twinkle_core.errors import (
    ConfigError,
    EngineDeadError,
    IncompleteUpdateError,
    InvalidInputError,
    SamplerClosedError,
    TemplateError,
    TwinkleError,
    WeightUpdateError,
)
from twinkle_core.inputs import OnInvalid, SampleInputs, normalize_inputs
from twinkle_core.placement import current_replica
from twinkle_core.requests import SampleHandle
from twinkle_core.state import AdapterInfo, AppliedWithError, PolicyState
from twinkle_core.template import Template, get_template, load_tokenizer
from twinkle_core.weights import check_pair, find_non_finite

__all__ = [
    "AdapterInfo",
    "AppliedWithError",
    "OnInvalid",
    "SampleInputs",
    "Sampler",
    "normalize_inputs",
    "resolve_params",
]

S = TypeVar("S", bound="Sampler")


#: The names of ``Sampler`` a subclass may define: its constructor, and what names its engine.
_SUBCLASS_MAY_SET = frozenset({"engine", "engine_name", "supported_params", "concurrent_samples"})


def _checked_stream(
    pairs: Iterable[Any], check_finite: bool, into: str | None, seen: list[str]
) -> Iterator[tuple[str, Any]]:
    """``pairs`` read lazily, each checked as :meth:`Sampler.update_weights` checks a list; at least one.

    ``into``: the engine's weights dtype (see :func:`find_non_finite`). The
    name of each pair handed on is appended to ``seen``.
    """
    count = 0
    for i, item in enumerate(pairs):
        check_pair(i, item)
        if check_finite:
            bad = find_non_finite([item], into)
            if bad is not None:
                raise WeightUpdateError(f"update_weights: {bad}; nothing was updated.")
        count += 1
        seen.append(item[0])
        yield item
    if not count:
        raise WeightUpdateError("update_weights got no tensors.")


def require_engine_class(engine: Any) -> None:
    """Refuse what ``Sampler(engine, ...)`` cannot build (here, and in the driver before any Ray replica starts)."""
    if not (isinstance(engine, type) and issubclass(engine, Engine)):
        raise ConfigError(
            f"Sampler(engine=...) got {engine!r}: expected a twinkle_core.engine.Engine subclass, which the"
            " sampler builds as engine(context, *args, **kwargs)."
        )


class _Context(EngineContext):
    """What the engine held by a ``Sampler`` may use of it (see :class:`twinkle_core.engine.EngineContext`)."""

    def __init__(self, sampler: Sampler) -> None:
        self._sampler = sampler

    def init_template(self, template: Any, model_dir: Any = None, *, tokenizer: Any = None) -> None:
        self._sampler._init_template(template, model_dir, tokenizer=tokenizer)

    @property
    def template(self) -> Template:
        return self._sampler.template

    @property
    def tokenizer(self) -> Any:
        return self._sampler.tokenizer

    @property
    def weights_version(self) -> int:
        return self._sampler.weights_version

    def make_sequence(self, prompt_ids: list[int], tokens: list[int], **fields: Any) -> SampledSequence:
        # the contract's keywords (EngineContext.make_sequence), but never a weights version: the sampler states it
        if "weights_version" in fields:
            raise TypeError("make_sequence() takes no weights_version: each sequence carries the sampler's own.")
        return self._sampler._make_sequence(prompt_ids, tokens, **fields)

    def exclusive(self) -> Any:
        return self._sampler._exclusive()

    def restore_version(self, version: int) -> None:
        self._sampler._restore_version(version)

    @property
    def placement(self) -> Any:
        return current_replica()


class Sampler:
    """Generates completions from a language model: ``Sampler(EngineClass, *args, **kwargs)``.

    The engine (a :class:`twinkle_core.engine.Engine`) is built as
    ``EngineClass(context, *args, **kwargs)``; ``create_sampler(name, ...)``
    does this for a registered engine.

    ``Sampler`` runs its engine in this process. For Ray replicas (after
    ``twinkle_core.initialize("ray", groups=[...])``), the factory builds it:
    ``create_sampler(EngineClass, ..., remote_group="name")``, or a named
    sampler (``TorchSampler(..., remote_group="name")``) gives
    ``device_mesh.dp_size`` Ray actors behind a ``RemoteSampler`` with this
    same API; engines need no code for it.

    The log-probability contract, common to every engine:

    * ``logprobs=None``: none returned; ``0``: the sampled token's log-prob per
      position (``SampledSequence.logprobs``); ``k > 0``: also the top-k
      alternatives per position, sorted (``SampledSequence.top_logprobs``).
    * ``logprobs_mode="processed"`` (default): log-probs under the distribution
      each token was drawn from, after repetition penalty, temperature, top-k,
      top-p and min-p; greedy decoding applies only the repetition penalty.
      ``"raw"``: log-softmax of the raw logits.
    * With the same model, prompt and greedy decoding, engines agree on the
      tokens, and on their log-probs to a stated tolerance.

    Every sequence carries the ``weights_version`` it was produced with.

    ``Sampler`` is final: an engine is a :class:`twinkle_core.engine.Engine`,
    never a subclass of this class. A subclass may only name an engine (a
    constructor with its arguments, like ``TorchSampler``) and add accessors;
    one that overrides anything of this class is refused when it is defined.

    For the Ray replica host: ``_sample(items, params, adapter_name, on_invalid,
    indices)`` runs a share of a call whose arguments the driver checked (lock
    held shared, adapter checked, inputs named by their place in the whole
    call). A state-change hook may raise ``AppliedWithError`` (the Ray engine,
    when only some replicas applied a change): the change is recorded, then
    its error raised.
    """

    #: The registry name of the engine (``"torch"``, ``"vllm"``), for messages (the engine's ``info.name``).
    engine_name: str = ""
    #: The ``SamplingParams`` fields the engine honours (its ``info.supported_params``).
    supported_params: ClassVar[frozenset[str]] = frozenset({"max_tokens", "num_samples"})
    #: Whether the engine's runs may overlap (its ``info.concurrent``).
    concurrent_samples: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # ``_generate``: the required hook of engines written as subclasses before the contract
        base_names = {"_generate"} | {name for klass in Sampler.__mro__ for name in vars(klass)}
        overridden = sorted(
            name
            for name in vars(cls)
            if name in base_names
            and name not in _SUBCLASS_MAY_SET
            and not (name.startswith("__") and name.endswith("__"))
        )
        if overridden:
            raise TypeError(
                f"{cls.__name__} overrides Sampler's {', '.join(overridden)}: Sampler is final. Write the engine as a"
                " twinkle_core.engine.Engine and build Sampler(YourEngine, ...) (a Sampler subclass may only give"
                " an engine's constructor a name, and add accessors)."
            )

    def __init__(self, engine: type[Engine] | None = None, /, *args: Any, **kwargs: Any) -> None:
        # None only while the engine's constructor runs (it may set the template then).
        self._held_engine: Engine | None = None
        self._template: Template | None = None
        self._tokenizer: Any = None
        self._state = PolicyState()
        self._closed = False
        self._calls = Calls(self, self._state)
        # Adapters loaded by sample(adapter_path=...): the weights files' stamps they were loaded from.
        self._path_stamps: dict[str, tuple[tuple[str, int, int], ...]] = {}
        self._path_lock = threading.Lock()
        if engine is None:
            raise TypeError(
                "Sampler(engine, *args, **kwargs) needs an engine class (a twinkle_core.engine.Engine subclass)"
                " first; pick one by name with twinkle_core.create_sampler(name, ...)."
            )
        require_engine_class(engine)
        if "remote_group" in kwargs:
            raise ConfigError(
                f"Sampler({engine.__name__}, ..., remote_group={kwargs['remote_group']!r}): Sampler runs its engine"
                f" in this process. Build Ray replicas with twinkle_core.create_sampler({engine.__name__}, ...,"
                " remote_group=...)."
            )
        self._closed = True  # until the engine is built: nothing to close if its constructor fails
        built = engine(_Context(self), *args, **kwargs)
        info = getattr(built, "info", None)
        if not isinstance(info, EngineInfo):
            built.close()
            raise ConfigError(
                f"{engine.__name__} did not set self.info to an EngineInfo in its constructor (got {info!r})."
            )
        self._held_engine = built
        self._closed = False
        self.engine_name = info.name
        self.supported_params = info.supported_params  # type: ignore[misc]
        self.concurrent_samples = info.concurrent  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Sampler({self._held_engine!r})"

    @property
    def engine(self) -> Engine:
        """The engine this sampler runs."""
        if self._held_engine is None:
            raise TwinkleError(
                "The engine is still being built: a Sampler's engine exists once its constructor returns."
            )
        return self._held_engine

    # -- the engine ------------------------------------------------------------------------
    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) the engine accepts, in tokens."""
        return self.engine.info.max_model_len

    @property
    def vocab_size(self) -> int | None:
        """Number of token ids the model accepts (``None``: unchecked)."""
        return self.engine.info.vocab_size

    def _max_prompt_len(self, params: SamplingParams) -> int:
        return self.engine.max_prompt_len(params)

    def _load_adapter(self, adapter: AdapterInput, *, version: int, **kwargs: Any) -> str:
        return self.engine.load_adapter(adapter, version=version, **kwargs)

    def _remove_adapter(self, name: str) -> None:
        self.engine.remove_adapter(name)

    def _update_weights(self, named_tensors: list[tuple[str, Any]], *, version: int) -> None:
        self.engine.update_weights(named_tensors, version=version)

    def _close(self) -> None:
        if self._held_engine is not None:
            self._held_engine.close()

    def _after_engine_death(self, error: EngineDeadError) -> BaseException:
        return self.engine.after_death(error)

    def _on_template_changed(self) -> None:
        if self._held_engine is not None:  # not while the engine's constructor sets its first template
            self._held_engine.template_changed()

    def _label(self) -> str:
        return self.engine_name or type(self).__name__

    # -- helpers for engines --------------------------------------------------------------
    def _init_template(
        self, template: Any, model_dir: str | os.PathLike[str] | None = None, *, tokenizer: Any = None
    ) -> None:
        """Set up the tokenizer and the chat template.

        Args:
            template: what the user passed (a registered name, a ``Template``
                class or instance), or ``None`` for the tokenizer's own chat template.
            model_dir: a model folder whose Hugging Face tokenizer is loaded.
            tokenizer: a tokenizer object instead (an engine with its own).
        """
        if isinstance(template, Template):
            self.set_template(template)
            return
        if tokenizer is not None:
            self._tokenizer = tokenizer
        elif model_dir is not None:
            self._tokenizer = load_tokenizer(model_dir)
        self.set_template(template if template is not None else Template)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the sampler's lock exclusively: no sample runs, no other state change."""
        with self._state.lock.write():
            yield

    def _restore_version(self, version: int) -> None:
        """Raise ``weights_version`` to ``version`` (a rebuilt engine that replayed its state)."""
        self._state.restore_version(version)

    # -- template ------------------------------------------------------------------------
    @property
    def template(self) -> Template:
        """The template that encodes trajectories and decodes tokens."""
        if self._template is None:
            raise TwinkleError("No template is set: call set_template(...) first.")
        return self._template

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer."""
        return self.template.tokenizer

    def set_template(self, template: type[Template] | Template | str, **kwargs: Any) -> None:
        """Set the chat template: a registered name, a ``Template`` class or an instance.

        Waits for the samples in flight; later samples use the new template.

        Raises:
            UnknownTemplateError: an unknown name (with did-you-mean).
            TemplateError: anything else that is not a template, or options its class does not take.
        """
        if isinstance(template, str):
            template = get_template(template)
        if isinstance(template, type) and issubclass(template, Template):
            tokenizer = self._tokenizer if self._tokenizer is not None else getattr(self._template, "tokenizer", None)
            if tokenizer is None:
                raise TwinkleError("This sampler has no tokenizer to build the template with; pass an instance.")
            cls = template
            try:
                template = cls(tokenizer, **kwargs)
            except TypeError as exc:  # an option the class does not take
                raise TemplateError(f"set_template({cls.__name__}, **{kwargs!r:.80}): {exc}.") from None
        elif kwargs:
            raise TemplateError(f"set_template got keyword arguments {sorted(kwargs)} with a Template instance.")
        if not isinstance(template, Template):
            raise TemplateError(
                f"set_template expects a registered name, a Template subclass or instance; got {template!r:.80}."
            )
        with self._state.lock.write():
            previous = (self._template, self._tokenizer)
            self._template = template
            self._tokenizer = template.tokenizer
            try:
                self._on_template_changed()
            except AppliedWithError as applied:  # kept: the engine applied it, not cleanly
                raise applied.error from None
            except BaseException:
                self._template, self._tokenizer = previous
                raise

    # -- adapters ------------------------------------------------------------------------
    @property
    def adapters(self) -> Mapping[str, AdapterInfo]:
        """The loaded LoRA adapters by name (read-only)."""
        return self._state.adapters

    def adapter_id(self, name: str) -> int:
        """The stable integer id of a loaded adapter."""
        return self._state.require_adapter(name).adapter_id

    def add_adapter_to_model(
        self,
        adapter_name: str,
        config_or_dir: Any,
        *,
        weights: Any = None,
        version: int | None = None,
        check_finite: bool = True,
        in_flight: str = "wait",
        **kwargs: Any,
    ) -> int:
        """Load a PEFT LoRA adapter under ``adapter_name``, or replace it in place.

        Waits for the samples in flight; samples started later use the new adapter.

        Args:
            adapter_name: the name ``sample(adapter_name=...)`` selects it by (not ``""``).
            config_or_dir: a PEFT adapter folder, or a ``peft.LoraConfig`` (or
                its dict) with ``weights``.
            weights: the adapter's tensors by PEFT name, with a config.
            version: the new ``weights_version`` (default: current + 1).
            check_finite: refuse tensors holding NaN or infinity (default). The
                check reads every tensor once; see ``docs/concepts.md`` for its cost.
            in_flight: what happens to calls in flight: ``"wait"`` for them
                (default), ``"abort"`` them, or ``"keep"`` them (see ``update_weights``).
            **kwargs: engine-specific options (an engine refuses those it does not know).
                ``merge=True`` (torch and vllm engines): serve the adapter merged
                into the base weights (``twinkle_core.merge``, ``docs/concepts.md``).

        Returns:
            The sampler's new ``weights_version``: samples drawn after this call carry it.

        Raises:
            AdapterError: the folder is missing or malformed, the weights do not
                fit, are not floating point or are not finite. A refused adapter
                changes nothing.
        """
        self._check_open()
        if not isinstance(adapter_name, str) or not adapter_name:
            raise InvalidInputError(f"adapter_name={adapter_name!r} is invalid: expected a non-empty string.")
        # Tensors in memory are checked now, before in_flight acts; a folder is read when the engine asks.
        adapter = AdapterInput(
            adapter_name, config_or_dir, weights, check_finite=check_finite, into=self.engine.info.weights_dtype
        )

        def record(new_version: int, source: Any) -> None:
            self._state.record_adapter(adapter_name, new_version, adapter.source if source is None else source)

        def load(new_version: int) -> str:
            with self._doubting(new_version, f"add_adapter_to_model({adapter_name!r})"):
                return self._load_adapter(adapter, version=new_version, **kwargs)

        return self._state.change(in_flight, version, load, record)

    def remove_adapter(self, adapter_name: str, *, in_flight: str = "wait") -> None:
        """Unload an adapter (after the samples in flight finish, or as ``in_flight`` says).

        Under ``in_flight="keep"`` the calls of other adapters continue; a call
        sampling this one cannot, and its unfinished sequences come back as
        ``"abort"`` leaves them, with the tokens it generated.

        Raises:
            UnknownAdapterError: it is not loaded.
        """
        self._check_open()

        def remove(version: int) -> None:
            self._state.require_adapter(adapter_name)
            with self._doubting(version, f"remove_adapter({adapter_name!r})"):
                self._remove_adapter(adapter_name)

        self._state.change(in_flight, None, remove, lambda _v, _r: self._state.drop_adapter(adapter_name), bump=False)

    @contextmanager
    def _doubting(self, version: int, change: str) -> Iterator[None]:
        """An adapter change the engine could not apply whole, nor undo (a merge interrupted twice).

        The engine names the weights it may have left part-changed in an
        ``IncompleteUpdateError``; sampling is refused until they are pushed again.
        """
        try:
            yield
        except IncompleteUpdateError as exc:
            if exc.tensors:
                self._state.doubt(version, list(exc.tensors), exc, change=change)
            raise

    # -- weights -------------------------------------------------------------------------
    @property
    def weights_version(self) -> int:
        """Bumped by every ``update_weights`` and adapter (re)load; 0 at start."""
        return self._state.version

    def update_weights(
        self,
        named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        version: int | None = None,
        check_finite: bool = True,
        in_flight: str = "wait",
    ) -> int:
        """Replace base-model weights (names as in the model's Hugging Face ``state_dict``).

        Everything is validated (names, shapes, dtypes, finite values) before
        anything is applied: a rejected update changes nothing. Waits for the
        samples in flight and holds new ones back until the update is done.

        Args:
            named_tensors: a mapping or ``(name, tensor)`` pairs; or an
                iterator of pairs (a sharded trainer's gathered tensors, see
                :mod:`twinkle_core.transport.sharded`), which an engine that
                streams updates (a remote sampler with the collective
                transport) reads once, bucket by bucket, and any other reads
                into a list first.
            version: the new ``weights_version`` (default: current + 1).
            check_finite: refuse tensors holding NaN or infinity (default). The
                check reads every tensor once; see ``docs/concepts.md`` for its cost.
            in_flight: what happens to calls in flight. ``"wait"`` (default):
                the update waits for them; they finish under the old weights.
                ``"abort"``: they are aborted (their unfinished sequences come
                back with ``stop_reason="abort"`` and their partial tokens).
                ``"keep"``: they are stopped at the next step, the weights are
                swapped, and their unfinished sequences continue under the new
                weights from where they were (``version_spans`` records which
                version produced which tokens). In every mode each token is
                produced by exactly one version, the one recorded for it.

        Returns:
            The new ``weights_version``, carried by every later sample.

        Raises:
            WeightUpdateError: a bad name, shape, dtype or value; nothing changed.
            IncompleteUpdateError: the engine failed part-way through applying
                the update. Any other error the engine raises while applying it
                (an interrupt, a crash of its own) propagates as it is. Either
                way the engine may hold some of the new values and not others,
                so sampling is refused (``IncompleteUpdateError``) until an
                update that pushes those tensors again succeeds.
        """
        self._check_open()
        items: Any
        names: list[str] = []  # what the engine was handed (of a stream: what it read)
        if isinstance(named_tensors, Mapping):
            items = list(named_tensors.items())
        elif not isinstance(named_tensors, Iterable) or isinstance(named_tensors, (str, bytes)):
            raise WeightUpdateError(
                f"update_weights got {type(named_tensors).__name__} {named_tensors!r:.60}: expected a mapping of"
                " names to tensors, or (name, tensor) pairs; nothing was updated."
            )
        elif isinstance(named_tensors, (list, tuple)) or not self.engine.info.streams_weights:
            items = list(named_tensors)
        else:  # a stream the engine reads once, as it goes: each pair is checked as it comes
            items = _checked_stream(named_tensors, check_finite, self.engine.info.weights_dtype, names)
        if isinstance(items, list):
            for i, item in enumerate(items):
                check_pair(i, item)
            if not items:
                raise WeightUpdateError("update_weights got no tensors.")
            if check_finite:
                bad = find_non_finite(items, self.engine.info.weights_dtype)
                if bad is not None:
                    raise WeightUpdateError(f"update_weights: {bad}; nothing was updated.")
            names = [name for name, _ in items]

        def apply(new_version: int) -> None:
            try:
                self._update_weights(items, version=new_version)
            except AppliedWithError:  # applied everywhere in the end
                self._state.settle(names)
                raise
            except IncompleteUpdateError as exc:
                self._state.doubt(new_version, names, exc)
                raise
            except TwinkleError:  # a refusal: the engine changed nothing (the contract)
                raise
            except BaseException as exc:  # an interrupt or the engine's own failure, maybe part-way
                self._state.doubt(new_version, names, exc)
                raise
            self._state.settle(names)

        return self._state.change(in_flight, version, apply, lambda _version, _result: None)

    # -- sampling ------------------------------------------------------------------------
    def encode(
        self, item: InputFeature | Trajectory, *, max_tokens: int | None = None, keep_last: int | None = None
    ) -> InputFeature:
        """The prompt feature of one input (trajectories go through the template).

        ``max_tokens`` and ``keep_last`` bound the work on a trajectory, as
        :meth:`Template.encode` takes them; a feature is returned as it is.
        """
        if isinstance(item, InputFeature):
            return item
        return self.template.encode(item, add_generation_prompt=True, max_tokens=max_tokens, keep_last=keep_last)

    def sample(
        self,
        inputs: SampleInputs,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        adapter_name: str = "",
        *,
        num_samples: int | None = None,
        on_invalid: OnInvalid = "raise",
        adapter_path: str | os.PathLike[str] | None = None,
    ) -> list[SampleResponse]:
        """Sample completions.

        Args:
            inputs: an ``InputFeature``, a ``Trajectory`` (or their dicts), or a
                list mixing them. A single one is one input.
            sampling_params: a ``SamplingParams``, a plain dict, or ``None`` (defaults).
            adapter_name: a loaded LoRA adapter, or ``""`` for the base model.
            num_samples: completions per input; overrides ``sampling_params.num_samples``
                (giving both with different values is an error).
            on_invalid: ``"raise"`` (default): any invalid input raises before
                anything is generated. ``"skip"``: each invalid input (its
                structure, its encoding, its length) gets a ``SampleResponse``
                with ``error`` set and no sequences; the rest are sampled.
            adapter_path: a PEFT adapter folder to sample with, instead of
                ``adapter_name``: it is loaded on first use under the name
                ``"path:<absolute folder>"`` (what sequences carry), and loaded
                again when its weights file changes (a trainer saving each step
                to the same folder).

        Returns:
            One ``SampleResponse`` per input, in input order, each with exactly
            ``num_samples`` sequences (unless skipped).

        Raises:
            InvalidSamplingParams: a bad parameter value, or one outside the engine's limits.
            UnsupportedFeatureError: a parameter the engine does not honour.
            InvalidInputError: a malformed input (with ``on_invalid="raise"``).
            UnknownAdapterError: ``adapter_name`` is not loaded.
        """
        adapter_name = self._adapter_from_path(adapter_name, adapter_path)
        feed, call = self._calls.check(inputs, sampling_params, adapter_name, num_samples, on_invalid)
        if call is not None:
            self._calls.execute(feed, call)  # in this thread: the same work submit() does in its own
        return feed.handle.result()

    def submit(
        self,
        inputs: SampleInputs,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        adapter_name: str = "",
        *,
        num_samples: int | None = None,
        on_invalid: OnInvalid = "raise",
        adapter_path: str | os.PathLike[str] | None = None,
    ) -> SampleHandle:
        """Start a ``sample()`` call in the background and return its handle at once.

        The arguments are those of :meth:`sample`, checked now (a bad parameter
        or an unknown adapter raises here). ``handle.result()`` then returns
        exactly what ``sample()`` would, or raises what it would raise;
        ``handle.as_completed()`` (or ``async for``) streams sequences as they
        finish; ``handle.abort()`` stops them. Calls submitted together are
        batched together on engines that sample concurrently.
        """
        adapter_name = self._adapter_from_path(adapter_name, adapter_path)
        feed, call = self._calls.check(inputs, sampling_params, adapter_name, num_samples, on_invalid)
        if call is not None:
            self._calls.execute(feed, call, background=True)
        return feed.handle

    async def asample(
        self,
        inputs: SampleInputs,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        adapter_name: str = "",
        *,
        num_samples: int | None = None,
        on_invalid: OnInvalid = "raise",
        adapter_path: str | os.PathLike[str] | None = None,
    ) -> list[SampleResponse]:
        """``sample()`` for asyncio code: awaits the call without blocking the running event loop.

        Cancelling the awaiting task aborts the call: nobody is left to read its sequences.
        """
        handle = self.submit(
            inputs,
            sampling_params,
            adapter_name,
            num_samples=num_samples,
            on_invalid=on_invalid,
            adapter_path=adapter_path,
        )
        try:
            return await handle
        except asyncio.CancelledError:
            handle.abort()
            raise

    def abort_all(self) -> int:
        """Abort every call in flight (see ``SampleHandle.abort``); returns how many were."""
        live = self._state.live_calls()
        for feed in live:
            feed.handle.abort()
        return len(live)

    def resume(self, handle: SampleHandle) -> SampleHandle:
        """Continue the aborted sequences of a finished call under the current weights (``handle.resume()``)."""
        return handle.resume()

    def _adapter_from_path(self, adapter_name: str, adapter_path: str | os.PathLike[str] | None) -> str:
        """The adapter name a call uses: ``adapter_name``, or the folder ``adapter_path`` loaded under its own name."""
        if adapter_path is None:
            return adapter_name
        if adapter_name:
            raise InvalidInputError(
                f"sample() got adapter_name={adapter_name!r} and adapter_path={str(adapter_path)!r}: give one of them."
            )
        if not isinstance(adapter_path, (str, os.PathLike)):
            raise InvalidInputError(f"adapter_path={adapter_path!r} is invalid: expected a PEFT adapter folder.")
        folder = Path(adapter_path).expanduser().resolve()
        name = f"path:{folder}"
        stamp = tuple(
            (f.name, f.stat().st_mtime_ns, f.stat().st_size)
            for f in sorted(folder.glob("adapter_model.*"))
            if f.is_file()
        )
        with self._path_lock:
            if not self._state.has_adapter(name) or self._path_stamps.get(name) != stamp:
                self.add_adapter_to_model(name, str(folder))
                self._path_stamps[name] = stamp
        return name

    @property
    def _sample(self) -> Callable[..., list[SampleResponse]]:
        """What the Ray replica host calls: a share of a call the driver checked (``Calls.run_checked``)."""
        return self._calls.run_checked

    def _make_sequence(
        self,
        prompt_ids: list[int],
        tokens: list[int],
        *,
        stop_reason: str,
        adapter_name: str,
        text: str | None = None,
        stop: str | int | None = None,
        logprobs: list[float] | None = None,
        top_logprobs: Any = None,
        weights_version: int | None = None,
        sampling_mask: SamplingMask | None = None,
    ) -> SampledSequence:
        """Build a ``SampledSequence`` with its text, version and training feature.

        ``weights_version`` defaults to the current one (stable while the engine runs).
        """
        tokens = [int(t) for t in tokens]
        if text is None:
            text = self.template.decode(tokens)
        feature = (
            self._template.training_feature(prompt_ids, tokens)
            if self._template is not None
            else training_feature(prompt_ids, tokens)
        )
        return SampledSequence(
            tokens=tokens,
            text=text,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            stop_reason=stop_reason,  # type: ignore[arg-type]
            stop=stop,
            weights_version=self._state.version if weights_version is None else weights_version,
            adapter_name=adapter_name,
            training_feature=feature,
            sampling_mask=sampling_mask,
        )

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SamplerClosedError(f"This {type(self).__name__} is closed; create a new sampler.")

    def close(self) -> None:
        """Release the engine. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        self._close()

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass


def __getattr__(name: str) -> Any:
    # Seed compatibility: ``from twinkle_core.sampler import vLLMSampler`` finds the
    # registered engine whose class has that name, importing only that engine.
    if not name.startswith("_"):
        from twinkle_core.plugins.engines import engine_class_named

        cls = engine_class_named(name)
        if cls is not None:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
