"""Prompts with images on vLLM: one expansion, the template's, checked against vLLM's.

The template runs the model's processor once: ``InputFeature.input_ids``
hold every image's placeholder expanded (16 ``<image>`` tokens for the tiny
Llava), and ``InputFeature.images`` the decoded images. vLLM 0.32 cannot be
handed those ids: its multimodal processor always applies its prompt updates
to the ids it is given, so already expanded ids are expanded a second time
(the first ``<image>`` of 16 becomes 16 more, and the images' features no
longer line up with their tokens). So each run of the image token is folded
back to the one placeholder the chat template wrote, vLLM's own processor
expands it again from the images (:meth:`Renderer.render_cmpl_async`, in the
front-end process, before anything reaches the engine core), and the ids
vLLM would run are compared with the template's: a prompt whose expansions
differ is refused by name (:class:`~twinkle_core.errors.InvalidInputError`),
never sampled from. The rendered prompt is what is sent, so the check and the
run see the same ids.

Rendering skips vLLM's sender-side processor cache (``skip_mm_cache``): a
refused prompt never reaches the engine core, so it must leave no entry that
the core is then assumed to hold.
"""

from __future__ import annotations

from typing import Any

from vllm.inputs import tokens_input

from twinkle_core.data_format import InputFeature
from twinkle_core.data_format.media_loading import MediaLimits, load_image
from twinkle_core.errors import InvalidInputError, InvalidMediaError, UnsupportedFeatureError

__all__ = ["PromptMedia", "engine_media", "fold_placeholders"]


def engine_media(model_config: Any) -> frozenset[str]:
    """The media the started engine passes to its model: ``{"image"}`` for a model vLLM runs with images."""
    mm = getattr(model_config, "multimodal_config", None)
    if mm is None or _image_token_id(model_config) is None:
        return frozenset()
    return frozenset({"image"}) if mm.get_limit_per_prompt("image") > 0 else frozenset()


def _image_token_id(model_config: Any) -> int | None:
    config = model_config.hf_config
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def fold_placeholders(ids: list[int], token: int, end: int, images: int) -> list[int]:
    """``ids`` with each image's run of ``token`` (in the first ``end`` positions) folded to one placeholder.

    Runs are told apart by the tokens between them (Qwen-VL wraps each image in
    ``<|vision_start|>...<|vision_end|>``). Images side by side (``<image><image>``)
    make one run: it is cut into runs of equal length when every image takes
    as many tokens (``images`` divides the count), as images of one fixed size
    do. Anything else folds to one placeholder per run, which vLLM's expansion
    then fails to match: the prompt is refused, not guessed at.
    """
    runs: list[tuple[int, int]] = []  # (start, length) of each run of the token
    i = 0
    while i < end:
        if ids[i] == token:
            j = i
            while j < end and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    total = sum(length for _, length in runs)
    each = total // images if images and len(runs) < images and total % images == 0 else 0
    out = list(ids)
    for start, length in reversed(runs):
        count = length // each if each and length % each == 0 else 1
        out[start : start + length] = [token] * count
    return out


class PromptMedia:
    """The vLLM prompts of a run: token ids, or, for a prompt with images, vLLM's rendering of them, checked.

    Args:
        process: the engine's processes (its ``AsyncLLM``: the renderer and model config are read on every call).
    """

    def __init__(self, process: Any) -> None:
        self._process = process

    async def prompt(self, feature: InputFeature, ids: list[int], index: int, generated: int, salt: str) -> Any:
        """vLLM's input for ``ids`` (``feature``'s prompt, then ``generated`` tokens of its own and maybe more).

        Raises:
            InvalidInputError: processed media without the images they came
                from, or vLLM's expansion of the images differs from the template's.
            InvalidMediaError: vLLM's processor refuses the images.
        """
        if not feature.multimodal:
            return tokens_input(list(ids), cache_salt=salt)
        engine = self._process.engine
        model_config = engine.model_config
        token = _image_token_id(model_config)
        if token is None or not feature.images:
            raise UnsupportedFeatureError(
                f"inputs[{index}] carries processed media (InputFeature.multimodal) but not the images they came"
                " from: vLLM runs the model's processor on the images themselves. Pass a Trajectory, or a feature"
                " from sampler.encode(), which keeps them (InputFeature.images)."
            )
        expected_end = len(feature.input_ids) - generated
        images = [
            load_image(source, f"inputs[{index}].images[{k}]", MediaLimits()) for k, source in enumerate(feature.images)
        ]
        raw = fold_placeholders(list(ids), token, expected_end, len(images))
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        parsed = parse_model_prompt(model_config, {"prompt_token_ids": raw, "multi_modal_data": {"image": images}})
        try:
            (rendered,) = await engine.renderer.render_cmpl_async(
                [parsed], prompt_extras={"cache_salt": salt}, skip_mm_cache=True
            )
        except (ValueError, RuntimeError, TypeError, AssertionError) as exc:  # vLLM asserts placements too
            raise InvalidMediaError(
                f"inputs[{index}]: vLLM's processor refused its {len(images)} image(s): {type(exc).__name__}: {exc}",
                part=f"inputs[{index}].images",
            ) from exc
        got = list(rendered["prompt_token_ids"])
        if got != list(ids):
            at = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
            raise InvalidInputError(
                f"inputs[{index}]: vLLM expands its {len(images)} image(s) into {len(got)} prompt tokens but the"
                f" template's processor gave {len(ids)} (first difference at position {at}): refused, since the"
                " images' features would not line up with the tokens the sequence reports. Nothing was sampled."
            )
        return rendered
