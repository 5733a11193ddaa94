"""``TorchEngine``: the ``torch`` engine, on PyTorch + ``transformers``.

Users build it through ``TorchSampler(...)`` (:mod:`twinkle_torch.sampler`),
``create_sampler("torch", ...)`` or ``Sampler(TorchEngine, ...)``: the core's
``Sampler`` holds it and calls it through the ``twinkle_core.engine`` contract.

It loads any ``AutoModelForCausalLM`` and samples with its own batched decode
loop (:mod:`twinkle_torch.decoding`) rather than ``model.generate``: a KV
cache written in place, one prefill per prompt shared by its samples,
vectorised sampling, finished rows dropped from the batch, batches bounded by
a token budget. LoRA adapters go in through PEFT (:mod:`twinkle_torch.adapters`),
weight updates by ``state_dict`` name (:mod:`twinkle_torch.weights`).

The engine declares ``concurrent=True``: concurrent calls (threads
calling ``sample()``, or ``submit()``) all hand their rows to one decode loop,
which batches them continuously: a call arriving while others decode joins
them at the next step (:class:`~twinkle_torch.decoding.Decoder`). PEFT runs
one adapter at a time, so rows of different adapters never share a batch: a
call with another adapter waits until the running batch drains. The sampler
keeps adapter and weight changes apart from every run (its readers-writer
lock), so every sequence's ``weights_version`` is the version its tokens came from.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from twinkle_core.data_format import SampledSequence, SampleResponse
from twinkle_core.engine import (
    AdapterInput,
    DeviceMesh,
    Engine,
    EngineContext,
    EngineInfo,
    EngineRun,
    MergedLoRA,
    check_merge_flag,
    lora_deltas,
)
from twinkle_core.errors import (
    AdapterError,
    ConfigError,
    IncompleteUpdateError,
    InvalidMeshError,
    UnsupportedFeatureError,
    WeightUpdateError,
    did_you_mean,
)
from twinkle_core.hub import resolve_model_id
from twinkle_torch.adapters import AdapterSet
from twinkle_torch.attention import ATTN_IMPLEMENTATION, NATIVE_ATTN_IMPLEMENTATION
from twinkle_torch.attention import register as register_attention
from twinkle_torch.cache import make_cache
from twinkle_torch.decoding import Decoder
from twinkle_torch.linear import available as onednn_available
from twinkle_torch.linear import use_onednn
from twinkle_torch.native import KernelUnavailable
from twinkle_torch.native import load as load_native_kernel
from twinkle_torch.openmp import release_idle_workers, releasing
from twinkle_torch.routes import RouteRecorder
from twinkle_torch.rows import RunControl, SequenceResult
from twinkle_torch.state import StateLayer, carries_state
from twinkle_torch.weights import WeightTable

__all__ = ["DEFAULT_MAX_BATCH_TOKENS", "SUPPORTED_PARAMS", "TorchEngine"]

#: Default KV-cache budget of one batch, in tokens (rows x (prompt + max_tokens)).
DEFAULT_MAX_BATCH_TOKENS = 65536

#: The ``SamplingParams`` fields the engine honours, by name (a field added later is refused until listed).
SUPPORTED_PARAMS = frozenset(
    {
        "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
        "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs", "logprobs_mode", "num_samples",
        "return_sampling_mask", "return_routed_experts", "presence_penalty", "frequency_penalty", "min_tokens",
        "logit_bias", "allowed_token_ids", "bad_words", "include_stop_str_in_output", "skip_special_tokens",
        "spaces_between_special_tokens", "structured_outputs",
    }
)  # fmt: skip

_LINEAR_KERNELS = ("auto", "onednn", "onednn-packed", "torch")
_ATTENTION_KERNELS = ("auto", "native", "sdpa")

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _check_mesh(device_mesh: Any) -> None:
    if device_mesh is None:
        return
    if isinstance(device_mesh, Mapping):
        device_mesh = DeviceMesh.from_sizes(**{str(k): v for k, v in device_mesh.items()})
    if not isinstance(device_mesh, DeviceMesh):
        raise InvalidMeshError(f"device_mesh={device_mesh!r} is invalid: expected a DeviceMesh, a dict or None.")
    if device_mesh.tp_size > 1:
        raise InvalidMeshError(
            f"TorchSampler has no tensor parallelism: DeviceMesh(tp_size={device_mesh.tp_size}) is not supported."
            " Use tp_size=1 (replicate it with dp_size= and remote_group=), or the 'vllm' engine for tensor"
            " parallelism."
        )
    if device_mesh.dp_size > 1:
        raise InvalidMeshError(
            f"DeviceMesh(dp_size={device_mesh.dp_size}) needs remote execution: one TorchSampler is one engine in"
            " this process. Call twinkle_core.initialize('ray', groups=[DeviceGroup(name='sampler', ranks=...)])"
            " and build it with remote_group='sampler' to run dp_size replicas."
        )


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device={device!r} is invalid: expected 'cpu', 'cuda', 'cuda:N' or None.") from exc
    if dev.type not in ("cpu", "cuda"):  # the engine runs and is tested on these two only
        raise ConfigError(f"device={device!r} is not supported by the torch engine: expected 'cpu', 'cuda', 'cuda:N'.")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} asks for CUDA, but torch sees no CUDA device here; use 'cpu'.")
    return dev


def _resolve_dtype(dtype: str | torch.dtype, config: Any, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ConfigError(f"dtype={dtype!r} is invalid: expected a floating-point dtype, e.g. {sorted(_DTYPES)}.")
        return dtype
    if not isinstance(dtype, str):
        raise ConfigError(f"dtype={dtype!r} is invalid: expected 'auto', a torch dtype or one of {sorted(_DTYPES)}.")
    if dtype != "auto":
        if dtype.lower() not in _DTYPES:
            raise ConfigError(
                f"dtype={dtype!r} is invalid: expected 'auto', a torch dtype or one of {sorted(_DTYPES)}."
            )
        return _DTYPES[dtype.lower()]
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = _DTYPES.get(stored.lower(), getattr(torch, stored, None))
    if not isinstance(stored, torch.dtype) or not stored.is_floating_point:
        stored = torch.float32
    if device.type == "cpu" and stored in (torch.float16, torch.bfloat16):
        return torch.float32  # half-precision matmuls on CPU are slow and imprecise
    return stored


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(e) for e in eos)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return sorted(ids)


def _load_model(
    path: Any,
    config: Any,
    dtype: torch.dtype,
    trust_remote_code: bool,
    model_kwargs: dict[str, Any],
    attention: str | None,
) -> Any:
    """``AutoModelForCausalLM.from_pretrained``, with the attention implementation ``attention`` when it fits.

    It fits a model class that routes its attention through ``transformers``'
    attention interface (``_supports_attention_backend``). Others (MPT, Bloom,
    XGLM...) compute attention in code of their own and read the masks made
    for it: they keep ``transformers``' default. A model with a recurrent state
    is refused unless it is a Gated DeltaNet hybrid (Qwen3.5, Qwen3-Next),
    whose state :mod:`twinkle_torch.state` carries; Mamba, RWKV and the other
    hybrids are refused by name.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code, **model_kwargs}
    cls = _causal_lm_class(config)
    if cls is not None and getattr(cls, "_is_stateful", False) and not carries_state(config):
        raise _recurrent(cls.__name__)
    if cls is not None and not getattr(cls, "_supports_attention_backend", False):
        attention = None
    try:
        if attention is not None:
            register_attention()
            try:
                return AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=attention, **kwargs)
            except (ValueError, KeyError):  # an architecture without pluggable attention: its own default
                pass
        return AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except (OSError, SafetensorError) as exc:  # a config without weights, unreadable weights
        raise ConfigError(f"{str(path)!r} holds no model transformers can load: {_brief(exc)}") from exc
    except TypeError as exc:  # an option nobody takes: transformers hands unknown ones to the model class
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        if unknown is None or unknown.group(1) not in model_kwargs:
            raise
        name = unknown.group(1)
        options = [n for n in inspect.signature(TorchEngine.__init__).parameters if n not in _NOT_OPTIONS]
        raise ConfigError(
            f"Option {name}={model_kwargs[name]!r:.60} is unknown: the torch engine takes {', '.join(options)},"
            f" and passes others to transformers' from_pretrained, where nothing took it.{did_you_mean(name, options)}"
        ) from None


