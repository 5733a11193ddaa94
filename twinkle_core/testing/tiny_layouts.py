"""The tiny Qwen3.5 in the layout its real checkpoints ship: a stand-in for ``Qwen/Qwen3.5-4B``, built offline.

Every Qwen3.5 checkpoint, the 4B of the reference's examples included, is a
vision-language model: its ``config.json`` is a ``Qwen3_5Config`` naming
``Qwen3_5ForConditionalGeneration``, with the language model's settings under
``text_config`` (``mtp_num_hidden_layers`` among them) and the vision tower's
under ``vision_config``; its weights nest the language model
(``model.language_model.*``), hold the tower (``model.visual.*``) and a
multi-token-prediction block (``mtp.*``); an image and a video processor
config sit beside the tokenizer. A user who samples text from it must get
exactly the text model: the engines load only the language model (the torch
engine through ``AutoModelForCausalLM``, vLLM with ``language_model_only``)
and ignore the tower and the MTP block.

:func:`build_tiny_checkpoint_layout` writes that layout around the tiny
Qwen3.5 (:func:`~twinkle_core.testing.tiny_model.build_tiny_model`): the
same language weights under the nested names, plus a small random vision
tower and MTP block, so that sampling the layout must give the tiny text
model's own tokens and log-probs. :func:`modelscope_snapshot` puts a folder
where ModelScope's offline cache looks, so ``ms://Qwen/Qwen3.5-4B`` resolves
to it with no network.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from twinkle_core.hub import build_cached_folder

__all__ = [
    "TINY_LAYOUT_VERSION",
    "TINY_QWEN3_5_VL_VERSION",
    "build_tiny_checkpoint_layout",
    "build_tiny_qwen3_5_vl",
    "modelscope_snapshot",
]

#: Bumped whenever the built folder changes (the tiny text model's own version is part of its name too).
TINY_LAYOUT_VERSION = 1
#: Bumped whenever the folder :func:`build_tiny_qwen3_5_vl` builds changes.
TINY_QWEN3_5_VL_VERSION = 1
_MARKER = "twinkle_tiny_layout.json"
_SEED = 20260357
#: Files of the text model that the layout does not copy: its own weights, config and marker are rewritten.
_REWRITTEN = ("model.safetensors", "config.json", "twinkle_tiny_model.json")


def build_tiny_checkpoint_layout() -> Path:
    """The tiny Qwen3.5 laid out as a Qwen3.5 checkpoint ships (VL config, nested names, tower, MTP), cached.

    Returns:
        The folder, next to the tiny text model's: ``<cache>/tiny-models/<text model>-vl-layout-v<N>``.
    """
    from twinkle_core.testing.tiny_model import build_tiny_model

    text = build_tiny_model("qwen3_5")
    final = text.parent / f"{text.name}-vl-layout-v{TINY_LAYOUT_VERSION}"
    return build_cached_folder(final, _MARKER, lambda out: _write_layout(text, out))


def build_tiny_qwen3_5_vl() -> Path:
    """The tiny Qwen3.5 as a vision-language model that takes images: the layout, with Qwen's vision tokens.

    The same folder as :func:`build_tiny_checkpoint_layout` (trained text
    weights nested, random tower and MTP block), but its tokenizer gains
    Qwen's four vision tokens (ids 768-771, after the tiny vocabulary) and a
    chat template that writes an image block as ``<|vision_start|><|image_pad|>
    <|vision_end|>``; the embedding and the head gain a row for each (the
    head's rows zero: for text their logits are 0, against a tiny model's
    winning logits of 10 or more). It is a separate folder because the layout
    promises the text model's log-probs bit for bit, which four more logits in
    every softmax cannot keep, and the tiny vocabulary has no free id.

    Returns:
        The folder: ``<cache>/tiny-models/<text model>-vl-v<N>``.
    """
    from twinkle_core.testing.tiny_model import build_tiny_model

    text = build_tiny_model("qwen3_5")
    final = text.parent / f"{text.name}-vl-v{TINY_QWEN3_5_VL_VERSION}"
    return build_cached_folder(final, _MARKER, lambda out: _write_layout(text, out, images=True))


def _vision_tokenizer(text: Path, out: Path) -> dict[str, int]:
    """Save the text model's tokenizer plus Qwen's vision tokens in ``out``; their ids by the config's names."""
    from transformers import AutoTokenizer

    from twinkle_core.testing.tiny_qwen_vl import IMAGE_BLOCK, VIDEO_BLOCK, VISION_TOKENS, add_vision_tokens

    tokenizer = AutoTokenizer.from_pretrained(str(text))
    text_part = "{%- if part.type == 'text' -%}{{- part.text -}}"
    assert text_part in tokenizer.chat_template, "the tiny Qwen3.5's template renders text parts so"
    template = tokenizer.chat_template.replace(
        text_part,
        text_part + f"{{%- elif part.type == 'image' -%}}{{{{- '{IMAGE_BLOCK}' -}}}}"
        f"{{%- elif part.type == 'video' -%}}{{{{- '{VIDEO_BLOCK}' -}}}}",
    )
    add_vision_tokens(tokenizer, template).save_pretrained(str(out))
    names = ("vision_start_token_id", "image_token_id", "video_token_id", "vision_end_token_id")
    return {name: int(tokenizer.convert_tokens_to_ids(t)) for name, t in zip(names, VISION_TOKENS)}


