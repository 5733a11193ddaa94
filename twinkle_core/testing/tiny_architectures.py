"""The tiny models' architectures: the ``transformers`` config of each (Llama, Qwen2, Qwen3.5, its MoE, Qwen3-Next)."""

from __future__ import annotations

from typing import Any

__all__ = ["ARCH_CLASSES", "MOE_SHAPE", "TINY_ARCHS", "TINY_MAX_MODEL_LEN", "check_arch", "model_config"]

#: Architectures :func:`build_tiny_model` can build.
TINY_ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3_5", "qwen3_5_moe", "qwen3_next")

#: Context window of the tiny models (``max_position_embeddings``).
TINY_MAX_MODEL_LEN = 512

#: The ``transformers`` model class of each architecture (``config.architectures``).
ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}

#: The mixture-of-experts layer of the MoE hybrids: a few small routed experts (top-2 of 4) beside the family's
#: shared expert, which is as wide as the dense model's MLP.
MOE_SHAPE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128}


def check_arch(arch: str) -> str:
    """Validate an architecture name.

    Args:
        arch: the requested architecture.

    Returns:
        ``arch`` itself.

    Raises:
        ValueError: if ``arch`` is not one of :data:`TINY_ARCHS`.
    """
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny-model arch {arch!r}; expected one of {list(TINY_ARCHS)}")
    return arch


def model_config(arch: str, vocab_size: int) -> Any:
    """Build the ``transformers`` config of a tiny model.

    Args:
        arch: one of :data:`TINY_ARCHS`.
        vocab_size: the tokenizer's size (``len(tokenizer)``).

    Returns:
        A ``LlamaConfig``, ``Qwen2Config``, ``Qwen3_5TextConfig``, ``Qwen3_5MoeTextConfig`` or ``Qwen3NextConfig``.
    """
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=TINY_MAX_MODEL_LEN,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
        use_cache=True,
        architectures=[ARCH_CLASSES[arch]],
        dtype="float32",
    )
    if arch in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        return _qwen3_5_config(common, arch)
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, use_sliding_window=False)
    from transformers import LlamaConfig

    return LlamaConfig(**common, attention_bias=False, mlp_bias=False)


def _qwen3_5_config(common: dict[str, Any], arch: str = "qwen3_5") -> Any:
    """The tiny Qwen3.5 text model: the real family's 3:1 hybrid, at sizes vLLM's CPU kernels take.

    Four layers, three Gated DeltaNet then one gated full attention (the
    real ``full_attention_interval`` of 4). The GDN heads are 64 wide for
    keys and values alike (vLLM's CPU prefill kernel takes ``Dk == Dv`` in
    {64, 128} only), with one key head shared by two value heads as in the
    real checkpoints, and the convolution is 4 wide (the packed CPU path's
    only width). Attention keeps the other tiny models' 2 query heads and 1
    KV head of 64 (a CPU attention head size). The rotary embedding is the
    real one's shape scaled down: a quarter of each head rotated, with the
    interleaved multimodal sections summing to that quarter's frequencies.

    ``qwen3_5_moe`` and ``qwen3_next`` are the same layers with a mixture of
    experts in place of every MLP (:data:`MOE_SHAPE`, plus the shared expert
    of the dense MLP's width); Qwen3-Next rotates the same quarter of each
    head without the multimodal sections (for text, where the three position
    axes are equal, the two rotations are the same).
    """
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    rotary_pairs = common["head_dim"] // 4 // 2
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}
    if arch == "qwen3_next":
        config_class: Any = Qwen3NextConfig
    else:
        config_class = Qwen3_5MoeTextConfig if arch == "qwen3_5_moe" else Qwen3_5TextConfig
        rope["mrope_interleaved"] = True
        rope["mrope_section"] = [rotary_pairs - 2 * (rotary_pairs // 3), rotary_pairs // 3, rotary_pairs // 3]
    moe: dict[str, Any] = {}
    if arch != "qwen3_5":
        moe = {**MOE_SHAPE, "shared_expert_intermediate_size": common["intermediate_size"]}
    return config_class(
        **{**common, "num_hidden_layers": 4},
        **moe,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        rope_parameters=rope,
    )