def _brief(exc: BaseException) -> str:
    """An error's message on one line, at most 300 characters (transformers' run to many lines of advice)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())[:300] or type(exc).__name__


#: Parameters of ``TorchEngine.__init__`` that are not options a user names.
_NOT_OPTIONS = frozenset({"self", "context", "model_kwargs"})


def _recurrent(name: str) -> ConfigError:
    return ConfigError(
        f"{name} keeps a recurrent state (its cache is not only keys and values) of a kind the torch"
        " engine's batched cache cannot carry (it carries Gated DeltaNet states: Qwen3.5, Qwen3-Next);"
        " sample it with an engine that supports it (vllm)."
    )


def _causal_lm_class(config: Any) -> Any:
    """The ``transformers`` class ``AutoModelForCausalLM`` picks for ``config``; ``None`` if unknown (remote code)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


#: The load check's tolerances on log-probs. A causal model's log-probs at a position do not
#: depend on later tokens at all (the same rows through the same kernels): any change is reading
#: ahead. Padding and the cache move them by float rounding only: below ``_DECODE_CHECK_NATS``
#: plus ``_ROUNDING_ULPS`` units of the model dtype's precision at the position's largest logit
#: (see ``_decode_tolerance``).
_CAUSAL_CHECK_NATS = 1e-2
_DECODE_CHECK_NATS = 1.0
_ROUNDING_ULPS = 16


