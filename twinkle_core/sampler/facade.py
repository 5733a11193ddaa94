"""The ``Sampler`` users hold: a facade over its parts, around an engine.

An engine is a :class:`twinkle_core.engine.Engine` object, built by
``Sampler(EngineClass, *args, **kwargs)``; ``Sampler`` itself is final (a
subclass may only name an engine's constructor). Everything a user calls
(``sample``, ``add_adapter_to_model``, ``update_weights``...) is here, and
done by the parts, each built before the engine and given what it uses:
the policy state (``policy``), the template slot (``templates``), the
sequence builder (``sequences``), the engine's context (``context``), then,
once the engine exists, the call path (``calls``), the adapter changes
(``adapters``) and the weight updates (``weights``). None holds the
``Sampler``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from twinkle_core.data_format import InputFeature, SampleResponse, SamplingParams, Trajectory
from twinkle_core.engine import Engine, EngineInfo
from twinkle_core.errors import ConfigError
from twinkle_core.inputs import OnInvalid, SampleInputs
from twinkle_core.requests import SampleHandle
from twinkle_core.sampler.adapters import Adapters
from twinkle_core.sampler.calls import Calls
from twinkle_core.sampler.context import PartsContext
from twinkle_core.sampler.policy import AdapterInfo, Lifecycle, PolicyState
from twinkle_core.sampler.sequences import SequenceBuilder
from twinkle_core.sampler.templates import TemplateSlot
from twinkle_core.sampler.weights import update_weights
from twinkle_core.template import Template

__all__ = ["Sampler", "require_engine_class"]

S = TypeVar("S", bound="Sampler")


#: The names of ``Sampler`` a subclass may define: its constructor, and what names its engine.
_SUBCLASS_MAY_SET = frozenset({"engine"})


def require_engine_class(engine: Any) -> None:
    """Refuse what ``Sampler(engine, ...)`` cannot build (here, and in the driver before any Ray replica starts)."""
    if not (isinstance(engine, type) and issubclass(engine, Engine)):
        raise ConfigError(
            f"Sampler(engine=...) got {engine!r}: expected a twinkle_core.engine.Engine subclass, which the"
            " sampler builds as engine(context, *args, **kwargs)."
        )


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

    For the Ray replica host: ``_restore_version(version)`` after a replay,
    and ``_sample(items, params, adapter_name, on_invalid, indices)``, which
    runs a share of a call whose arguments the driver checked (lock held
    shared, adapter checked, inputs named by their place in the whole call).
    A state-change hook may raise ``AppliedWithError`` (the Ray engine, when
    only some replicas applied a change): the change is recorded, then its
    error raised.
    """

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
        # The parts the engine's context is made of exist before the engine; the rest take the engine.
        self._policy = PolicyState()
        self._templates = TemplateSlot(self._policy.lock)
        self._sequences = SequenceBuilder(self._templates, lambda: self._policy.version)
        built = engine(PartsContext(self._templates, self._sequences, self._policy), *args, **kwargs)
        info = getattr(built, "info", None)
        if not isinstance(info, EngineInfo):
            built.close()
            raise ConfigError(
                f"{engine.__name__} did not set self.info to an EngineInfo in its constructor (got {info!r})."
            )
        self._engine = built
        self._lifecycle = Lifecycle(type(self).__name__)
        self._calls = Calls(built, self._policy, self._templates, self._sequences, self._lifecycle)
        self._adapters = Adapters(built, self._policy, self._lifecycle)

    def __repr__(self) -> str:
        return f"Sampler({self._engine!r})"

    @property
    def engine(self) -> Engine:
        """The engine this sampler runs."""
        return self._engine

    @property
    def engine_name(self) -> str:
        """The registry name of the engine (``"torch"``, ``"vllm"``), for messages: its ``info.name``."""
        return self._engine.info.name

    @property
    def supported_params(self) -> frozenset[str]:
        """The ``SamplingParams`` fields the engine honours: its ``info.supported_params``."""
        return self._engine.info.supported_params

    @property
    def concurrent_samples(self) -> bool:
        """Whether the engine's runs may overlap: its ``info.concurrent``."""
        return self._engine.info.concurrent

    @property
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) the engine accepts, in tokens."""
        return self._engine.info.max_model_len

    @property
    def vocab_size(self) -> int | None:
        """Number of token ids the model accepts (``None``: unchecked)."""
        return self._engine.info.vocab_size

    # -- template ------------------------------------------------------------------------
    @property
    def template(self) -> Template:
        """The template that encodes trajectories and decodes tokens."""
        return self._templates.template

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer."""
        return self._templates.template.tokenizer

    def set_template(self, template: type[Template] | Template | str, **kwargs: Any) -> None:
        """Set the chat template: a registered name, a ``Template`` class or an instance.

        Waits for the samples in flight; later samples use the new template.

        Raises:
            UnknownTemplateError: an unknown name (with did-you-mean).
            TemplateError: anything else that is not a template, or options its class does not take.
        """
        self._templates.set(template, kwargs, self._engine.template_changed)

    # -- adapters ------------------------------------------------------------------------
    @property
    def adapters(self) -> Mapping[str, AdapterInfo]:
        """The loaded LoRA adapters by name (read-only)."""
        return self._policy.adapters

    def adapter_id(self, name: str) -> int:
        """The stable integer id of a loaded adapter."""
        return self._policy.require_adapter(name).adapter_id

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
        return self._adapters.add(
            adapter_name,
            config_or_dir,
            weights=weights,
            version=version,
            check_finite=check_finite,
            in_flight=in_flight,
            options=kwargs,
        )

    def remove_adapter(self, adapter_name: str, *, in_flight: str = "wait") -> None:
        """Unload an adapter (after the samples in flight finish, or as ``in_flight`` says).

        Under ``in_flight="keep"`` the calls of other adapters continue; a call
        sampling this one cannot, and its unfinished sequences come back as
        ``"abort"`` leaves them, with the tokens it generated.

        Raises:
            UnknownAdapterError: it is not loaded.
        """
        self._adapters.remove(adapter_name, in_flight=in_flight)

    # -- weights -------------------------------------------------------------------------
    @property
    def weights_version(self) -> int:
        """Bumped by every ``update_weights`` and adapter (re)load; 0 at start."""
        return self._policy.version

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
        self._lifecycle.check_open()
        return update_weights(
            self._engine,
            self._policy,
            named_tensors,
            version=version,
            check_finite=check_finite,
            in_flight=in_flight,
        )

    # -- sampling ------------------------------------------------------------------------
    def encode(
        self, item: InputFeature | Trajectory, *, max_tokens: int | None = None, keep_last: int | None = None
    ) -> InputFeature:
        """The prompt feature of one input (trajectories go through the template).

        ``max_tokens`` and ``keep_last`` bound the work on a trajectory, as
        :meth:`Template.encode` takes them; a feature is returned as it is.
        """
        return self._templates.encode(item, max_tokens=max_tokens, keep_last=keep_last)

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
        adapter_name = self._adapters.from_path(adapter_name, adapter_path)
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
        adapter_name = self._adapters.from_path(adapter_name, adapter_path)
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
        live = self._policy.live_calls()
        for feed in live:
            feed.handle.abort()
        return len(live)

    def resume(self, handle: SampleHandle) -> SampleHandle:
        """Continue the aborted sequences of a finished call under the current weights (``handle.resume()``)."""
        return handle.resume()

    def _restore_version(self, version: int) -> None:
        """Raise ``weights_version`` to ``version`` (the Ray replica host, after replaying a replica's state)."""
        self._policy.restore_version(version)

    @property
    def _sample(self) -> Callable[..., list[SampleResponse]]:
        """What the Ray replica host calls: a share of a call the driver checked (``Calls.run_checked``)."""
        return self._calls.run_checked

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._lifecycle.closed

    def close(self) -> None:
        """Release the engine. Closing twice is harmless."""
        if self._lifecycle.closed:
            return
        self._lifecycle.closed = True
        self._engine.close()

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            lifecycle = getattr(self, "_lifecycle", None)  # none: the constructor failed
            if lifecycle is not None and not lifecycle.closed:
                self.close()
        except Exception:
            pass
