"""``ProcessorTemplate``: the template of a model with a processor, encoding prompts with images and videos.

One expansion, by the model's own processor (``AutoProcessor``): the chat
template renders each medium as the model's placeholder (``<image>``,
``<|vision_start|><|image_pad|><|vision_end|>``), and the processor
replaces each placeholder by as many tokens as that image takes and computes
the inputs the model's forward reads beside the ids (``pixel_values``,
``image_grid_thw``...). Both land on the prompt's ``InputFeature``
(``input_ids`` expanded, ``multimodal`` the rest), the one source every
engine and the trainer read; the length checked against the context is the
expanded one.

The work is bounded in order: the media are counted and the text's tokens
bounded before any image is decoded (:mod:`twinkle_core.data_format.media_loading`),
and the processor runs last. A prompt without media is encoded as by
:class:`~twinkle_core.template.Template`.
"""

from __future__ import annotations

import os
from typing import Any

from twinkle_core.data_format import InputFeature, Trajectory
from twinkle_core.data_format.media import MediaRef
from twinkle_core.data_format.media_loading import MediaLimits, load_media
from twinkle_core.errors import InvalidInputError, PromptTooLongError, UnsupportedFeatureError
from twinkle_core.hub import PROCESSOR_FILES, has_processor
from twinkle_core.template.base import Template, _as_trajectory, _text_only
from twinkle_core.template.image_only import image_only_processor, needs_torchvision

__all__ = ["PROCESSOR_FILES", "ProcessorTemplate", "has_processor"]

#: Outputs of a processor that are not media inputs: the ids and mask are the feature's own fields.
_TEXT_OUTPUTS = frozenset({"input_ids", "attention_mask"})


class ProcessorTemplate(Template):
    """A tokenizer, its chat template, and the model's processor for the media in prompts.

    Args:
        tokenizer: the processor's tokenizer.
        processor: a Hugging Face processor (``AutoProcessor.from_pretrained``).
        limits: how many media a prompt may hold, how large, from where.
        chat_template: overrides the processor's chat template.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        processor: Any,
        limits: MediaLimits | None = None,
        chat_template: str | None = None,
    ) -> None:
        super().__init__(tokenizer, chat_template=chat_template or getattr(processor, "chat_template", None))
        self.processor = processor
        self.limits = limits or MediaLimits()

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike[str], **kwargs: Any) -> ProcessorTemplate:
        """Build from a local model folder with a processor (imports transformers lazily).

        Where the processor's video processor needs torchvision, which is not
        installed, the processor is built for images only
        (:func:`~twinkle_core.template.image_only.image_only_processor`): a
        prompt with a video is then refused by name.
        """
        from transformers import AutoProcessor

        try:
            processor = AutoProcessor.from_pretrained(str(model_dir))
        except ImportError as exc:
            if not needs_torchvision(exc):
                raise
            processor = image_only_processor(model_dir)
        return cls(processor.tokenizer, processor=processor, **kwargs)

    def _messages(self, trajectory: Trajectory) -> list[dict[str, Any]]:
        messages, _ = trajectory.media()
        return [m if _has_media(m) else _text_only(i, m) for i, m in enumerate(messages)]

    def encode(
        self,
        trajectory: Trajectory | dict[str, Any],
        add_generation_prompt: bool = True,
        *,
        max_tokens: int | None = None,
        keep_last: int | None = None,
    ) -> InputFeature:
        """Encode a conversation; with media, ``input_ids`` expanded by the processor and ``multimodal`` set.

        Raises:
            InvalidMediaError: a medium that cannot be used, or more than ``limits`` allow.
            PromptTooLongError: more than ``max_tokens`` tokens once expanded.
            InvalidInputError: ``keep_last`` would cut a prompt with media.
            UnsupportedFeatureError: a video, and the processor takes none.
        """
        trajectory = _as_trajectory(trajectory)
        _, refs = trajectory.media()
        if not refs:
            return super().encode(trajectory, add_generation_prompt, max_tokens=max_tokens, keep_last=keep_last)
        self._check_parts(trajectory, max_tokens)
        images, videos = self.load_media(refs)
        text = self.render(trajectory, add_generation_prompt)
        self.tokenize(text, max_tokens=max_tokens)  # the text alone, bounded, before the processor's work
        ids, multimodal = self.process(text, images, videos)
        if max_tokens is not None and len(ids) > max_tokens:
            raise PromptTooLongError(
                f"The prompt has {len(ids)} tokens with its media expanded, more than the {max_tokens} accepted.",
                index=0,
                length=len(ids),
                limit=max_tokens,
            )
        if keep_last is not None and len(ids) > keep_last:
            raise InvalidInputError(
                f"The prompt has {len(ids)} tokens with its media expanded; truncating it to its last {keep_last}"
                " would cut media from it. Send a shorter prompt, or fewer or smaller images."
            )
        return InputFeature(input_ids=ids, multimodal=multimodal, images=images, extra=dict(trajectory.extra))

    def load_media(self, refs: list[MediaRef]) -> tuple[list[Any], list[list[Any]]]:
        """The media of ``refs`` decoded, in order, within :attr:`limits` (counted before any is decoded).

        Raises:
            InvalidMediaError: a medium that cannot be used (named by its place in ``refs``), or too many.
            UnsupportedFeatureError: a video, and the processor takes none.
        """
        if any(kind == "video" for kind, _, _ in refs) and getattr(self.processor, "video_processor", None) is None:
            raise UnsupportedFeatureError(
                f"The prompt holds a video, but this model's processor ({type(self.processor).__name__}) takes"
                " images only."
            )
        return load_media(refs, self.limits)

    def process(
        self, text: str, images: list[Any], videos: list[list[Any]] | None = None
    ) -> tuple[list[int], dict[str, Any]]:
        """Rendered ``text`` (a whole prompt, or the part an episode appends) through the processor: its ids with
        the placeholder of each medium expanded, and the processed inputs of those media, in their order."""
        media: dict[str, Any] = {"images": images} if images else {}
        if videos:
            media["videos"] = videos
        out = self.processor(text=[text], return_tensors="np", add_special_tokens=False, **media)
        ids = [int(t) for t in out["input_ids"][0]]
        self._check_placed(ids, len(images))
        return ids, {k: v for k, v in out.items() if k not in _TEXT_OUTPUTS and v is not None}

    def _check_placed(self, ids: list[int], images: int) -> None:
        """Refuse images the expanded ids hold no tokens for (the model would never see them).

        A chat template that renders no placeholder for an image block, or a
        tokenizer without the processor's image token (a checkpoint's text
        tokenizer beside a vision tower), gives ids without image tokens,
        and the processor does not say so.
        """
        if not images or not hasattr(self.processor, "image_token_id"):
            return  # a processor that names no image token: nothing to count
        token = self.processor.image_token_id
        if isinstance(token, int) and ids.count(token) >= images:
            return
        name = getattr(self.processor, "image_token", None)
        raise UnsupportedFeatureError(
            f"The prompt holds {images} image(s), but its ids hold {0 if token is None else ids.count(token)} of"
            f" the image token {name!r} (id {token}): this model's chat template or tokenizer does not place"
            " images, so the model would not see them."
        )


def _has_media(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(part.get("type") in ("image", "video") for part in content)
