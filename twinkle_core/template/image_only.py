"""The model's own processor, for images only, where its video processor needs torchvision.

transformers 5.19 builds the processors of the Qwen-VL family
(``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor``, which
Qwen3.5 checkpoints name) with a video processor whose base class needs
torchvision; without it ``AutoProcessor.from_pretrained`` raises
``ImportError`` ("Qwen3VLVideoProcessor requires the Torchvision library"),
though the image processor has a PIL twin that needs nothing
(``Qwen2VLImageProcessorPil``). Handing the processor ``video_processor=None``
does not help: its base class checks every sub-processor it declares against
the video processor's base class, which is not there either.

:func:`image_only_processor` builds the same processor class with one
sub-processor fewer: a subclass whose constructor declares only the image
processor and the tokenizer (``ProcessorMixin`` reads the sub-processors a
class holds from its constructor's parameters). Everything else is the
model's own code, unchanged: the placeholder expansion
(``replace_image_token``: ``image_grid_thw.prod() // merge_size**2`` tokens
per image), ``mm_token_type_ids``, the checks of special tokens. So the ids
and arrays are the ones the full processor gives for images. The processor
has no ``video_processor``, so a prompt with a video is refused by name, as
for any image-only processor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from twinkle_core.errors import ConfigError

__all__ = ["image_only_processor", "needs_torchvision"]


def needs_torchvision(exc: BaseException) -> bool:
    """Whether ``AutoProcessor`` failed only because a sub-processor's class needs torchvision."""
    return isinstance(exc, ImportError) and "torchvision" in str(exc).lower()


def image_only_processor(model_dir: str | os.PathLike[str], tokenizer: Any = None) -> Any:
    """The processor ``AutoProcessor`` would build for ``model_dir``, without its video processor.

    The class is the one the folder names (``processor_class`` in its
    processor or tokenizer config), else the one ``AutoProcessor`` maps its
    config to; the image processor is ``AutoImageProcessor``'s (the PIL one
    where torchvision is missing); the tokenizer and its chat template
    ``AutoTokenizer``'s, unless ``tokenizer`` is given (vLLM hands its own).

    Raises:
        ConfigError: the folder names no processor class transformers has, or
            that class does not take an image processor and a tokenizer.
    """
    from transformers import AutoImageProcessor, AutoTokenizer

    base = _processor_class(Path(model_dir))
    params = _init_parameters(base)
    if not {"image_processor", "tokenizer"} <= params:
        raise ConfigError(
            f"The processor of {str(model_dir)!r} ({base.__name__}) needs torchvision, and it does not take an image"
            " processor and a tokenizer alone (its sub-processors: "
            f"{sorted(p for p in params if p.endswith(('processor', 'tokenizer', 'extractor')))})."
        )

    class ImageOnly(base):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None) -> None:
            # the base class's own constructor, with no video processor: ProcessorMixin keeps the
            # sub-processors this constructor declares (the image processor and the tokenizer)
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template)

    ImageOnly.__name__ = ImageOnly.__qualname__ = f"{base.__name__}ImagesOnly"
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    images = AutoImageProcessor.from_pretrained(str(model_dir))
    return ImageOnly(images, tokenizer, chat_template=getattr(tokenizer, "chat_template", None))


def _processor_class(folder: Path) -> Any:
    from transformers import AutoConfig
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    name = None
    for file in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = folder / file
        if name is None and path.is_file():
            name = json.loads(path.read_text(encoding="utf-8")).get("processor_class")
    if name is None:
        name = PROCESSOR_MAPPING_NAMES.get(AutoConfig.from_pretrained(str(folder)).model_type)
    cls = processor_class_from_name(name) if isinstance(name, str) else None
    if not isinstance(cls, type) or not hasattr(cls, "get_attributes"):
        raise ConfigError(f"{str(folder)!r} names no processor class transformers has (found {name!r}).")
    return cls


def _init_parameters(cls: type) -> set[str]:
    import inspect

    return set(inspect.signature(cls).parameters)
