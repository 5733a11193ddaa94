"""twinkle-vllm's ``vllm.general_plugins`` entry point: what vLLM's own processes need from us.

vLLM calls :func:`register` in every process it runs (the front end, the
engine core, the workers, the subprocess that inspects a model's
architecture), before any model module is imported.

**A torchvision-free image processor, only where torchvision is missing.**
vLLM's Qwen3.5 module (and every Qwen-VL one) imports, at module level,
``transformers.models.qwen2_vl.image_processing_qwen2_vl``: the
torchvision-backed ``Qwen2VLImageProcessor`` and its ``smart_resize``. On a
machine without torchvision (the CPU build here: PyPI's torchvision wheel does
not load against the CPU torch) that import fails, so vLLM cannot even inspect
the architecture, although a text-only Qwen3.5 never processes an image.
``transformers`` ships the same processor on PIL and NumPy
(``image_processing_pil_qwen2_vl``: the same ``smart_resize``, the same
outputs); where torchvision cannot be found, the module vLLM imports is
registered as that one's names. With torchvision installed nothing is touched.
"""

from __future__ import annotations

import importlib.util
import sys
import types

__all__ = ["register", "torchvision_free_image_processor"]

#: The torchvision-backed module vLLM's Qwen-VL family imports, and its PIL twin in transformers.
_TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


def register() -> None:
    """vLLM's general-plugin hook: install what this process lacks (called once per process, maybe more)."""
    torchvision_free_image_processor()


def torchvision_free_image_processor() -> bool:
    """Where torchvision is missing, let the torchvision image processor's module resolve to its PIL twin.

    Returns:
        Whether the PIL twin was installed (``False`` where torchvision is
        present, or where the module already imports).
    """
    if importlib.util.find_spec("torchvision") is not None or _TORCHVISION_MODULE in sys.modules:
        return False
    pil = importlib.import_module(_PIL_MODULE)
    shim = types.ModuleType(_TORCHVISION_MODULE, pil.__doc__)
    shim.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
    shim.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
    shim.__file__ = getattr(pil, "__file__", None)
    sys.modules[_TORCHVISION_MODULE] = shim
    return True