def _decode_tolerance(logits: torch.Tensor, dtype: torch.dtype) -> float:
    """How far padding or the cache may move a position's log-probs, given its raw ``logits``.

    Rounding in the model's dtype moves a logit in proportion to its size:
    bfloat16 keeps 8 significant bits, so SmolLM2's logits of up to 24 in
    bfloat16 moved by up to 1.15 nats between its prefill (SDPA) and a decode
    step (the native kernel, float32 inside), 6 units of bfloat16's precision
    at 24; a model that reads the wrong keys moved them by 95 such units. In
    float32 the allowance adds about 1e-4 nats to ``_DECODE_CHECK_NATS``.
    """
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else 0.0
    return _DECODE_CHECK_NATS + _ROUNDING_ULPS * eps * float(logits.float().abs().max())


def _check_decodes(model: Any, device: torch.device) -> None:
    """Refuse a model the decode loop would sample wrongly: one that is not causal, or ignores its KV cache.

    Four tiny forwards of the model itself, at load: the log-probs of a
    4-token probe must not change when its last token does (a model that
    reads ahead, as a BERT-style encoder loaded with a language-model head
    does, fails); the first three left-padded by one token, with their mask
    and positions, into a cache must give the log-probs they give alone (a
    model that ignores ``position_ids``, as TrOCR's decoder does, fails); and
    the last decoded from that cache must give those of one forward over all
    four (a model that keeps no cache, or ignores the mask over it, fails).

    Raises:
        ConfigError: the model fails a check, naming which.
    """
    name = type(model).__name__
    try:  # a cache layer holding a recurrent (linear-attention, convolution) state: a hybrid model
        from transformers.cache_utils import LinearAttentionCacheLayerMixin as recurrent_layer
    except ImportError:  # pragma: no cover - a transformers without such layers
        recurrent_layer = ()
    cache = make_cache(model.config, 8)
    if recurrent_layer and any(
        isinstance(layer, recurrent_layer) and not isinstance(layer, StateLayer) for layer in cache.layers
    ):
        raise _recurrent(name)
    vocab = int(model.get_input_embeddings().num_embeddings)
    ids = torch.tensor([[1, 2, 3, 4]], device=device) % max(1, vocab)
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % max(1, vocab)
    try:
        with torch.inference_mode():
            raw = model(input_ids=ids).logits
            full = torch.log_softmax(raw.float(), dim=-1)
            changed = torch.log_softmax(model(input_ids=other).logits.float(), dim=-1)
            # the first three tokens left-padded by one (as the loop pads shorter prompts) into a cache,
            # then the fourth decoded from it
            mask = torch.tensor([[0, 1, 1, 1, 1]], device=device)
            prefill = model(
                input_ids=torch.cat([torch.zeros_like(ids[:, :1]), ids[:, :3]], dim=1),
                attention_mask=mask[:, :4],
                position_ids=torch.tensor([[0, 0, 1, 2]], device=device),
                past_key_values=cache,
                use_cache=True,
            )
            padded = torch.log_softmax(prefill.logits[:, -1].float(), dim=-1)
            step = model(
                input_ids=ids[:, 3:],
                attention_mask=mask,
                position_ids=torch.tensor([[3]], device=device),
                past_key_values=cache,
                use_cache=True,
            )
            stepped = torch.log_softmax(step.logits[:, -1].float(), dim=-1)
    except Exception as exc:
        raise ConfigError(
            f"the torch engine cannot decode {name} with a KV cache: {type(exc).__name__}: {exc}"
        ) from exc
    ahead = float((full[:, :3] - changed[:, :3]).abs().max())
    if not ahead <= _CAUSAL_CHECK_NATS:
        raise ConfigError(
            f"{name} is not a causal language model as loaded: changing the 4th token of a probe moved the"
            f" log-probs of the tokens before it by {ahead:.3g} nats (an encoder with a language-model head,"
            " e.g. one whose config has is_decoder=False)."
        )
    dtype = model.get_input_embeddings().weight.dtype
    shift = float((padded - full[:, 2]).abs().max())
    if not shift <= _decode_tolerance(raw[:, 2], dtype):
        raise ConfigError(
            f"{name} does not honour left padding (its attention mask and position ids): a probe left-padded by"
            f" one token moved its log-probs by {shift:.3g} nats, and the torch engine pads shorter prompts."
        )
    drift = float((stepped - full[:, 3]).abs().max())
    if not drift <= _decode_tolerance(raw[:, 3], dtype):
        raise ConfigError(
            f"{name} does not decode from its KV cache as one forward would: the last token of a probe, decoded"
            f" from a left-padded cache of the first three, moved its log-probs by {drift:.3g} nats."
        )