def _write_layout(text: Path, out: Path, images: bool = False) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    for path in text.iterdir():
        if path.name not in _REWRITTEN:
            shutil.copy2(path, out / path.name)
    text_config = json.loads((text / "config.json").read_text(encoding="utf-8"))
    media_ids = _vision_tokenizer(text, out) if images else None
    config = _layout_config(text_config, media_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for name, content in _processor_configs(config).items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")

    weights = {
        (name if name == "lm_head.weight" else "model.language_model." + name.removeprefix("model.")): tensor
        for name, tensor in load_file(str(text / "model.safetensors")).items()
    }
    generator = torch.Generator().manual_seed(_SEED)
    if media_ids is not None:  # a row of each for the vision tokens: embedded as noise, never predicted
        embed = "model.language_model.embed_tokens.weight"
        extra = len(media_ids)
        weights[embed] = torch.cat([weights[embed], _noise(torch.empty(extra, weights[embed].shape[1]), generator)])
        weights["lm_head.weight"] = torch.cat(
            [weights["lm_head.weight"], torch.zeros(extra, weights["lm_head.weight"].shape[1])]
        )
    weights.update(_random_tower(config, generator, reads_images=images))
    weights.update(_random_mtp(config["text_config"], generator))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    version = TINY_QWEN3_5_VL_VERSION if images else TINY_LAYOUT_VERSION
    marker = {"built_from": text.name, "layout": "Qwen3_5ForConditionalGeneration", "version": version}
    if images:
        marker["images"] = True
    (out / _MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")  # last: marks it complete


def _layout_config(text_config: dict[str, Any], media_ids: dict[str, int] | None = None) -> dict[str, Any]:
    """The checkpoint's ``config.json``: the text model's settings nested as ``text_config``, a small tower's beside.

    ``media_ids``: the vision tokens' ids where the tokenizer has them (the vocabulary grows to hold them).
    """
    from transformers import Qwen3_5Config

    inner = {k: v for k, v in text_config.items() if k not in ("architectures", "transformers_version")}
    inner.update(model_type="qwen3_5_text", mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    vocab = int(text_config["vocab_size"])
    if media_ids is not None:
        inner["vocab_size"] = vocab = max(vocab, max(media_ids.values()) + 1)
    vision = dict(
        depth=1, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14, spatial_merge_size=2,
        temporal_patch_size=2, out_hidden_size=int(text_config["hidden_size"]), num_position_embeddings=64,
    )  # fmt: skip
    # without vision tokens, the media ids are the last of the tiny vocabulary (the real ones are past it)
    ids = media_ids or {
        "image_token_id": vocab - 4,
        "video_token_id": vocab - 3,
        "vision_start_token_id": vocab - 2,
        "vision_end_token_id": vocab - 1,
    }
    config = Qwen3_5Config(
        text_config=inner,
        vision_config=vision,
        **ids,
        tie_word_embeddings=bool(text_config.get("tie_word_embeddings", False)),
        architectures=["Qwen3_5ForConditionalGeneration"],
    ).to_dict()
    assert isinstance(config, dict)
    config.pop("transformers_version", None)
    return config


def _processor_configs(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The image and video processor configs a Qwen3.5 checkpoint ships, at the tiny tower's patch size."""
    vision = config["vision_config"]
    common = {
        "patch_size": vision["patch_size"],
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": vision["spatial_merge_size"],
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    return {
        "preprocessor_config.json": {
            **common,
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": "Qwen3VLProcessor",
            "size": {"shortest_edge": 56 * 56, "longest_edge": 224 * 224},
        },
        "video_preprocessor_config.json": {
            **common,
            "video_processor_type": "Qwen3VLVideoProcessor",
            "processor_class": "Qwen3VLProcessor",
            "size": {"shortest_edge": 56 * 56, "longest_edge": 224 * 224},
        },
    }


def _random_tower(config: dict[str, Any], generator: Any, reads_images: bool = False) -> dict[str, Any]:
    """A random vision tower of ``config``'s shape, under the checkpoint's names (``model.visual.*``).

    ``reads_images``: its norms scale by one, as initialised, so that its
    output depends on the pixels (norm weights of noise would leave mostly
    the biases, the same for every image); else every tensor is noise.
    """
    import torch
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    vision_config = Qwen3_5Config(**config).vision_config
    tower = Qwen3_5VisionModel._from_config(vision_config, dtype=torch.float32)
    return {
        f"model.visual.{name}": (
            torch.ones_like(t) if reads_images and "norm" in name and name.endswith("weight") else _noise(t, generator)
        )
        for name, t in tower.state_dict().items()
    }


def _random_mtp(text_config: dict[str, Any], generator: Any) -> dict[str, Any]:
    """A random one-layer multi-token-prediction block under the checkpoint's names (``mtp.*``).

    The block is a full-attention decoder layer between norms, fed by a
    projection of the embedding and the last hidden state together; engines
    that sample without speculative decoding never read it.
    """
    import torch

    hidden, inter = int(text_config["hidden_size"]), int(text_config["intermediate_size"])
    heads, kv_heads = int(text_config["num_attention_heads"]), int(text_config["num_key_value_heads"])
    head_dim = int(text_config["head_dim"])
    layer = "mtp.layers.0."
    shapes = {
        "mtp.fc.weight": (hidden, 2 * hidden),
        "mtp.pre_fc_norm_embedding.weight": (hidden,),
        "mtp.pre_fc_norm_hidden.weight": (hidden,),
        "mtp.norm.weight": (hidden,),
        layer + "input_layernorm.weight": (hidden,),
        layer + "post_attention_layernorm.weight": (hidden,),
        layer + "self_attn.q_proj.weight": (2 * heads * head_dim, hidden),  # the output gate doubles the queries
        layer + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        layer + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        layer + "self_attn.o_proj.weight": (hidden, heads * head_dim),
        layer + "self_attn.q_norm.weight": (head_dim,),
        layer + "self_attn.k_norm.weight": (head_dim,),
        layer + "mlp.gate_proj.weight": (inter, hidden),
        layer + "mlp.up_proj.weight": (inter, hidden),
        layer + "mlp.down_proj.weight": (hidden, inter),
    }
    return {name: _noise(torch.empty(shape), generator) for name, shape in shapes.items()}


def _noise(like: Any, generator: Any) -> Any:
    import torch

    return (0.02 * torch.randn(like.shape, generator=generator)).to(like.dtype).contiguous()


def modelscope_snapshot(folder: Path, repo_id: str, cache: Path, revision: str = "master") -> Path:
    """Put a copy of ``folder`` where ModelScope's cache keeps ``repo_id``, so ``ms://<repo_id>`` resolves offline.

    Args:
        folder: the model folder to stand in for the download.
        repo_id: ``org/name`` as ModelScope spells it.
        cache: the ModelScope cache root (``$MODELSCOPE_CACHE``).
        revision: the snapshot's revision folder.

    Returns:
        The snapshot folder.
    """
    snapshot = cache / "models" / repo_id.replace("/", "--") / "snapshots" / revision
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(folder, snapshot, dirs_exist_ok=True)
    return snapshot
