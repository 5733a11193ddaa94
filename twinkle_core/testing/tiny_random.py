"""Tiny random models of families the trained tiny models do not cover: a config, random weights, a tokenizer.

A model built here is random (every matrix drawn with std 0.3 from seed 0,
so every machine builds the same one) and speaks through the tiny Llama's
tokenizer and chat template: its greedy tokens mean nothing, but two engines
given the same folder must agree on them. :data:`TINY_GRANITE_HYBRID` is the
Mamba-2 hybrid both engines' tests sample.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

__all__ = ["TINY_GRANITE_HYBRID", "TINY_RANDOM_BASE", "build_tiny_granite_hybrid", "save_random_model"]

#: The fields every tiny random model shares: two attention heads of 32 (a head size vLLM's CPU attention takes).
TINY_RANDOM_BASE: dict[str, Any] = dict(
    vocab_size=768, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=512, pad_token_id=0, bos_token_id=0, eos_token_id=2,
)  # fmt: skip

#: Granite 4.0 hybrid (``granitemoehybrid``), tiny: three Mamba-2 layers and one attention layer; 4 Mamba-2 heads
#: of 32, state size 16, one group, kernel 4; scan chunks of 16 tokens, so prompts span several chunks.
TINY_GRANITE_HYBRID: dict[str, Any] = dict(
    TINY_RANDOM_BASE,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    num_local_experts=0, shared_intermediate_size=128, position_embedding_type="rope",
    mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16,
)  # fmt: skip


def save_random_model(config: Any, out: Path, *, std: float = 0.3) -> None:
    """A model of ``config`` (a ``transformers`` config) with random weights, saved in ``out`` with a tokenizer.

    Every matrix is drawn from a normal of ``std`` (seed 0); the tokenizer and chat template are the tiny Llama's.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from twinkle_core.testing.tiny_model import build_tiny_model

    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, std)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for path in build_tiny_model("llama").iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy2(path, out / path.name)


def build_tiny_granite_hybrid(out: Path, **overrides: Any) -> Path:
    """The tiny random Granite 4.0 hybrid (:data:`TINY_GRANITE_HYBRID` with ``overrides``), saved in ``out``."""
    from transformers import AutoConfig

    save_random_model(AutoConfig.for_model("granitemoehybrid", **{**TINY_GRANITE_HYBRID, **overrides}), out)
    return out