def _check_linear_kernel(kernel: str, device: torch.device) -> None:
    """Refuse a oneDNN linear kernel asked for where it would not run (another device, a build without it)."""
    if not kernel.startswith("onednn"):
        return
    if device.type != "cpu":
        raise ConfigError(f"linear_kernel={kernel!r} runs on CPU only, not on {device}. Use 'auto' or 'torch'.")
    if not onednn_available(packed=kernel == "onednn-packed"):
        raise ConfigError(
            f"linear_kernel={kernel!r} is not available: this PyTorch build has no oneDNN (mkldnn) linear"
            " kernel or weight reorder. Use 'auto' or 'torch'."
        )


def _attention_for(kernel: str, device: torch.device, model_kwargs: Mapping[str, Any]) -> str | None:
    """The attention implementation to load the model with (``None``: ``transformers``' choice or the user's)."""
    if kernel == "native":
        if device.type != "cpu":
            raise ConfigError(f"attention_kernel='native' runs on CPU only, not on {device}. Use 'auto' or 'sdpa'.")
        if "attn_implementation" in model_kwargs:
            raise ConfigError(
                f"attention_kernel='native' and attn_implementation={model_kwargs['attn_implementation']!r}"
                " both choose the attention: give one."
            )
    if device.type != "cpu" or "attn_implementation" in model_kwargs:
        return None
    if kernel == "sdpa":
        return ATTN_IMPLEMENTATION
    try:
        load_native_kernel()
    except KernelUnavailable as exc:
        if kernel == "native":
            raise ConfigError(f"attention_kernel='native' is not available: {exc}. Use 'auto' or 'sdpa'.") from exc
        logger.warning("the native decode-attention kernel is unavailable (%s); decoding with SDPA", exc)
        return ATTN_IMPLEMENTATION
    return NATIVE_ATTN_IMPLEMENTATION


