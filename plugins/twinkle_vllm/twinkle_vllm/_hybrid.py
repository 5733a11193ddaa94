"""What a hybrid model (Qwen3.5, Qwen3-Next; Mamba-2: Granite 4.0 hybrid, Bamba) needs from vLLM's engine options.

Read from the model folder's ``config.json`` alone (no ``transformers``, no
vLLM model import), before the engine starts:

- **dtype.** vLLM's CPU Gated DeltaNet kernels take bfloat16 only: the engine
  starts in float32 and then dies at the first request (``CPU GDN attention
  requires BF16.``). On the CPU backend such a model therefore runs in
  bfloat16 when no dtype (or ``"auto"``) is given, and an explicit other
  dtype is a ``ConfigError`` that says why, before anything starts. On other
  backends nothing changes; vLLM's CPU Mamba-2 kernels take any dtype.
- **prefix caching.** vLLM caches a hybrid's prefixes (Gated DeltaNet or
  Mamba-2: Granite 4.0 hybrid, Bamba) by checkpointing its state at block
  boundaries (mamba cache mode ``align``), which needs chunked prefill (else
  vLLM refuses to start: "Chunked prefill is required for mamba cache mode
  'align'"); twinkle turns chunked prefill off on the CPU backend (a seeded
  request prefilled in chunks kills the CPU engine,
  :func:`twinkle_vllm._engine_args.platform_defaults`), so there prefix
  caching is off for these models unless the user sets it. The same holds
  for every model vLLM keeps a Mamba-style state for (a short convolution,
  Mamba, Mamba-2: LFM2, Falcon-H1, Jamba...), whose engine otherwise fails
  to configure ("Chunked prefill is required for mamba cache mode 'align'").
- **the vision tower.** A Qwen3.5 checkpoint is a vision-language model. The
  tower is loaded only when the user asks for images with
  ``language_model_only=False``; otherwise it is not (vLLM's
  ``language_model_only``), and a prompt with an image is refused by name,
  never sampled without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError

__all__ = ["hybrid_options", "is_linear_attention_hybrid", "refuse_moe_lora_on_cpu"]

#: Model types whose layers include Gated DeltaNet mixers, whatever their layer list says.
_GDN_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"})
#: Other model types vLLM keeps a recurrent (Mamba-style) state for, checkpointed per block to cache prefixes.
_STATE_MODEL_TYPES = frozenset({
    "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "kimi_linear", "lfm2", "lfm2_moe", "mamba",
    "mamba2", "minimax", "nemotron_h", "olmo_hybrid", "plamo2", "zamba2",
})  # fmt: skip
#: Config fields that count a mixture-of-experts layer's routed experts, as the families spell them.
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
#: dtype spellings vLLM reads as bfloat16.
_BFLOAT16 = frozenset({"bfloat16", "bf16", "torch.bfloat16"})


def _read_config(model_dir: Path) -> dict[str, Any]:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # vLLM reports a missing or broken config in its own words
    return config if isinstance(config, dict) else {}


def is_linear_attention_hybrid(config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` (or its ``text_config``) describes a Gated DeltaNet hybrid."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(text, dict)
    if config.get("model_type") in _GDN_MODEL_TYPES or text.get("model_type") in _GDN_MODEL_TYPES:
        return True
    if _is_mamba_hybrid(text):
        return False  # its "linear_attention" layers are Mamba-2 mixers
    return "linear_attention" in (text.get("layer_types") or [])


def _is_mamba_hybrid(text: dict[str, Any]) -> bool:
    """Whether a (text) config has Mamba mixers: Granite 4.0 hybrid and Bamba name their fields ``mamba_*``."""
    return any(str(key).startswith("mamba_") for key in text)


def hybrid_options(model_dir: Path, options: dict[str, Any], *, cpu: bool) -> dict[str, Any]:
    """Engine options the model in ``model_dir`` needs (the user's ``options`` win where they may).

    Args:
        model_dir: the local model folder.
        options: the engine options as the user gave them.
        cpu: whether the engine runs on vLLM's CPU backend.

    Returns:
        Options to set under the user's: ``dtype``, ``enable_prefix_caching`` and
        ``language_model_only``, where they apply.

    Raises:
        ConfigError: a dtype the CPU Gated DeltaNet kernels cannot run.
    """
    config = _read_config(model_dir)
    if not config:
        return {}
    text = config.get("text_config")
    text = text if isinstance(text, dict) else config
    gated_deltanet = is_linear_attention_hybrid(config)
    if not gated_deltanet and not _is_mamba_hybrid(text):
        stateful = {config.get("model_type"), text.get("model_type")} & _STATE_MODEL_TYPES
        if stateful and cpu and "enable_prefix_caching" not in options and not options.get("enable_chunked_prefill"):
            return {"enable_prefix_caching": False}
        return {}
    out: dict[str, Any] = {}
    if isinstance(config.get("vision_config"), dict) and "language_model_only" not in options:
        out["language_model_only"] = True
    if cpu and "enable_prefix_caching" not in options and not options.get("enable_chunked_prefill"):
        out["enable_prefix_caching"] = False
    if cpu and gated_deltanet:
        dtype = options.get("dtype")
        name = None if dtype is None else str(dtype).lower()
        if name in (None, "auto"):
            out["dtype"] = "bfloat16"
        elif name not in _BFLOAT16:
            architecture = (config.get("architectures") or [config.get("model_type")])[0]
            raise ConfigError(
                f"dtype={dtype!r} cannot run {architecture} on vLLM's CPU backend: its Gated DeltaNet kernels take"
                " bfloat16 only (vLLM would start and then fail at the first request). Use dtype='bfloat16' (or"
                " leave dtype unset), or the torch engine, which runs this model in float32."
            )
    return out


def refuse_moe_lora_on_cpu(model_dir: Path, options: dict[str, Any], *, cpu: bool) -> None:
    """Refuse LoRA slots for a mixture-of-experts model on vLLM's CPU backend, before the engine starts.

    With ``enable_lora`` vLLM wraps every MoE layer in its LoRA-aware fused-experts layer, which runs the experts
    in a Triton kernel; the CPU build has no Triton, and the engine dies at its first request whether or not an
    adapter is named (``module 'triton.language' has no attribute 'bfloat16'``). Adapters merged into the
    weights need no slots.

    Raises:
        ConfigError: ``enable_lora`` set for such a model on the CPU backend, naming what works instead.
    """
    if not cpu or not options.get("enable_lora"):
        return
    config = _read_config(model_dir)
    text = config.get("text_config")
    experts = [part.get(key) for part in (config, text if isinstance(text, dict) else {}) for key in _EXPERT_COUNTS]
    if not any(isinstance(n, int) and n > 1 for n in experts):
        return
    architecture = (config.get("architectures") or [config.get("model_type")])[0]
    raise ConfigError(
        f"enable_lora=True cannot run {architecture} on vLLM's CPU backend: with LoRA slots its mixture-of-experts"
        " layers run in a Triton kernel the CPU build lacks, and the engine would die at its first request. Leave"
        " enable_lora unset and add adapters with merge=True (merged into the weights, no slots needed), or use"
        " the torch engine, which serves unmerged adapters on this model."
    )
