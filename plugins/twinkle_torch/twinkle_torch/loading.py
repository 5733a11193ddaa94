"""Loading a model for the torch engine: checking its options, resolving device and dtype, loading it, and
checking that it decodes (its causal mask and its cache give the logits a plain forward gives)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from twinkle_core.engine import DeviceMesh
from twinkle_core.errors import ConfigError, InvalidMeshError, did_you_mean
from twinkle_torch.attention import ATTN_IMPLEMENTATION, NATIVE_ATTN_IMPLEMENTATION
from twinkle_torch.attention import register as register_attention
from twinkle_torch.cache import make_cache
from twinkle_torch.linear import available as onednn_available
from twinkle_torch.native import KernelUnavailable
from twinkle_torch.native import load as load_native_kernel
from twinkle_torch.state import StateLayer, uncarried_state

__all__ = [
    "ATTENTION_KERNELS",
    "LINEAR_KERNELS",
    "attention_for",
    "brief",
    "check_decodes",
    "check_linear_kernel",
    "check_options",
    "eos_ids",
    "image_text_class",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]

LINEAR_KERNELS = ("auto", "onednn", "onednn-packed", "torch")
ATTENTION_KERNELS = ("auto", "native", "sdpa")

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


def check_options(
    *,
    device_mesh: Any,
    linear_kernel: Any,
    attention_kernel: Any,
    max_batch_tokens: Any,
    trust_remote_code: Any,
    max_model_len: Any,
) -> None:
    """Refuse a bad option of ``TorchEngine`` before anything is loaded.

    Raises:
        ConfigError: naming the option, its value and what is accepted.
        InvalidMeshError: a mesh this engine cannot run.
    """
    check_mesh(device_mesh)
    if linear_kernel not in LINEAR_KERNELS:
        raise ConfigError(f"linear_kernel={linear_kernel!r} is invalid: expected one of {list(LINEAR_KERNELS)}.")
    if attention_kernel not in ATTENTION_KERNELS:
        raise ConfigError(
            f"attention_kernel={attention_kernel!r} is invalid: expected one of {list(ATTENTION_KERNELS)}."
        )
    if isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
        raise ConfigError(f"max_batch_tokens={max_batch_tokens!r} is invalid: expected an integer >= 1.")
    if not isinstance(trust_remote_code, bool):  # a string such as "false" would read as true
        raise ConfigError(f"trust_remote_code={trust_remote_code!r} is invalid: expected True or False.")
    if max_model_len is not None and (
        isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1
    ):
        raise ConfigError(f"max_model_len={max_model_len!r} is invalid: expected an integer >= 1 or None.")


def check_mesh(device_mesh: Any) -> None:
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


def resolve_device(device: str | torch.device | None) -> torch.device:
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


def resolve_dtype(dtype: str | torch.dtype, config: Any, device: torch.device) -> torch.dtype:
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


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
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


def load_model(
    path: Any,
    config: Any,
    dtype: torch.dtype,
    trust_remote_code: bool,
    model_kwargs: dict[str, Any],
    attention: str | None,
    engine_options: list[str],
) -> Any:
    """``AutoModelForCausalLM.from_pretrained``, with the attention implementation ``attention`` when it fits.

    ``engine_options``: the engine's own option names, for the message about an option nobody took.

    A vision-language model (:func:`image_text_class`) loads with
    ``AutoModelForImageTextToText`` instead: the class that reads images.

    It fits a model class that routes its attention through ``transformers``'
    attention interface (``_supports_attention_backend``). Others (MPT, Bloom,
    XGLM...) compute attention in code of their own and read the masks made
    for it: they keep ``transformers``' default. A model with a recurrent state
    is refused unless :mod:`twinkle_torch.state` carries its state (Gated
    DeltaNet and Mamba-2 hybrids: Qwen3.5, Qwen3-Next, Granite 4.0 hybrid,
    Bamba); Mamba, RWKV and the other hybrids are refused by name, with the reason.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code, **model_kwargs}
    vision = image_text_class(config, path)
    auto = AutoModelForCausalLM if vision is None else AutoModelForImageTextToText
    cls = causal_lm_class(config) if vision is None else vision
    if cls is not None and getattr(cls, "_is_stateful", False):
        reason = uncarried_state(config)
        if reason is not None:
            raise recurrent(cls.__name__, reason)
    if cls is not None and not getattr(cls, "_supports_attention_backend", False):
        attention = None
    try:
        if attention is not None:
            register_attention()
            try:
                return auto.from_pretrained(str(path), attn_implementation=attention, **kwargs)
            except (ValueError, KeyError):  # an architecture without pluggable attention: its own default
                pass
        return auto.from_pretrained(str(path), **kwargs)
    except (OSError, SafetensorError) as exc:  # a config without weights, unreadable weights
        raise ConfigError(f"{str(path)!r} holds no model transformers can load: {brief(exc)}") from exc
    except TypeError as exc:  # an option nobody takes: transformers hands unknown ones to the model class
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        if unknown is None or unknown.group(1) not in model_kwargs:
            raise
        name = unknown.group(1)
        options = engine_options
        raise ConfigError(
            f"Option {name}={model_kwargs[name]!r:.60} is unknown: the torch engine takes {', '.join(options)},"
            f" and passes others to transformers' from_pretrained, where nothing took it.{did_you_mean(name, options)}"
        ) from None


