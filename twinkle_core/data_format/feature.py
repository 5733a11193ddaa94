"""``InputFeature``: token ids ready for an engine or a trainer."""

from __future__ import annotations

from typing import Any

import attrs

from twinkle_core.data_format._base import Record, check_extra
from twinkle_core.data_format.media import PER_TOKEN_INPUTS, check_source
from twinkle_core.data_format.routes import decode_routes, is_routes
from twinkle_core.errors import InvalidInputError

__all__ = ["IGNORE_INDEX", "PER_TOKEN_INPUTS", "InputFeature", "over_tokens", "training_feature"]

#: Label of a position that is not trained on (PyTorch's cross-entropy default).
IGNORE_INDEX = -100


def over_tokens(multimodal: dict[str, Any], length: int) -> dict[str, Any]:
    """A prompt's processed media inputs for a forward over ``length`` tokens (the prompt, then text).

    Per-token arrays (:data:`PER_TOKEN_INPUTS`) are extended with zeros (text)
    to ``length``: a model that reads them (Qwen-VL's ``mm_token_type_ids``,
    Gemma 3's ``token_type_ids``) refuses a forward whose ids they do not
    cover. The other arrays are shared, not copied.
    """
    import numpy as np

    out = dict(multimodal)
    for key in PER_TOKEN_INPUTS & out.keys():
        array = np.asarray(out[key])
        if array.ndim == 2 and array.shape[0] == 1 and array.shape[1] < length:
            out[key] = np.pad(array, ((0, 0), (0, length - array.shape[1])))
    return out


def _to_int_list(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and torch tensors, without importing either
        value = value.tolist()
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list) and not set(map(type, value)) <= {int}:  # one pass in C for the usual list of ints
        # numpy / torch integer scalars (a list of np.int64) are integers; floats and bools are not
        value = [t.tolist() if _integer_scalar(t) else t for t in value]
    return value


def _integer_scalar(value: Any) -> bool:
    """A numpy or torch integer scalar (not a bool), without importing either."""
    dtype = getattr(value, "dtype", None)
    return hasattr(value, "tolist") and getattr(value, "ndim", None) == 0 and "int" in str(dtype)


def _to_arrays(value: Any) -> Any:
    """Processed media inputs as numpy arrays: from their ``.npy`` base64 text (``to_dict``), tensors or lists."""
    if not isinstance(value, dict):
        return value
    out = {}
    for key, item in value.items():
        if isinstance(item, str):
            item = decode_routes(item)
        elif hasattr(item, "detach"):  # a torch tensor, without importing torch
            item = item.detach().cpu().numpy()
        elif isinstance(item, (list, tuple)):
            import numpy as np

            item = np.asarray(item)
        out[key] = item
    return out


def _check_multimodal(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict) or not all(isinstance(k, str) and is_routes(v) for k, v in value.items()):
        raise InvalidInputError(
            f"InputFeature.multimodal={value!r:.120} is invalid: expected a dict of the processor's outputs by name"
            " ('pixel_values', 'image_grid_thw'...), each an array (numpy, torch or nested lists)."
        )


def _check_images(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, list):
        raise InvalidInputError(f"InputFeature.images={value!r:.80} is invalid: expected a list of images.")
    for i, source in enumerate(value):
        check_source("image", source, f"InputFeature.images[{i}]")


def _check_ids(inst: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None and attribute.name != "input_ids":
        return
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidInputError(
            f"InputFeature.{attribute.name}={value!r:.200} is invalid: expected a flat list of integers."
        )


@attrs.define(kw_only=True)
class InputFeature(Record):
    """Token ids of one sequence.

    Attributes:
        input_ids: the token ids (for sampling: the prompt, non-empty).
        attention_mask: 1 for real tokens, 0 for padding; defaults to all ones.
            Sampling takes the prompt without the padding marked before or
            after it, and refuses any other mask.
        labels: targets for training, ``-100`` where nothing is trained (the
            prompt); ``None`` when not a training feature.
        extra: optional extras carried along (user data).
        multimodal: the processed media inputs the model's forward takes
            beside ``input_ids`` (``pixel_values``, ``image_grid_thw``...,
            whatever the model's processor returns), as numpy arrays, for a
            prompt with images or videos; ``None`` without. Its
            ``input_ids`` hold each image's placeholder tokens expanded.
        images: the images ``multimodal`` was computed from, decoded, in
            order (empty without): what an engine that runs the model's
            processor itself (vLLM) is handed, and checked against. In a plain
            dict, PNG ``data:`` URLs.
    """

    input_ids: list[int] = attrs.field(converter=_to_int_list, validator=_check_ids)
    attention_mask: list[int] | None = attrs.field(default=None, converter=_to_int_list, validator=_check_ids)
    labels: list[int] | None = attrs.field(default=None, converter=_to_int_list, validator=_check_ids)
    extra: dict[str, Any] = attrs.field(factory=dict, validator=check_extra)
    multimodal: dict[str, Any] | None = attrs.field(default=None, converter=_to_arrays, validator=_check_multimodal)
    images: list[Any] = attrs.field(factory=list, validator=_check_images)

    def __attrs_post_init__(self) -> None:
        if self.attention_mask is None:
            self.attention_mask = [1] * len(self.input_ids)
        for name in ("attention_mask", "labels"):
            other = getattr(self, name)
            if other is not None and len(other) != len(self.input_ids):
                raise InvalidInputError(
                    f"InputFeature.{name} has length {len(other)} but input_ids has {len(self.input_ids)}:"
                    " they must be equal."
                )

    def __len__(self) -> int:
        return len(self.input_ids)


def training_feature(prompt_ids: list[int], completion_tokens: list[int]) -> InputFeature:
    """Prompt + completion as one feature, labels ``-100`` on the prompt.

    ``labels[i]`` is the token at position ``i`` (unshifted, the Hugging Face
    convention: the model shifts them when computing the loss).
    """
    prompt, completion = list(prompt_ids), list(completion_tokens)
    return InputFeature(input_ids=prompt + completion, labels=[IGNORE_INDEX] * len(prompt) + completion)
