"""A tiny Qwen3-VL, built offline, for tests of prompts whose images take multimodal rotary positions.

A ``Qwen3VLForConditionalGeneration`` with random weights (seeded): a
one-layer vision tower on 16 x 16 patches merged 2 x 2 (an image of up to
96 x 96 pixels takes at most 9 tokens), with one deepstack layer, and a
two-layer Qwen3 language model of hidden size 64 whose rotary positions are
multimodal (``mrope_section``: a temporal, a height and a width section).
The tokenizer is the tiny models' byte-level BPE
(:func:`~twinkle_core.testing.tiny_model.train_tiny_tokenizer`) plus
Qwen's vision tokens (``<|vision_start|>``, ``<|image_pad|>``,
``<|video_pad|>``, ``<|vision_end|>``), with a chat template that renders an
image block as ``<|vision_start|><|image_pad|><|vision_end|>``, as Qwen's do.

The folder is laid out as a Qwen3-VL checkpoint is: ``preprocessor_config.json``
and ``video_preprocessor_config.json`` naming ``Qwen3VLProcessor``, which
transformers 5.19 builds only with torchvision; the template builds it for
images only (:mod:`twinkle_core.template.image_only`).

Cached under ``$TWINKLE_CACHE/tiny-models/qwen3_vl-v<TINY_QWEN_VL_VERSION>``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from twinkle_core.hub import build_cached_folder, cache_root

__all__ = [
    "IMAGE_BLOCK",
    "TINY_QWEN_VL_CHAT_TEMPLATE",
    "TINY_QWEN_VL_VERSION",
    "VIDEO_BLOCK",
    "VISION_TOKENS",
    "add_vision_tokens",
    "build_tiny_qwen_vl",
]

#: Bumped whenever the built folder changes.
TINY_QWEN_VL_VERSION = 1
_SEED = 20260358
_MARKER = "twinkle_tiny_qwen_vl.json"
#: Qwen's vision tokens, in the order the tiny models append them to their vocabularies.
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|video_pad|>", "<|vision_end|>")
#: What Qwen's chat templates write for an image block and for a video block.
IMAGE_BLOCK = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_BLOCK = "<|vision_start|><|video_pad|><|vision_end|>"

#: ChatML, with an image block rendered as Qwen's vision placeholder and a video block as its video one.
TINY_QWEN_VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{ part.text }}"
    "{%- elif part.type == 'image' %}{{ '" + IMAGE_BLOCK + "' }}"
    "{%- elif part.type == 'video' %}{{ '" + VIDEO_BLOCK + "' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def add_vision_tokens(tokenizer: Any, chat_template: str) -> Any:
    """``tokenizer`` with Qwen's vision tokens appended as special tokens (the next free ids, in order) and
    ``chat_template``; the ids of existing tokens, and so how any text tokenizes, do not change."""
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS], special_tokens=True)
    tokenizer.chat_template = chat_template
    return tokenizer


def _tokenizer(folder: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    from twinkle_core.testing.tiny_model import TINY_MAX_MODEL_LEN, train_tiny_tokenizer

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tiny_tokenizer("qwen2"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=TINY_MAX_MODEL_LEN,
    )
    add_vision_tokens(tokenizer, TINY_QWEN_VL_CHAT_TEMPLATE)
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def _processor_configs(folder: Path) -> None:
    """The image and video processor configs a Qwen3-VL checkpoint ships, at the tiny tower's sizes."""
    common = {
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "processor_class": "Qwen3VLProcessor",
        "size": {"shortest_edge": 32 * 32, "longest_edge": 96 * 96},
    }
    configs = {
        "preprocessor_config.json": {**common, "image_processor_type": "Qwen2VLImageProcessor"},
        "video_preprocessor_config.json": {**common, "video_processor_type": "Qwen3VLVideoProcessor"},
    }
    for name, content in configs.items():
        (folder / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")


def _write(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = _tokenizer(out)
    _processor_configs(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "max_position_embeddings": tokenizer.model_max_length,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4],
                                "mrope_interleaved": True},
        },
        vision_config={
            "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 16,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64, "num_position_embeddings": 36,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = Qwen3VLForConditionalGeneration(config)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(out))
    meta = {"version": TINY_QWEN_VL_VERSION, "architecture": "Qwen3VLForConditionalGeneration"}
    (out / _MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    for path in out.iterdir():  # safetensors are written 0600; a shared cache wants 0644
        path.chmod(0o644)


def build_tiny_qwen_vl(cache_dir: str | Path | None = None) -> Path:
    """The folder of the tiny Qwen3-VL, built and cached on first use (a few seconds, offline).

    Args:
        cache_dir: the cache root; defaults to :func:`twinkle_core.hub.cache_root`.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    final = root / "tiny-models" / f"qwen3_vl-v{TINY_QWEN_VL_VERSION}"
    return build_cached_folder(final, _MARKER, _write)
