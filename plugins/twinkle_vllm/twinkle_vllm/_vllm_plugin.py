"""twinkle-vllm's ``vllm.general_plugins`` entry point: what vLLM's own processes need from us.

vLLM calls :func:`register` in every process it runs (the front end, the
engine core, the workers, the subprocess that inspects a model's
architecture), before any model module is imported.

**Torchvision-free image processors, only where torchvision is missing.**
Some of vLLM's model modules import, at module level, a torchvision-backed
image processor module of ``transformers``: the Qwen-VL family (Qwen3.5
included) imports ``image_processing_qwen2_vl`` for ``Qwen2VLImageProcessor``
and its ``smart_resize``; Llava imports Pixtral's module, which imports
``image_processing_pixtral`` for ``_num_image_tokens``. On a machine without
torchvision (the CPU build here: PyPI's torchvision wheel does not load
against the CPU torch) that import fails, so vLLM cannot even inspect the
architecture, although a text-only Qwen3.5 never processes an image and a
Llava with a CLIP tower never runs Pixtral's processor. ``transformers`` ships
each of these processors on PIL and NumPy too (``image_processing_pil_*``: the
same helpers, the same outputs); where torchvision cannot be found, each
module vLLM imports is registered as its PIL twin's names. With torchvision
installed nothing is touched.

**The Qwen-VL processors, for images only, where torchvision is missing.**
vLLM builds a model's full ``transformers`` processor to expand its
placeholders (for Qwen3-VL: ``Qwen3VLProcessor``, with its video processor),
and transformers 5.19 builds the Qwen-VL family's video processors only with
torchvision. Where that build fails for that reason alone, vLLM's processor
loader is given the same processor class without its video processor
(:func:`twinkle_core.template.image_only.image_only_processor`, which the
template uses too): the placeholder expansion and the image arrays are the
model's own code. vLLM still reads the video processor's sizes when it
budgets its encoder cache, so the processor holds the checkpoint's own video
processor, imported from its module (which builds without torchvision and
reports its sizes; only processing a video needs torchvision). twinkle
passes vLLM no videos (the engine declares images only). With torchvision
installed nothing is touched.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

__all__ = ["TORCHVISION_TWINS", "image_only_processor_fallback", "register", "torchvision_free_image_processor"]

#: The torchvision-backed modules vLLM's model modules import: their PIL twins in transformers, and
#: the class names the twin gives a different name (the torchvision name -> the PIL one).
TORCHVISION_TWINS: dict[str, tuple[str, dict[str, str]]] = {
    "transformers.models.qwen2_vl.image_processing_qwen2_vl": (
        "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl",
        {"Qwen2VLImageProcessor": "Qwen2VLImageProcessorPil"},
    ),
    "transformers.models.pixtral.image_processing_pixtral": (
        "transformers.models.pixtral.image_processing_pil_pixtral",
        {"PixtralImageProcessor": "PixtralImageProcessorPil"},
    ),
}


def register() -> None:
    """vLLM's general-plugin hook: install what this process lacks (called once per process, maybe more)."""
    torchvision_free_image_processor()
    image_only_processor_fallback()


def torchvision_free_image_processor() -> bool:
    """Where torchvision is missing, let each torchvision image processor module vLLM imports resolve to its PIL twin.

    Returns:
        Whether any PIL twin was installed (``False`` where torchvision is
        present, or where every module already imports).
    """
    if importlib.util.find_spec("torchvision") is not None:
        return False
    installed = False
    for name, (twin, renamed) in TORCHVISION_TWINS.items():
        if name in sys.modules:
            continue
        pil = importlib.import_module(twin)
        shim = types.ModuleType(name, pil.__doc__)
        shim.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
        for torchvision_name, pil_name in renamed.items():
            setattr(shim, torchvision_name, getattr(pil, pil_name))
        shim.__file__ = getattr(pil, "__file__", None)
        sys.modules[name] = shim
        installed = True
    return installed


#: What vLLM's loader passes that the image-only processor honours too (vLLM hands its tokenizer).
_LOADER_OPTIONS = ("revision", "trust_remote_code", "processor_cls", "tokenizer")


def image_only_processor_fallback() -> bool:
    """Where torchvision is missing, let vLLM's processor loader build a processor for images only
    when the full one fails for want of torchvision.

    Returns:
        Whether vLLM's loader was wrapped (``False`` where torchvision is
        present, or where it already was).
    """
    if importlib.util.find_spec("torchvision") is not None:
        return False
    from functools import lru_cache

    from vllm.transformers_utils import processor as loader

    if getattr(loader.get_processor, "_twinkle_image_only", False):
        return False
    full = loader.get_processor

    def get_processor(processor_name: str, *args: Any, **kwargs: Any) -> Any:
        from twinkle_core.template.image_only import image_only_processor, needs_torchvision

        try:
            return full(processor_name, *args, **kwargs)
        except ImportError as exc:
            options = {k: v for k, v in kwargs.items() if k not in _LOADER_OPTIONS}
            if args or options or not needs_torchvision(exc):
                raise  # options for the full processor: not applied to another one silently
            path = loader.convert_model_repo_to_path(processor_name)
            videos = _video_processor(path)
            built = image_only_processor(path, tokenizer=kwargs.get("tokenizer"))
            wanted = kwargs.get("processor_cls")
            if videos is None or (wanted is not None and not isinstance(built, wanted)):
                raise
            built.video_processor = videos
            return built

    get_processor._twinkle_image_only = True  # type: ignore[attr-defined]
    loader.get_processor = get_processor
    loader.cached_get_processor = lru_cache(get_processor)
    return True


def _video_processor(folder: str) -> Any:
    """The video processor ``folder`` names, from its own module, or ``None`` where there is none to build.

    ``transformers.<name>`` is a stand-in that needs torchvision; the class in
    its module (which transformers' lazy module maps it to) builds without it.
    """
    import json
    import os

    import transformers

    path = os.path.join(folder, "video_preprocessor_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as file:
        name = json.load(file).get("video_processor_type")
    module = getattr(transformers, "_class_to_module", {}).get(name)
    if not isinstance(module, str):
        return None
    return getattr(importlib.import_module(f"transformers.{module}"), name).from_pretrained(folder)
