"""The processed media inputs of a prefill forward: the prompts' ``InputFeature.multimodal``, batched.

The model's processor made them once (:class:`~twinkle_core.template.processor.ProcessorTemplate`):
``input_ids`` with every image's placeholder tokens expanded, and beside
them what the forward reads (``pixel_values``, ``image_grid_thw``...). The
decode loop reads them at a prompt's prefill only: once the image's features
are in the cache, decode steps run on the language model as for text. A
prompt is never split across prefill forwards, so no image's tokens are
either; a row prefilled again (after an abort, or an out-of-memory eviction)
reads its prompt's media again.

Several prompts share one left-padded prefill forward, as a processor
batches them when given several texts: arrays per medium (``pixel_values``
of Llava, ``[images, channels, height, width]``; Qwen2-VL's flattened patches
and ``image_grid_thw``) are concatenated in row order, which is the order
the model scatters image features into the image tokens; arrays per token
(:data:`PER_TOKEN`) are placed under their row's tokens, zero under padding
and under tokens past the prompt (generated ones). Prompts without media add
nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from twinkle_core.data_format.media import PER_TOKEN_INPUTS

__all__ = ["PER_TOKEN", "media_inputs"]

#: Processor outputs with one value per prompt token (``[1, prompt length]``), zero for text tokens.
PER_TOKEN = PER_TOKEN_INPUTS


def media_inputs(
    media: Sequence[Mapping[str, Any] | None],
    lengths: Sequence[int],
    width: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """The media keyword arguments of one prefill forward (empty when no row has media).

    Args:
        media: per row of the forward, its prompt's processed media inputs (numpy arrays) or ``None``.
        lengths: per row, the tokens it prefills (its prompt, and what it generated before).
        width: the forward's padded length (rows are left-padded to it).
        device: where the model lives.
        dtype: the model's floating-point dtype (pixel values are cast to it, as the vision tower reads them).
    """
    keys = sorted({key for m in media if m for key in m})
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        if key in PER_TOKEN:
            out[key] = _per_token([m.get(key) if m else None for m in media], lengths, width)
        else:
            parts = [np.asarray(m[key]) for m in media if m and key in m]
            joined = np.concatenate(parts) if len(parts) > 1 else parts[0]
            # a prompt's arrays arrive read-only from Ray's object store: the forward gets its own copy then
            out[key] = torch.from_numpy(joined if joined.flags.writeable else joined.copy())
    return {
        key: value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
        for key, value in out.items()
    }


def _per_token(arrays: Sequence[Any], lengths: Sequence[int], width: int) -> torch.Tensor:
    """Per-token arrays ``[1, prompt length]`` of each row, left-padded to ``width``: ``[rows, width]``."""
    first = next(np.asarray(a) for a in arrays if a is not None)
    out = np.zeros((len(arrays), width), dtype=first.dtype)
    for row, (array, length) in enumerate(zip(arrays, lengths)):
        if array is None:
            continue
        values = np.asarray(array).reshape(-1)
        start = width - length
        out[row, start : start + min(values.size, length)] = values[:length]
    return torch.from_numpy(out)
