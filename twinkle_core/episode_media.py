"""The images of a multi-turn episode: each new message's images through the processor, all kept in order.

An :class:`~twinkle_core.episode.Episode` appends the template's *delta* for
new messages (a tool result holding a screenshot, a user turn with a
picture). The rendered delta holds one placeholder per image, where the chat
template writes it; the model's processor expands each placeholder in place
and computes the arrays of those images alone (earlier images are never
processed again). The episode has already checked that the text tokens of the
whole conversation are those of the earlier text followed by those of the
delta; a processor replaces each placeholder by that image's run of tokens,
so the whole conversation's expanded ids, cut at the previous end, are the
delta's expanded ids.

A feature of the episode (the next prompt, the training feature) carries
every image so far: ``images`` in order, and ``multimodal`` with the arrays
per medium (``pixel_values``, ``image_grid_thw``) concatenated in order, the
order in which the model fills its image tokens, and the arrays per token
(:data:`~twinkle_core.data_format.media.PER_TOKEN_INPUTS`) laid under the
tokens they came with, zero under every other token (sampled turns, closings).
"""

from __future__ import annotations

from typing import Any

from twinkle_core.data_format import InputFeature, Message, Trajectory
from twinkle_core.data_format.media import PER_TOKEN_INPUTS
from twinkle_core.errors import InvalidMediaError, PromptTooLongError, UnsupportedFeatureError

__all__ = ["EpisodeMedia", "inline_media", "join_media", "plain_message"]


class EpisodeMedia:
    """The images of an episode and their processed arrays, each set of arrays at the token where it starts.

    Args:
        opening: the encoded opening prompt (its ``multimodal`` and ``images``, if any).
    """

    def __init__(self, opening: InputFeature) -> None:
        self._pieces: list[tuple[int, dict[str, Any]]] = [(0, opening.multimodal)] if opening.multimodal else []
        self.images: list[Any] = list(opening.images)

    def fork(self) -> EpisodeMedia:
        """A copy that grows on its own (the arrays themselves are shared: nothing mutates them)."""
        twin = object.__new__(EpisodeMedia)
        twin._pieces, twin.images = list(self._pieces), list(self.images)
        return twin

    def load(self, template: Any, messages: list[Message]) -> list[Any]:
        """The images of new messages decoded, in order, before anything is appended (empty without images).

        Raises:
            InvalidMediaError: an image that cannot be used, named by its place among ``messages``
                (``messages[0].content[1]``), or more images in the episode than a prompt may hold.
            UnsupportedFeatureError: a video (an episode's later messages take images only).
        """
        _, refs = Trajectory(messages=messages).media()
        if not refs or not hasattr(template, "load_media"):
            return []  # without a processor the template refuses the image itself when it renders it
        refs = [(kind, source, where.removeprefix("Trajectory.")) for kind, source, where in refs]
        for kind, _, where in refs:
            if kind != "image":
                raise UnsupportedFeatureError(
                    f"{where} is a {kind}: an episode's later messages take images only (a video may open it)."
                )
        bound = template.limits.max_images
        if len(self.images) + len(refs) > bound:
            first = max(0, bound - len(self.images))  # the first image past the bound
            where = refs[first][2]
            raise InvalidMediaError(
                f"{where} would be image {len(self.images) + first + 1} of the episode, more than"
                f" MediaLimits.max_images={bound} one prompt may hold.",
                part=where,
            )
        images, _ = template.load_media(refs)
        return list(images)

    def expand(self, template: Any, text: str, images: list[Any], room: int | None) -> tuple[list[int], dict[str, Any]]:
        """The delta ``text`` with its images' placeholders expanded, and their arrays.

        Raises:
            PromptTooLongError: more than ``room`` tokens once expanded.
        """
        ids, processed = template.process(text, images)
        if room is not None and len(ids) > room:
            raise PromptTooLongError(
                f"The new messages have {len(ids)} tokens with their images expanded, but the episode has room"
                f" for {room} more.",
                index=0,
                length=len(ids),
                limit=room,
            )
        return ids, processed

    def add(self, start: int, processed: dict[str, Any], images: list[Any]) -> None:
        """Record the arrays of ``images``, whose tokens start at ``start`` in the episode."""
        self._pieces.append((start, processed))
        self.images.extend(images)

    def fields(self, length: int) -> dict[str, Any]:
        """``multimodal`` and ``images`` of a feature of the episode's first ``length`` tokens."""
        if len(self._pieces) == 1 and PER_TOKEN_INPUTS.isdisjoint(self._pieces[0][1]):
            return {"multimodal": self._pieces[0][1], "images": list(self.images)}  # the opening's, shared
        return {"multimodal": join_media(self._pieces, length) if self._pieces else None, "images": list(self.images)}


def join_media(pieces: list[tuple[int, dict[str, Any]]], length: int) -> dict[str, Any]:
    """Processed arrays of several runs of tokens as those of one sequence of ``length`` tokens.

    Args:
        pieces: per run, the index of its first token and its processor's arrays, in token order.
        length: the tokens of the whole sequence.
    """
    import numpy as np

    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for _, arrays in pieces for k in arrays):
        if key in PER_TOKEN_INPUTS:
            runs = [(start, np.asarray(arrays[key]).reshape(-1)) for start, arrays in pieces if key in arrays]
            whole = np.zeros((1, length), dtype=runs[0][1].dtype)
            for start, values in runs:
                whole[0, start : start + values.size] = values[: max(0, length - start)]
            out[key] = whole
        else:
            parts = [np.asarray(arrays[key]) for _, arrays in pieces if key in arrays]
            out[key] = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return out


def inline_media(trajectory: Trajectory) -> list[Message]:
    """The messages with ``Trajectory.images`` / ``videos`` moved into them: each placeholder a media block
    holding its source, so the messages alone render (and export) the conversation."""
    if not (trajectory.images or trajectory.videos):
        return list(trajectory.messages)
    hf_messages, refs = trajectory.media()
    sources = iter(refs)
    out = []
    for hf in hf_messages:
        if isinstance(hf["content"], list):
            blocks = []
            for block in hf["content"]:
                if block.get("type") in ("image", "video") and block["type"] not in block:
                    block = {**block, block["type"]: next(sources)[1]}
                blocks.append(block)
            hf = {**hf, "content": blocks}
        out.append(Message.from_dict(hf))
    return out


def plain_message(message: Message) -> dict[str, Any]:
    """A message as a Hugging Face chat dict whose images are ``data:`` URLs (PNG for a decoded image)."""
    return {**message.to_hf(), "content": message.to_dict()["content"]}
