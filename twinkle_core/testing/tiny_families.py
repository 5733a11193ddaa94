"""Tiny random models of every causal-LM family ``transformers`` ships, from one generic config.

Each family is built from ``GENERIC`` with the few fields its own forward
needs beside it (``OVERRIDES``: a hybrid's layer types, a latent attention's
heads, an encoder-decoder's decoder sizes...). A composite (a language model
with vision or audio towers) is built as its checkpoint is, its text config
sized like its text family, with tiny towers. The torch engine's families
sweep (``plugins/twinkle_torch/tests/test_torch_families_sweep.py``) and the
vLLM families probe (``bench/probe_vllm_families.py``) build the same models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "DROP", "GENERIC", "MAX_PARAMETERS", "OUTSIDE", "OVERRIDES", "families", "family_config", "language_model",
    "sized",
]  # fmt: skip

GENERIC: dict[str, Any] = dict(
    vocab_size=768, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=512, pad_token_id=0, n_embd=128, n_layer=2, n_head=2,
    d_model=128, n_positions=512, num_layers=2, ffn_dim=256,
    # mixtures of experts: a few small ones
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, moe_topk=2, n_group=1, topk_group=1,
)  # fmt: skip

#: A key of ``GENERIC`` that a family's config refuses to be given at all.
DROP = object()

#: The decoder of an encoder-decoder family (in the causal-LM mapping): its own names for its sizes.
_SEQ2SEQ: dict[str, Any] = dict(
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=256,
    decoder_ffn_dim=256,
)  # fmt: skip

#: Multi-head latent attention (DeepSeek-V2 and after) sized to the generic model, with a small sparse indexer.
_MLA: dict[str, Any] = dict(
    num_key_value_heads=2, q_lora_rank=64, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
    index_n_heads=2, index_head_dim=32,
)  # fmt: skip

#: A vision tower a few thousand parameters big, for composites and models with one built in.
_TOWER: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=56, patch_size=14,
)  # fmt: skip

#: What a family needs beside (or instead of) ``GENERIC`` for its own eager forward to run on a short prompt.
#: A composite's entry sizes its towers; its text model takes the entry of the text config's model type.
OVERRIDES: dict[str, dict[str, Any]] = {
    # multi-head latent attention: as many key/value heads as query heads, small low-rank projections and indexer
    **dict.fromkeys((
        "axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa", "minicpm3",
        "youtu",
    ), _MLA),
    "longcat_flash": dict(num_key_value_heads=2),  # at _MLA's latent sizes its attention's shapes disagree
    "diffllama": dict(num_key_value_heads=2),  # its two attention maps split the values by key/value head
    **dict.fromkeys((
        "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp", "pegasus", "plbart",
        "whisper",
    ), _SEQ2SEQ),
    "prophetnet": dict(
        num_hidden_layers=DROP, num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=2,
        num_decoder_attention_heads=2, encoder_ffn_dim=256, decoder_ffn_dim=256,
    ),
    # a head size the config leaves unset (None) where the attention reads it
    **{name: dict(head_dim=64) for name in ("helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "ministral")},
    # hybrids: one attention layer beside the recurrent one (transformers' cache needs at least one)
    **{name: dict(layer_types=["linear_attention", "full_attention"]) for name in (
        "granitemoehybrid", "qwen3_5_moe_text", "qwen3_5_text", "qwen3_next",
    )},
    "bamba": dict(attn_layer_indices=[1]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "kimi_linear": dict(num_key_value_heads=2, layer_types=["linear_attention", "full_attention"]),
    **{name: dict(layer_types=["conv", "full_attention"]) for name in ("lfm2", "lfm2_moe")},  # by default all attention
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "mamba2": dict(num_heads=4, head_dim=64, n_groups=1),  # hidden_size * expand == num_heads * head_dim
    "qwen4_exp_text": dict(
        layer_types=["linear_attention", "indexed_attention"], head_dim=64, indexer_n_heads=2, indexer_kv_heads=1,
        indexer_head_dim=64, indexer_budget=4, indexer_compress_ratio=2, hc_lowrank=16, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=2,
    ),
    "zamba": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "hybrid"]),  # one block, shared by two
    "zamba2": dict(layers_block_type=["mamba", "hybrid"]),
    # towers: a small vision (and audio) model
    "gemma3": dict(vision_config=_TOWER, mm_tokens_per_image=4),
    "git": dict(vision_config=_TOWER),
    "fuyu": dict(hidden_size=128, patch_size=4),  # its patch embedding is sized by the top-level config
    "got_ocr2": dict(vision_config=dict(
        hidden_size=32, output_channels=32, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16,
        window_size=2, global_attn_indexes=[0], mlp_dim=64,
    )),
    "phi4_multimodal": dict(vision_config=_TOWER, audio_config=dict(
        hidden_size=32, intermediate_size=64, num_blocks=1, num_attention_heads=2, nemo_conv_channels=32,
    )),
    # a byte-level model: small hash tables, patcher and local models
    "blt": dict(
        encoder_hash_byte_group_vocab=512,
        patcher_config=dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128),
        encoder_config=dict(hidden_size=64, num_attention_heads=2, hidden_size_global=128, intermediate_size=128),
        decoder_config=dict(
            hidden_size=64, num_hidden_layers=1, num_attention_heads=2, hidden_size_global=128, intermediate_size=128,
        ),
        global_config=dict(hidden_size=128, num_hidden_layers=1, num_attention_heads=2, intermediate_size=256),
    ),
    # per-layer embeddings, key/value sharing and sparsity sized to two layers
    "gemma3n_text": dict(
        layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0, vocab_size_per_layer_input=768,
        hidden_size_per_layer_input=16, laurel_rank=8, activation_sparsity_pattern=[0.0, 0.0],
    ),
    "gemma4_text": dict(vocab_size_per_layer_input=768, hidden_size_per_layer_input=16),
    # the rest: one field each that the generic config leaves at a value its forward cannot take
    "codegen": dict(num_attention_heads=4, n_head=4, rotary_dim=16),  # its heads split four ways
    "cohere_compass_text": dict(rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [12, 10, 10]},
    }),
    "dbrx": dict(
        attn_config=dict(kv_n_heads=1, rope_theta=1e4, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=256, moe_num_experts=4, moe_top_k=2),
    ),
    "dots1": dict(n_shared_experts=1),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "reformer": dict(
        is_decoder=True, attn_layers=["local", "lsh"], axial_pos_shape=[16, 32], axial_pos_embds_dim=[64, 64],
    ),
    "xlnet": dict(max_position_embeddings=DROP),
    "xmod": dict(default_language="en_XX"),
    "zaya": dict(num_experts_per_tok=1),
}  # fmt: skip

#: Families the sweep does not sample, for a reason outside the engine: no language model of their own.
OUTSIDE: dict[str, str] = {
    **dict.fromkeys(("gemma4_assistant", "gemma4_unified_assistant"), (
        "a drafter for speculative decoding: its forward requires the Gemma 4 target's hidden states (inputs_embeds)"
        " and key/value states (shared_kv_states) and ignores input_ids; no language model alone"
    )),
    **dict.fromkeys(("musicgen", "musicgen_melody"), (
        "the audio-token decoder of a text-to-music model: its ids are audio codebook tokens, num_codebooks rows per"
        " sequence, and its composite config needs a text and an audio encoder; no text language model"
    )),
}  # fmt: skip

#: Models stay small: a family whose config makes a bigger one needs an entry in ``OVERRIDES``.
MAX_PARAMETERS = 40_000_000


def families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sized(model_type: str, extra: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """``GENERIC`` with the family's own overrides, then its entry in ``extra`` (another engine's needs)."""
    merged = {**GENERIC, **OVERRIDES.get(model_type, {}), **(extra or {}).get(model_type, {})}
    return {key: value for key, value in merged.items() if value is not DROP}


def family_config(model_type: str, extra: Mapping[str, Mapping[str, Any]] | None = None) -> Any:
    """The tiny config of ``model_type``; a composite's text model is sized as its own family would be.

    ``extra`` adds fields by model type over ``OVERRIDES`` (a text config's by its own model type), e.g. the
    head sizes an engine's kernels take.
    """
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **sized(model_type, extra))
    text = config.get_text_config()
    if text is config:
        return config
    text_config = {"model_type": text.model_type, **sized(text.model_type, extra)}
    own = {**OVERRIDES.get(model_type, {}), **(extra or {}).get(model_type, {})}
    return AutoConfig.for_model(model_type, **{**own, "text_config": text_config})


def language_model(config: Any) -> tuple[Any, Any]:
    """The config to save and what ``AutoModelForCausalLM`` builds of it, on the meta device.

    A composite whose towers need a library absent here (Gemma 3n's timm) falls back to its text config, when
    ``transformers`` maps that to a causal LM of its own.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        with torch.device("meta"):  # counted before anything is allocated: some configs ask for huge tables
            return config, AutoModelForCausalLM.from_config(config)
    except ImportError:
        text = config.get_text_config()
        if text is config or type(text) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise
    with torch.device("meta"):
        return text, AutoModelForCausalLM.from_config(text)
