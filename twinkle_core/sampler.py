"""The ``Sampler`` spec every engine implements, and the input handling they share.

Engines subclass :class:`Sampler` and implement a handful of hooks
(``_generate``, ``max_model_len`` and, when supported, ``_load_adapter``,
``_remove_adapter``, ``_update_weights``, ``_close``). Everything a user calls
(``sample``, ``add_adapter_to_model``, ``update_weights``...) lives here, so
input normalisation, validation, error messages and versioning are the same
for every engine.

``from twinkle_core.sampler import vLLMSampler, TorchSampler`` resolves the
engine classes lazily through the registry: importing one never imports the
other.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, ABCMeta, abstractmethod
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any, Literal, TypeVar

import attrs

from twinkle_core.data_format import (
    InputFeature,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    Trajectory,
    training_feature,
)
from twinkle_core.errors import did_you_mean
from twinkle_core.errors import (
    InvalidInputError,
    InvalidSamplingParams,
    PromptTooLongError,
    SamplerClosedError,
    TwinkleError,
    UnknownAdapterError,
    UnsupportedFeatureError,
    WeightUpdateError,
)
from twinkle_core.template import Template, get_template, load_tokenizer

__all__ = ["AdapterInfo", "Sampler", "SampleInputs", "normalize_inputs", "resolve_params"]

S = TypeVar("S", bound="Sampler")
SampleInputs = InputFeature | Trajectory | dict[str, Any] | list[InputFeature | Trajectory | dict[str, Any]]
OnInvalid = Literal["raise", "skip"]


@attrs.frozen
class AdapterInfo:
    """A loaded LoRA adapter, as ``Sampler.adapters`` shows it.

    Attributes:
        name: the name ``sample(..., adapter_name=...)`` selects it by.
        adapter_id: a stable integer id for the name (engines key caches on it).
        version: the sampler's ``weights_version`` when it was (re)loaded.
        source: the folder it came from, or ``"<memory>"``.
    """

    name: str
    adapter_id: int
    version: int
    source: str


def resolve_params(
    sampling_params: SamplingParams | dict[str, Any] | None, num_samples: int | None
) -> SamplingParams:
    """Merge ``sampling_params`` and the ``num_samples`` keyword.

    Raises:
        InvalidSamplingParams: bad values, or ``num_samples`` given both ways with different values.
    """
    params = SamplingParams.coerce(sampling_params)
    if num_samples is None:
        return params
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise InvalidSamplingParams(f"num_samples={num_samples!r} is invalid: expected an integer >= 1.")
    explicit = sampling_params is not None and (
        (isinstance(sampling_params, dict) and ("num_samples" in sampling_params or "n" in sampling_params))
        or (isinstance(sampling_params, SamplingParams) and params.num_samples != 1)
    )
    if explicit and params.num_samples != num_samples:
        raise InvalidSamplingParams(
            f"num_samples={num_samples} conflicts with SamplingParams.num_samples={params.num_samples}:"
            " give it once, or give the same value."
        )
    return params.replace(num_samples=num_samples)


def _one_input(item: Any, index: int) -> InputFeature | Trajectory:
    if isinstance(item, (InputFeature, Trajectory)):
        return item
    if isinstance(item, dict):
        if "messages" in item:
            return Trajectory.from_dict(item)
        if "input_ids" in item:
            return InputFeature.from_dict(item)
        if "role" in item:
            raise InvalidInputError(
                f"inputs[{index}] is a single chat message ({item!r:.80}); wrap the conversation in"
                " Trajectory(messages=[...]) or {'messages': [...]}."
            )
    raise InvalidInputError(
        f"inputs[{index}]={item!r:.80} is invalid: expected an InputFeature, a Trajectory, or a dict with"
        " 'messages' or 'input_ids'."
    )


def normalize_inputs(inputs: SampleInputs) -> list[InputFeature | Trajectory]:
    """Turn what ``sample()`` accepts into a flat list (a single input becomes a list of one)."""
    if isinstance(inputs, (InputFeature, Trajectory, dict)):
        return [_one_input(inputs, 0)]
    if isinstance(inputs, (list, tuple)):
        return [_one_input(x, i) for i, x in enumerate(inputs)]
    raise InvalidInputError(
        f"inputs={inputs!r:.80} is invalid: expected an InputFeature, a Trajectory, or a list of either."
    )


class SamplerMeta(ABCMeta):
    """Lets every engine take ``remote_group=``: then it is built as Ray replicas (``twinkle_core.remote``)."""

    def __call__(cls, *args: Any, remote_group: str | None = None, **kwargs: Any) -> Any:
        if remote_group is None:
            return super().__call__(*args, **kwargs)
        from twinkle_core.remote.sampler import build_remote

        return build_remote(cls, remote_group, args, kwargs)


class Sampler(ABC, metaclass=SamplerMeta):
    """Generates completions from a language model. Engines subclass it.

    Any engine built with ``remote_group="name"`` (after
    ``twinkle_core.initialize("ray", groups=[...])``) runs as
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
    """

    #: The registry name of the engine (``"torch"``, ``"vllm"``), for messages.
    engine_name: str = ""

    def __init__(self) -> None:
        self._template: Template | None = None
        self._tokenizer: Any = None
        self._adapters: dict[str, AdapterInfo] = {}
        self._next_adapter_id = 1
        self._weights_version = 0
        self._closed = False
        self._admin_lock = threading.RLock()

    # -- engine hooks ------------------------------------------------------------------
    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """The longest sequence (prompt + completion) the engine accepts, in tokens."""

    @property
    def vocab_size(self) -> int | None:
        """Number of token ids the model accepts (``None``: unchecked)."""
        return None

    @abstractmethod
    def _generate(
        self, prompts: list[InputFeature], params: SamplingParams, adapter_name: str
    ) -> list[SampleResponse]:
        """Generate for already-validated prompts: one response per prompt, in order.

        Each response holds ``params.num_samples`` sequences built with
        :meth:`_make_sequence`.
        """

    def _load_adapter(self, name: str, config_or_dir: Any, *, weights: Any = None, **kwargs: Any) -> str:
        """Load (or replace) a LoRA adapter; return its source for listings."""
        raise UnsupportedFeatureError(f"The {self.engine_name or type(self).__name__} engine has no LoRA support.")

    def _remove_adapter(self, name: str) -> None:
        """Unload a LoRA adapter."""
        raise UnsupportedFeatureError(f"The {self.engine_name or type(self).__name__} engine has no LoRA support.")

    def _update_weights(self, named_tensors: list[tuple[str, Any]]) -> None:
        """Validate then apply new base weights (all or nothing)."""
        raise UnsupportedFeatureError(
            f"The {self.engine_name or type(self).__name__} engine cannot update weights."
        )

    def _close(self) -> None:
        """Release the engine's resources."""

    def _on_template_changed(self) -> None:
        """Called after ``set_template`` (engines caching template data override it)."""

    # -- template ------------------------------------------------------------------------
    def _init_template(self, template: Any, model_dir: str | os.PathLike[str] | None) -> None:
        """Load the tokenizer of ``model_dir`` and set ``template`` (default: its own chat template)."""
        if isinstance(template, Template):
            self._tokenizer = template.tokenizer
            self._template = template
            return
        if model_dir is not None:
            self._tokenizer = load_tokenizer(model_dir)
        self.set_template(template if template is not None else Template)

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

        Raises:
            UnknownTemplateError: an unknown name (with did-you-mean).
        """
        if isinstance(template, str):
            template = get_template(template)
        if isinstance(template, type) and issubclass(template, Template):
            tokenizer = self._tokenizer if self._tokenizer is not None else getattr(self._template, "tokenizer", None)
            if tokenizer is None:
                raise TwinkleError("This sampler has no tokenizer to build the template with; pass an instance.")
            template = template(tokenizer, **kwargs)
        elif kwargs:
            raise TypeError(f"set_template got keyword arguments {sorted(kwargs)} with a Template instance.")
        if not isinstance(template, Template):
            raise TypeError(
                f"set_template expects a registered name, a Template subclass or instance; got {template!r}."
            )
        self._template = template
        self._tokenizer = template.tokenizer
        self._on_template_changed()

    # -- adapters ------------------------------------------------------------------------
    @property
    def adapters(self) -> Mapping[str, AdapterInfo]:
        """The loaded LoRA adapters by name (read-only)."""
        return MappingProxyType(dict(self._adapters))

    def adapter_id(self, name: str) -> int:
        """The stable integer id of a loaded adapter."""
        return self._require_adapter(name).adapter_id

    def _require_adapter(self, name: str) -> AdapterInfo:
        if not isinstance(name, str):
            raise UnknownAdapterError(f"adapter_name={name!r} is invalid: expected a string ('' = base model).")
        info = self._adapters.get(name)
        if info is None:
            loaded = ", ".join(sorted(self._adapters)) or "(none)"
            raise UnknownAdapterError(
                f"Unknown adapter {name!r}.{did_you_mean(name, list(self._adapters))} Loaded adapters: {loaded};"
                " use '' for the base model, or add it with add_adapter_to_model()."
            )
        return info

    def add_adapter_to_model(
        self, adapter_name: str, config_or_dir: Any, *, weights: Any = None, version: int | None = None, **kwargs: Any
    ) -> int:
        """Load a PEFT LoRA adapter under ``adapter_name``, or replace it in place.

        Args:
            adapter_name: the name ``sample(adapter_name=...)`` selects it by (not ``""``).
            config_or_dir: a PEFT adapter folder, or a ``peft.LoraConfig`` (or
                its dict) with ``weights``.
            weights: the adapter's tensors by PEFT name, with a config.
            version: the new ``weights_version`` (default: current + 1).

        Returns:
            The sampler's new ``weights_version``: samples drawn after this call carry it.

        Raises:
            AdapterError: the folder is missing or malformed, or the weights do not fit.
        """
        self._check_open()
        if not isinstance(adapter_name, str) or not adapter_name:
            raise InvalidInputError(f"adapter_name={adapter_name!r} is invalid: expected a non-empty string.")
        with self._admin_lock:
            new_version = self._next_version(version)
            source = self._load_adapter(adapter_name, config_or_dir, weights=weights, **kwargs)
            old = self._adapters.get(adapter_name)
            adapter_id = old.adapter_id if old is not None else self._next_adapter_id
            if old is None:
                self._next_adapter_id += 1
            self._adapters[adapter_name] = AdapterInfo(adapter_name, adapter_id, new_version, str(source))
            self._weights_version = new_version
            return new_version

    def remove_adapter(self, adapter_name: str) -> None:
        """Unload an adapter.

        Raises:
            UnknownAdapterError: it is not loaded.
        """
        self._check_open()
        with self._admin_lock:
            self._require_adapter(adapter_name)
            self._remove_adapter(adapter_name)
            del self._adapters[adapter_name]

    # -- weights -------------------------------------------------------------------------
    @property
    def weights_version(self) -> int:
        """Bumped by every ``update_weights`` and adapter (re)load; 0 at start."""
        return self._weights_version

    def _next_version(self, version: int | None) -> int:
        if version is None:
            return self._weights_version + 1
        if isinstance(version, bool) or not isinstance(version, int) or version <= self._weights_version:
            raise WeightUpdateError(
                f"version={version!r} is invalid: expected an integer greater than the current"
                f" weights_version {self._weights_version} (or None to increment it)."
            )
        return version

    def update_weights(
        self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], *, version: int | None = None
    ) -> int:
        """Replace base-model weights (names as in the model's Hugging Face ``state_dict``).

        Everything is validated (names, shapes, dtypes) before anything is
        applied: a rejected update changes nothing.

        Returns:
            The new ``weights_version``, carried by every later sample.
        """
        self._check_open()
        items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise WeightUpdateError(f"named_tensors[{i}] is invalid: expected a (name, tensor) pair.")
        if not items:
            raise WeightUpdateError("update_weights got no tensors.")
        with self._admin_lock:
            new_version = self._next_version(version)
            self._update_weights(items)
            self._weights_version = new_version
            return new_version

    # -- sampling ------------------------------------------------------------------------
    def encode(self, item: InputFeature | Trajectory) -> InputFeature:
        """The prompt feature of one input (trajectories go through the template)."""
        if isinstance(item, InputFeature):
            return item
        return self.template.encode(item, add_generation_prompt=True)

    def _validate_prompt(self, feature: InputFeature, index: int, params: SamplingParams) -> None:
        if not feature.input_ids:
            raise InvalidInputError(f"inputs[{index}] has no tokens: a prompt needs at least one.")
        vocab = self.vocab_size
        if vocab is not None:
            bad = [t for t in feature.input_ids if t < 0 or t >= vocab]
            if bad:
                raise InvalidInputError(
                    f"inputs[{index}] has token id {bad[0]} outside the vocabulary [0, {vocab})."
                )
        limit = self.max_model_len - (1 if params.max_tokens > 0 else 0)
        if len(feature.input_ids) > limit:
            raise PromptTooLongError(
                f"inputs[{index}] has {len(feature.input_ids)} prompt tokens but the model accepts at most"
                f" {limit} (max_model_len={self.max_model_len}). Shorten it, or pass on_invalid='skip' to"
                " sample the other inputs.",
                index=index,
                length=len(feature.input_ids),
                limit=limit,
            )

    def sample(
        self,
        inputs: SampleInputs,
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        adapter_name: str = "",
        *,
        num_samples: int | None = None,
        on_invalid: OnInvalid = "raise",
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
                anything is generated. ``"skip"``: invalid inputs get a
                ``SampleResponse`` with ``error`` set and no sequences; the rest are sampled.

        Returns:
            One ``SampleResponse`` per input, in input order, each with exactly
            ``num_samples`` sequences (unless skipped).
        """
        params, items = self._start_call(inputs, sampling_params, adapter_name, num_samples, on_invalid)
        return self._sample_items(items, params, adapter_name, on_invalid)

    def _start_call(
        self,
        inputs: SampleInputs,
        sampling_params: SamplingParams | dict[str, Any] | None,
        adapter_name: str,
        num_samples: int | None,
        on_invalid: OnInvalid,
    ) -> tuple[SamplingParams, list[InputFeature | Trajectory]]:
        """The checks of every ``sample()`` before any work: open, ``on_invalid``, parameters, inputs, adapter.

        The adapter is checked only when there are inputs (an empty call returns ``[]``).
        """
        self._check_open()
        if on_invalid not in ("raise", "skip"):
            raise InvalidInputError(f"on_invalid={on_invalid!r} is invalid: expected 'raise' or 'skip'.")
        params = resolve_params(sampling_params, num_samples)
        items = normalize_inputs(inputs)
        if items and (adapter_name or not isinstance(adapter_name, str)):
            self._require_adapter(adapter_name)
        return params, items

    def _sample_items(
        self,
        items: list[InputFeature | Trajectory],
        params: SamplingParams,
        adapter_name: str,
        on_invalid: OnInvalid,
        indices: list[int] | None = None,
    ) -> list[SampleResponse]:
        """Encode and check each input, generate the valid ones, and answer in input order.

        An invalid input raises, or with ``on_invalid="skip"`` gets a response
        with ``error`` set. Errors name input ``k`` as ``inputs[indices[k]]``
        (default ``k``): a Ray replica serving a share of a call names each by
        its place in the whole call.
        """
        features: list[InputFeature | None] = []
        errors: dict[int, TwinkleError] = {}
        for k, item in enumerate(items):
            feature: InputFeature | None = item if isinstance(item, InputFeature) else None
            try:
                feature = self.encode(item)
                self._validate_prompt(feature, k if indices is None else indices[k], params)
            except TwinkleError as exc:
                if on_invalid == "raise" or not isinstance(exc, ValueError):
                    raise
                errors[k] = exc
            features.append(feature)
        valid = [f for k, f in enumerate(features) if k not in errors and f is not None]
        generated = iter(self._generate(valid, params, adapter_name) if valid else [])
        out: list[SampleResponse] = []
        for k, feature in enumerate(features):
            if k in errors:
                ids = feature.input_ids if feature is not None else []
                out.append(SampleResponse(prompt_token_ids=list(ids), error=str(errors[k])))
            else:
                out.append(next(generated))
        return out

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
    ) -> SampledSequence:
        """Build a ``SampledSequence`` with its text, version and training feature."""
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
            weights_version=self._weights_version if weights_version is None else weights_version,
            adapter_name=adapter_name,
            training_feature=feature,
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
