"""A tiny vision-language model, built offline, for tests of prompts with images.

A ``LlavaForConditionalGeneration``: a two-layer CLIP vision tower on 28 x 28
images in 7 x 7 patches (16 patches, so 16 ``<image>`` tokens per image),
a projector, and a two-layer Qwen2 language model of hidden size 64, with
random weights (seeded). The tokenizer is the tiny models' byte-level BPE
(:func:`~twinkle_core.testing.tiny_model.train_tiny_tokenizer`) plus the
``<image>`` token; the folder holds a ``processor_config.json`` that
``AutoProcessor`` loads as a ``LlavaProcessor`` with the PIL-backed CLIP
image processor, and a chat template that renders an image block as
``<image>``.

Why Llava and not Qwen2-VL: transformers 5.19 cannot build a Qwen2-VL (or
Qwen2.5-VL) processor without torchvision, since their processors hold a
video processor whose base class needs it; Llava's processor holds an image
processor and a tokenizer only, so the model's own ``AutoProcessor`` is the
reference here. Its CLIP weights are saved under the names published Llava
checkpoints use (``vision_tower.vision_model.*``), which vLLM's loader reads,
so the one folder runs on both engines.

Cached under ``$TWINKLE_CACHE/tiny-models/llava-v<TINY_VLM_VERSION>`` as the
other tiny models are (:func:`twinkle_core.hub.build_cached_folder`).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from twinkle_core.hub import build_cached_folder, cache_root

__all__ = ["TINY_VLM_CHAT_TEMPLATE", "TINY_VLM_VERSION", "build_tiny_vlm", "write_tiny_vlm"]

#: Bumped whenever the built folder changes.
TINY_VLM_VERSION = 2
_IMAGE_SIZE = 28
_PATCH_SIZE = 7
_SEED = 20260158
_MARKER = "twinkle_tiny_vlm.json"

#: ChatML, with image and video blocks rendered as the model's placeholder.
TINY_VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'text' %}{{ part.text }}{%- elif part.type == 'image' %}{{ '<image>' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _processor(folder: Path) -> Any:
    """The tokenizer (with ``<image>``) and the Llava processor, saved into ``folder``."""
    from tokenizers import AddedToken
    from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

    from twinkle_core.testing.tiny_model import TINY_MAX_MODEL_LEN, train_tiny_tokenizer

    raw = train_tiny_tokenizer("qwen2")
    raw.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=TINY_MAX_MODEL_LEN
    )
    images = CLIPImageProcessorPil(
        size={"shortest_edge": _IMAGE_SIZE}, crop_size={"height": _IMAGE_SIZE, "width": _IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=_PATCH_SIZE,
        vision_feature_select_strategy="default",
        chat_template=TINY_VLM_CHAT_TEMPLATE,
        image_token="<image>",
        num_additional_image_tokens=1,  # CLIP's class token, which the "default" strategy drops
    )
    processor.save_pretrained(str(folder))
    return processor


def write_tiny_vlm(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Build the tiny VLM into ``folder`` (no cache); returns the metadata also written to its marker file."""
    import torch
    from transformers import GenerationConfig, LlavaConfig, LlavaForConditionalGeneration

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    processor = _processor(out)
    tokenizer = processor.tokenizer
    config = LlavaConfig(
        text_config={
            "model_type": "qwen2",
            "vocab_size": len(tokenizer),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": tokenizer.model_max_length,
        },
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": _IMAGE_SIZE,
            "patch_size": _PATCH_SIZE,
            "projection_dim": 32,
        },
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_SEED)
        model = LlavaForConditionalGeneration(config)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(out))
    _nest_clip_weights(out / "model.safetensors")
    meta = {"version": TINY_VLM_VERSION, "architecture": "LlavaForConditionalGeneration", "vocab_size": len(tokenizer)}
    (out / _MARKER).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    for path in out.iterdir():  # safetensors are written 0600; a shared cache wants 0644
        path.chmod(0o644)
    return meta


def _nest_clip_weights(path: Path) -> None:
    """Name the CLIP tower's weights ``vision_tower.vision_model.*``, as published Llava checkpoints do.

    transformers 5.19 saves them without the ``vision_model.`` level (it drops
    that level when it loads a ``CLIPVisionModel``, and saves what it holds);
    vLLM's Llava loader reads the published layout only ("There is no module or
    parameter named 'vision_tower.embeddings'"). transformers loads both.
    """
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    nested = {
        re.sub(r"^vision_tower\.(?!vision_model\.)", "vision_tower.vision_model.", k): v for k, v in tensors.items()
    }
    save_file(nested, str(path), metadata={"format": "pt"})


def build_tiny_vlm(cache_dir: str | Path | None = None) -> Path:
    """The folder of the tiny VLM, built and cached on first use (a few seconds, offline).

    Args:
        cache_dir: the cache root; defaults to :func:`twinkle_core.hub.cache_root`.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    final = root / "tiny-models" / f"llava-v{TINY_VLM_VERSION}"

    def build(out: Path) -> None:
        write_tiny_vlm(out)

    return build_cached_folder(final, _MARKER, build)
