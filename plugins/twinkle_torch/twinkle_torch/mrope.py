"""Multimodal rotary positions (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): where each token sits, per row.

A model whose rotary embedding has a temporal, a height and a width section
(``mrope_section`` in its text config) places a prompt's text tokens on one
line, as any model does, but an image's tokens on a grid: the ``t x h x w``
tokens of one image take ``max(h, w)`` positions, not ``t x h x w``, and the
text after the image goes on from there. So a row's positions run behind its
length by a per-row offset, its ``rope_delta`` (negative, larger for larger
images), fixed once its prompt is read: every token generated after it is
text, at the row's length plus that delta, in all three sections.

The model's own code computes the prefill's positions
(``get_rope_index`` of its base model: the exact grid each family uses).
Its forward would compute them too, but keeps the deltas on the model
(``model.rope_deltas``), one batch's at a time: a decode loop whose rows come
and go would read another batch's. So the engine passes the positions
itself: at a prefill, the ``[3, rows, width]`` positions of
``get_rope_index``; after it, each row's next position (its length plus its
delta, :attr:`twinkle_torch.batch.Batch.next_pos`), which the model spreads
over the three sections as text. A row prefilled again (a resume, an
eviction) has its generated tokens marked as text (:mod:`twinkle_torch.media`)
and gets the same positions back.
"""

from __future__ import annotations

from typing import Any

import torch

from twinkle_core.errors import ConfigError, InvalidInputError

__all__ = ["RopeIndex", "multimodal_positions"]

#: The media inputs ``get_rope_index`` reads beside the ids (Qwen-VL family, transformers 5.19).
_GRIDS = ("image_grid_thw", "video_grid_thw")


def multimodal_positions(config: Any) -> bool:
    """Whether the model places tokens by multimodal rotary positions (a temporal, height and width section)."""
    text = config.get_text_config(decoder=True)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return isinstance(rope, dict) and "mrope_section" in rope


class RopeIndex:
    """The prefill positions of a model with multimodal rotary positions, by the model's own ``get_rope_index``.

    Args:
        get_rope_index: the base model's method (``model.model.get_rope_index``).
    """

    def __init__(self, get_rope_index: Any) -> None:
        self.get_rope_index = get_rope_index

    @classmethod
    def of(cls, model: Any) -> RopeIndex | None:
        """The model's, or ``None`` for a model whose positions are one line.

        Raises:
            ConfigError: a vision-language model with multimodal positions whose
                base model has no ``get_rope_index`` to place them.
        """
        if not multimodal_positions(model.config):
            return None
        base = getattr(model, "model", None)
        method = getattr(base, "get_rope_index", None)
        if callable(method):
            return cls(method)
        if getattr(base, "visual", None) is None:
            return None  # a text model (no vision tower): its positions are text positions in all three sections
        raise ConfigError(
            f"{type(model).__name__} places image tokens by multimodal rotary positions, but its base model has no"
            " get_rope_index to compute them: the torch engine cannot sample it with images."
        )

    def __call__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, media: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The ``[3, rows, width]`` positions of a left-padded prefill and each row's delta ``[rows]``.

        ``None`` where no row holds an image or a video: the rows' positions are then their text positions.
        """
        grids = {key: media[key] for key in _GRIDS if key in media}
        if not grids:
            return None
        if "mm_token_type_ids" not in media:
            raise InvalidInputError(
                "A prompt with an image lacks its mm_token_type_ids (which tokens are image tokens), which this model"
                " needs to place them: encode it with the model's processor (ProcessorTemplate), which gives them."
            )
        positions, deltas = self.get_rope_index(
            input_ids, mm_token_type_ids=media["mm_token_type_ids"], attention_mask=attention_mask, **grids
        )
        return positions, deltas.reshape(-1).to(device=input_ids.device, dtype=torch.long)