def brief(exc: BaseException) -> str:
    """An error's message on one line, at most 300 characters (transformers' run to many lines of advice)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())[:300] or type(exc).__name__


def recurrent(name: str, reason: str = "its state is of a kind the engine does not know") -> ConfigError:
    return ConfigError(
        f"{name} keeps a recurrent state (its cache is not only keys and values) the torch engine's"
        f" batched cache cannot carry: {reason}. It carries Gated DeltaNet and Mamba-2 states, each in a"
        " layer of its own (Qwen3.5, Qwen3-Next, Granite 4.0 hybrid, Bamba); sample it with an engine"
        " that supports it (vllm)."
    )


def causal_lm_class(config: Any) -> Any:
    """The ``transformers`` class ``AutoModelForCausalLM`` picks for ``config``; ``None`` if unknown (remote code)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def image_text_class(config: Any, path: Any) -> Any:
    """The class that reads images for a vision-language model folder; ``None``: load it as a causal LM.

    A folder is sampled with its images when its config maps to an
    ``AutoModelForImageTextToText`` class and it holds the processor that
    expands them (:func:`twinkle_core.hub.has_processor`):
    without one no prompt can carry an image. A checkpoint that
    ``AutoModelForCausalLM`` also loads (Qwen3.5, Gemma 3) keeps its text
    class, and the weight names it has as a text model, unless its tokenizer
    holds the image token as well (:func:`_places_images`): a Qwen3.5 folder
    whose tokenizer has no vision tokens cannot place an image anyway.
    A model whose rotary positions are multimodal (Qwen2-VL's
    ``mrope_section``) places an image's tokens on a grid its own
    ``get_rope_index`` computes (:mod:`twinkle_torch.mrope`); one with a
    recurrent state as well (Qwen3.5) keeps it in the state layer
    (:mod:`twinkle_torch.state`), as its text class does.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    from twinkle_core.hub import has_processor

    try:
        cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    except KeyError:
        return None
    if not has_processor(path):
        return None
    if causal_lm_class(config) is not None and not _places_images(config, Path(path)):
        return None
    return cls


def _places_images(config: Any, folder: Path) -> bool:
    """Whether the folder's tokenizer has the config's image token as a token of its own (an added token).

    Read from ``tokenizer.json`` (``True`` where there is none to read: the config is then trusted).
    """
    image_id = getattr(config, "image_token_id", None)
    try:
        added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens")
    except (OSError, ValueError, AttributeError):
        return True
    if not isinstance(image_id, int) or not isinstance(added, list):
        return True
    return any(isinstance(token, dict) and token.get("id") == image_id for token in added)


#: The load check's tolerances on log-probs. A causal model's log-probs at a position do not
#: depend on later tokens at all (the same rows through the same kernels): any change is reading
#: ahead. Padding and the cache move them by float rounding only: below ``_DECODE_CHECK_NATS``
#: plus ``_ROUNDING_ULPS`` units of the model dtype's precision at the position's largest logit
#: (see ``decode_tolerance``).
_CAUSAL_CHECK_NATS = 1e-2
_DECODE_CHECK_NATS = 1.0
_ROUNDING_ULPS = 16


def decode_tolerance(logits: torch.Tensor, dtype: torch.dtype) -> float:
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


def check_decodes(model: Any, device: torch.device) -> None:
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
        raise recurrent(name, uncarried_state(model.config) or "its cache has a recurrent layer of another kind")
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
    if not shift <= decode_tolerance(raw[:, 2], dtype):
        raise ConfigError(
            f"{name} does not honour left padding (its attention mask and position ids): a probe left-padded by"
            f" one token moved its log-probs by {shift:.3g} nats, and the torch engine pads shorter prompts."
        )
    drift = float((stepped - full[:, 3]).abs().max())
    if not drift <= decode_tolerance(raw[:, 3], dtype):
        raise ConfigError(
            f"{name} does not decode from its KV cache as one forward would: the last token of a probe, decoded"
            f" from a left-padded cache of the first three, moved its log-probs by {drift:.3g} nats."
        )


def check_linear_kernel(kernel: str, device: torch.device) -> None:
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


def attention_for(kernel: str, device: torch.device, model_kwargs: Mapping[str, Any]) -> str | None:
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