class TorchEngine(Engine):
    """Samples from a ``transformers`` causal LM with a batched KV-cache decode loop.

    Args:
        context: the sampler's (``Sampler(TorchEngine, ...)`` passes it).
        model_id: a local folder, ``hf://org/name``, ``ms://org/name`` (or a
            bare ``org/name``) or ``builtin://<name>``, resolved by
            ``twinkle_core.hub.resolve_model_id``.
        device_mesh: ``None`` or a mesh of ``dp_size=1, tp_size=1``. Several
            replicas (``dp_size > 1``) need ``remote_group=``; tensor
            parallelism is not supported by this engine.
        dtype: ``"auto"`` (the checkpoint's dtype; float32 on CPU when the
            checkpoint is half precision), a name such as ``"float32"`` /
            ``"bfloat16"``, or a ``torch.dtype``.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``; default CUDA when available.
        template: the chat template (a registered name, a ``Template`` class or
            instance); default: the tokenizer's own.
        max_batch_tokens: the KV-cache budget of one batch, in tokens: a batch
            holds rows whose ``(longest prompt + max_tokens) * rows`` fits.
            Bigger is faster until memory runs out; on CUDA an out-of-memory
            error splits the batch and retries.
        max_model_len: the context window (prompt + completion), at most the
            model's positions; default: the model's positions.
        trust_remote_code: passed to ``from_pretrained``.
        linear_kernel: ``"auto"`` (oneDNN's matmul for the linear layers of a
            CPU model, see :mod:`twinkle_torch.linear`; PyTorch's elsewhere),
            ``"onednn"`` (the same, and an error where the build lacks it or
            the device is not the CPU),
            ``"onednn-packed"`` (the same kernel on copies of the weights in
            its blocked layout: faster, while the linear weights take twice
            their memory; a copy is remade at the first step after its weight
            changed) or ``"torch"`` (``F.linear`` everywhere).
        attention_kernel: ``"auto"`` (on CPU, decode steps through the
            attention kernel of :mod:`twinkle_torch.native`, built on first use
            with the machine's C++ compiler; PyTorch's SDPA where it cannot be
            built, with a warning, and on other devices), ``"native"`` (the
            same, and an error where it cannot be built) or ``"sdpa"``
            (PyTorch's ``scaled_dot_product_attention`` throughout). The
            same library, where this loads it, also gives the sampler the
            normaliser of processed log-probs under top-p without a sort
            (:func:`twinkle_torch.native.nucleus`); with ``"sdpa"`` the
            engine builds and runs no native code.
        **model_kwargs: more ``AutoModelForCausalLM.from_pretrained`` arguments
            (e.g. ``attn_implementation="eager"``); ``revision=`` goes to the model-id resolver.

    Seeds: with ``SamplingParams.seed``, sample ``i`` of each prompt draws from
    its own generator, seeded with :func:`twinkle_torch.randomness.derive_seed`
    ``(seed, i)`` (sample 0 uses ``seed`` itself), so a seeded request gives
    the same tokens whatever else is in the batch.
    """

    def __init__(
        self,
        context: EngineContext,
        model_id: str | os.PathLike[str],
        device_mesh: DeviceMesh | None = None,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        template: Any = None,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        max_model_len: int | None = None,
        trust_remote_code: bool = False,
        linear_kernel: str = "auto",
        attention_kernel: str = "auto",
        **model_kwargs: Any,
    ) -> None:
        super().__init__(context)
        _check_mesh(device_mesh)
        if linear_kernel not in _LINEAR_KERNELS:
            raise ConfigError(f"linear_kernel={linear_kernel!r} is invalid: expected one of {list(_LINEAR_KERNELS)}.")
        if attention_kernel not in _ATTENTION_KERNELS:
            raise ConfigError(
                f"attention_kernel={attention_kernel!r} is invalid: expected one of {list(_ATTENTION_KERNELS)}."
            )
        if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ConfigError(f"max_batch_tokens={max_batch_tokens!r} is invalid: expected an integer >= 1.")
        if not isinstance(trust_remote_code, bool):  # a string such as "false" would read as true
            raise ConfigError(f"trust_remote_code={trust_remote_code!r} is invalid: expected True or False.")
        if max_model_len is not None and (
            isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1
        ):
            raise ConfigError(f"max_model_len={max_model_len!r} is invalid: expected an integer >= 1 or None.")
        from transformers import AutoConfig

        path = resolve_model_id(model_id, revision=model_kwargs.pop("revision", None))
        self.model_path = path
        self.device = _resolve_device(device)
        _check_linear_kernel(linear_kernel, self.device)
        attention = _attention_for(attention_kernel, self.device, model_kwargs)
        try:
            config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        except Exception as exc:  # no config, an unknown model type, values of the wrong type (transformers' own)
            raise ConfigError(f"{str(path)!r} holds no model transformers can read: {_brief(exc)}") from exc
        self.dtype = _resolve_dtype(dtype, config, self.device)
        model = _load_model(path, config, self.dtype, trust_remote_code, model_kwargs, attention)
        self._model: torch.nn.Module = model.to(self.device).eval()
        if self.device.type == "cpu" and linear_kernel != "torch":
            use_onednn(self._model, packed=linear_kernel == "onednn-packed")
        _check_decodes(self._model, self.device)
        context.init_template(template, path)
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        positions = int(
            getattr(text_config, "max_position_embeddings", None)
            or getattr(self.tokenizer, "model_max_length", None)
            or 2048
        )
        if max_model_len is not None and max_model_len > positions:
            raise ConfigError(
                f"max_model_len={max_model_len} is invalid: expected at most the model's {positions} positions."
            )
        vocab_size = int(self._model.get_input_embeddings().num_embeddings)
        self.info = EngineInfo(
            name="torch",
            max_model_len=positions if max_model_len is None else max_model_len,
            vocab_size=vocab_size,
            supported_params=SUPPORTED_PARAMS,
            concurrent=True,
            weights_dtype=self.dtype,
        )
        self._weights = WeightTable(self._model)
        self._adapter_set = AdapterSet(self._model, self.device)
        # add_adapter_to_model(..., merge=True): the merged adapter and the base values it replaced.
        self._merged = MergedLoRA()
        pad = getattr(self.tokenizer, "pad_token_id", None)
        eos = _eos_ids(self._model, self.tokenizer)
        if pad is None or not 0 <= pad < vocab_size:
            pad = eos[0] if eos else 0
        self._decoder = Decoder(
            self._model,
            self.tokenizer,
            device=self.device,
            eos_token_ids=eos,
            pad_token_id=pad,
            max_model_len=self.info.max_model_len,
            logits_to_keep="logits_to_keep" in inspect.signature(type(self._model).forward).parameters,
            sdpa_masks=getattr(self._model.config, "_attn_implementation", None)
            in (
                "sdpa",
                ATTN_IMPLEMENTATION,
                NATIVE_ATTN_IMPLEMENTATION,
            ),
            max_batch_tokens=max_batch_tokens,
            vocab_size=self.info.vocab_size,
            native_kernels=attention == NATIVE_ATTN_IMPLEMENTATION,
            routes=RouteRecorder(self._model),
        )
        release_idle_workers()  # loading ran parallel work on this thread: its idle pool would slow the loop

    @property
    def max_batch_tokens(self) -> int:
        """The KV-cache budget of the running batch, in tokens (settable; applies from the next admission)."""
        return self._decoder.max_batch_tokens

    @max_batch_tokens.setter
    def max_batch_tokens(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"max_batch_tokens={value!r} is invalid: expected an integer >= 1.")
        self._decoder.max_batch_tokens = value

    @property
    def tokenizer(self) -> Any:
        """The tokenizer of the sampler's template."""
        return self.context.tokenizer

    @property
    def model(self) -> torch.nn.Module:
        """The ``transformers`` model (with any LoRA layers injected)."""
        return self._model

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a sequence unless ``ignore_eos``: the generation config's and the tokenizer's."""
        return self._decoder.eos_token_ids

    # -- the engine contract ---------------------------------------------------------------------
    def template_changed(self) -> None:
        decoder = getattr(self, "_decoder", None)
        if decoder is not None:
            decoder.tokenizer = self.tokenizer

    def run(self, run: EngineRun) -> list[SampleResponse]:
        # The sampler holds its lock shared (no adapter or weight change meanwhile); runs in several
        # threads share the decoder's one continuous batch.
        prompts, params, adapter_name = run.prompts, run.params, run.adapter_name
        ids_of = [list(p.input_ids) for p in prompts]
        if params.return_routed_experts and not (self._decoder.routes and self._decoder.routes.layers):
            raise UnsupportedFeatureError(
                f"SamplingParams.return_routed_experts=True: {type(self._model).__name__} has no mixture-of-experts"
                " router the torch engine records (families: twinkle_core.rl.ROUTER_RULES)."
            )

        def build(prompt_index: int, result: SequenceResult) -> SampledSequence:
            sequence = self.context.make_sequence(
                ids_of[prompt_index],
                result.tokens,
                stop_reason=result.stop_reason,
                adapter_name=adapter_name,
                text=self.context.template.completion_text(result.tokens, params, result.stop),
                stop=result.stop,
                logprobs=result.logprobs,
                top_logprobs=result.top_logprobs,
                sampling_mask=result.sampling_mask,
            )
            sequence.routed_experts = result.routed_experts
            return sequence

        merged = self._merged.name
        self._merged.check_request(adapter_name)
        # A merged adapter runs on the plain modules: its sequences still carry its name.
        active = "" if adapter_name == merged else adapter_name
        control = RunControl(
            max_tokens=list(run.max_tokens),
            sample_base=list(run.sample_base),
            generated=list(run.generated),
            stopped=run.stopped,
            on_finish=lambda p, s, result: run.finish(p, s, build(p, result)),
            activate=lambda: self._adapter_set.activate(active),
            adapter=active,
        )
        sequences, scores = self._decoder.run(ids_of, params, control=control)
        return [
            SampleResponse(
                prompt_token_ids=ids_of[p],
                sequences=[build(p, result) for result in seqs],
                prompt_logprobs=score.logprobs if score is not None else None,
                prompt_top_logprobs=score.top_logprobs if score is not None else None,
            )
            for p, (seqs, score) in enumerate(zip(sequences, scores))
        ]

    @releasing
    def load_adapter(self, adapter: AdapterInput, *, version: int, merge: bool = False, **kwargs: Any) -> str:
        """Load (or replace) ``adapter``; with ``merge=True``, merge it into the weights.

        A merged adapter must be the only one loaded (the base weights it
        changes are shared by every other adapter); see ``twinkle_core.merge``.

        Raises:
            AdapterError: unknown options, an adapter that does not fit, or a
                merge while other adapters are loaded (or the reverse).
        """
        if kwargs:
            raise AdapterError(
                f"add_adapter_to_model got unexpected arguments {sorted(kwargs)} for the torch engine"
                " (it accepts merge=)."
            )
        name, merged = adapter.name, self._merged.name
        if check_merge_flag(merge):
            others = sorted(n for n in self._adapter_set.names if n != name)
            if others or merged not in (None, name):
                raise AdapterError(
                    f"Cannot merge adapter {name!r}: adapter(s) {others or [merged]} are loaded, and a merged adapter"
                    " changes the weights they run on. Remove them first (one merged adapter at a time)."
                )
            deltas = dict(self._weights.spelled(list(lora_deltas(name, adapter.config, adapter.tensors).items())))
            plan = self._merged.plan_merge(name, deltas, self._weights.read)
            try:
                pairs = self._weights.check(plan.tensors)
            except WeightUpdateError as exc:
                raise AdapterError(f"Cannot merge adapter {name!r}: {exc}") from exc
            self._apply_plan(plan, pairs)
            self._adapter_set.remove(name)  # it was loaded unmerged before: that copy is stale now
            return adapter.source
        if merged is not None and merged != name:
            raise AdapterError(
                f"Cannot load adapter {name!r}: adapter {merged!r} is merged into the weights it would run on."
                f" remove_adapter({merged!r}) first."
            )
        source = self._adapter_set.load(adapter)
        if merged == name:  # merged before, unmerged now: the weights go back to base
            self._unmerge()
        return source

    def _unmerge(self) -> None:
        plan = self._merged.plan_unmerge()
        self._apply_plan(plan, self._weights.check(plan.tensors))

    def _apply_plan(self, plan: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Apply a merge or unmerge whole, or not at all: a copy that fails part-way is undone, then re-raised.

        If the undo fails too (a second interrupt), the weights may be a mix of
        merged and unmerged values: an ``IncompleteUpdateError`` names them, and
        the sampler refuses to sample until they are pushed again.
        """
        try:
            self._weights.apply(pairs)
        except BaseException as exc:
            try:
                self._weights.apply(self._weights.check(self._merged.undo(plan)))
            except BaseException as undo_exc:
                raise IncompleteUpdateError(
                    self._merged.undo_failed(plan, exc, undo_exc), tensors=[name for name, _ in plan.tensors]
                ) from undo_exc
            raise
        self._merged.commit(plan)

    @releasing
    def remove_adapter(self, name: str) -> None:
        if self._merged.name == name:
            self._unmerge()
        else:
            self._adapter_set.remove(name)

    @releasing
    def update_weights(self, named_tensors: list[tuple[str, Any]], *, version: int) -> None:
        named_tensors = self._weights.spelled(named_tensors)
        pairs = self._weights.check(named_tensors)
        if self._merged.name is None:
            self._weights.apply(pairs)
            return
        # While merged, pushed base values of merged weights are kept and applied merged.
        plan = self._merged.plan_update(named_tensors)
        self._weights.apply(self._weights.check(plan.tensors))
        self._merged.commit(plan)

    def close(self) -> None:
        with self.context.exclusive():
            self._decoder.close()
            self._decoder.model = None
            self._adapter_set.model = None  # type: ignore[assignment]
            self._weights.model = None  # type: ignore[assignment]
            self._model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
