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
"""

from __future__ import annotations

import importlib.util
import sys
import types

__all__ = ["TORCHVISION_TWINS", "register", "torchvision_free_image_processor"]

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
