"""The tiny models' architectures: the ``transformers`` config of each (Llama, Qwen2, the Qwen3.5 hybrid)."""

from __future__ import annotations

from typing import Any

__all__ = ["ARCH_CLASSES", "TINY_ARCHS", "TINY_MAX_MODEL_LEN", "check_arch", "model_config"]

#: Architectures :func:`build_tiny_model` can build.
TINY_ARCHS: tuple[str, ...] = ("llama", "qwen2", "qwen3_5")

#: Context window of the tiny models (``max_position_embeddings``).
TINY_MAX_MODEL_LEN = 512

#: The ``transformers`` model class of each architecture (``config.architectures``).
ARCH_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM"}


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
        A ``LlamaConfig``, ``Qwen2Config`` or ``Qwen3_5TextConfig``.
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
    if arch == "qwen3_5":
        return _qwen3_5_config(common)
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**common, use_sliding_window=False)
    from transformers import LlamaConfig

    return LlamaConfig(**common, attention_bias=False, mlp_bias=False)


def _qwen3_5_config(common: dict[str, Any]) -> Any:
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
    """
    from transformers import Qwen3_5TextConfig

    rotary_pairs = common["head_dim"] // 4 // 2
    return Qwen3_5TextConfig(
        **{**common, "num_hidden_layers": 4},
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10_000_000.0,
            "partial_rotary_factor": 0.25,
            "mrope_interleaved": True,
            "mrope_section": [rotary_pairs - 2 * (rotary_pairs // 3), rotary_pairs // 3, rotary_pairs // 3],
        },
    )
