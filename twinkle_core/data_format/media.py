"""Images and videos in prompts: the content blocks that carry them, and their plain-dict form.

A message's content may hold media blocks in either of the two shapes in use:

* Hugging Face's: ``{"type": "image", "image" | "url" | "path": source}``
  (and ``"video"`` alike), as processors' chat templates take them;
* OpenAI's: ``{"type": "image_url", "image_url": {"url": source}}`` (and
  ``"video_url"``), as vLLM's server takes them.

A ``Trajectory`` may instead carry ``images`` / ``videos`` lists, one for
each ``<image>`` / ``<video>`` placeholder in its messages' text, in order.

An image source is a PIL image, the bytes of an encoded image, a local path,
or a ``data:`` URL; a video is a list of frames (image sources). Only the
shape is checked here, cheaply, when a message is built: decoding (and the
checks on size, format and count) happens where the prompt is encoded
(:mod:`twinkle_core.data_format.media_loading`). In a plain dict (``to_dict``, JSON
lines) a PIL image or bytes becomes a ``data:`` URL: PNG for a PIL image
(lossless), the bytes as they are otherwise; paths and URLs stay strings.
Nothing here imports PIL.
"""

from __future__ import annotations

import base64
import re
from typing import Any

from twinkle_core.errors import InvalidInputError

__all__ = [
    "MEDIA_KINDS",
    "PER_TOKEN_INPUTS",
    "MediaRef",
    "expand_placeholders",
    "input_media",
    "is_image_object",
    "media_kind",
    "media_source",
    "to_data_url",
]

#: The media a prompt may carry.
MEDIA_KINDS = ("image", "video")
#: Processed media inputs with one value per prompt token (``[1, prompt length]``), zero for text tokens: a
#: forward over more tokens than the prompt (generated ones) reads zeros under them.
PER_TOKEN_INPUTS = frozenset({"token_type_ids", "mm_token_type_ids"})
#: Placeholders in text that ``Trajectory.images`` / ``videos`` fill, in order.
PLACEHOLDERS = {"image": "<image>", "video": "<video>"}
_PLACEHOLDER = re.compile("(<image>|<video>)")
_HF_KEYS = ("image", "video", "url", "path")
_MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"), (b"BM", "image/bmp"))

MediaRef = tuple[str, Any, str]
"""One medium of a prompt: its kind (``"image"``/``"video"``), its source, and where it is (for messages)."""


def is_image_object(value: Any) -> bool:
    """A PIL image, without importing PIL."""
    return type(value).__module__.startswith("PIL.") and hasattr(value, "size") and hasattr(value, "save")


def _image_source_ok(value: Any) -> bool:
    return isinstance(value, (str, bytes, bytearray)) or is_image_object(value)


def media_kind(part: dict[str, Any]) -> str | None:
    """``"image"`` or ``"video"`` for a media content block, ``None`` for any other part."""
    kind = part.get("type")
    if kind in ("image", "image_url"):
        return "image"
    if kind in ("video", "video_url"):
        return "video"
    return None


def media_source(part: dict[str, Any], where: str) -> Any:
    """The source a media block holds (its shape checked; nothing decoded).

    Raises:
        InvalidInputError: a block without exactly one source, or a source of a type not accepted.
    """
    kind = part["type"]
    if kind.endswith("_url"):
        inner = part.get(kind)
        source = inner.get("url") if isinstance(inner, dict) else inner
        if not isinstance(source, str):
            raise InvalidInputError(
                f"{where}={part!r:.120} is invalid: an {kind!r} part needs {{{kind!r}: {{'url': '...'}}}} with a"
                " string URL (a data: URL, a file path, or an http(s) URL where remote media are allowed)."
            )
        return source
    keys = [k for k in _HF_KEYS if part.get(k) is not None]
    if len(keys) != 1:
        raise InvalidInputError(
            f"{where}={part!r:.120} is invalid: a {kind!r} part needs exactly one of the keys"
            f" {', '.join(repr(k) for k in (kind, 'url', 'path'))}, got {keys or 'none'}."
        )
    source = part[keys[0]]
    check_source(kind, source, where)
    return source


def check_source(kind: str, source: Any, where: str) -> None:
    """Refuse a source whose type no loader takes: an image is a PIL image, bytes, a path or a URL; a video a list."""
    if kind == "image" and not _image_source_ok(source):
        raise InvalidInputError(
            f"{where}={source!r:.80} is invalid: expected an image as a PIL image, bytes, a file path or a data: URL."
        )
    if kind == "video" and not (isinstance(source, (str, list)) and all(map(_image_source_ok, source))):
        raise InvalidInputError(
            f"{where}={source!r:.80} is invalid: expected a video as a list of frames (each a PIL image, bytes,"
            " a file path or a data: URL)."
        )


def expand_placeholders(text: str, queues: dict[str, list[tuple[Any, str]]]) -> list[dict[str, Any]]:
    """``text`` as content blocks: each ``<image>`` / ``<video>`` becomes a block taking the next queued source."""
    blocks: list[dict[str, Any]] = []
    for piece in _PLACEHOLDER.split(text):
        if piece in ("<image>", "<video>"):
            kind = piece[1:-1]
            source, where = queues[kind].pop(0)
            blocks.append({"type": kind, kind: source, "_where": where})
        elif piece:
            blocks.append({"type": "text", "text": piece})
    return blocks


def count_placeholders(text: str) -> dict[str, int]:
    """How many ``<image>`` and ``<video>`` placeholders ``text`` holds."""
    found = _PLACEHOLDER.findall(text)
    return {"image": found.count("<image>"), "video": found.count("<video>")}


def to_data_url(value: Any) -> Any:
    """A PIL image or bytes as a ``data:`` URL (PNG for a PIL image); anything else as it is."""
    if isinstance(value, (bytes, bytearray)):
        data = bytes(value)
        mime = next((m for magic, m in _MAGIC if data.startswith(magic)), None)
        if mime is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
            mime = "image/webp"
        return f"data:{mime or 'application/octet-stream'};base64,{base64.b64encode(data).decode('ascii')}"
    if is_image_object(value):
        import io

        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return to_data_url(buffer.getvalue())
    return value


def input_media(item: Any) -> list[str]:
    """The kinds of media an input to ``sample`` carries (a ``Trajectory`` or ``InputFeature``), without decoding."""
    kinds: set[str] = set()
    if getattr(item, "images", None):
        kinds.add("image")
    if getattr(item, "videos", None):
        kinds.add("video")
    for message in getattr(item, "messages", ()):
        if isinstance(message.content, list):
            kinds.update(k for k in map(media_kind, message.content) if k is not None)
    multimodal = getattr(item, "multimodal", None)
    if multimodal:  # processed inputs: a video's are named for it (pixel_values_videos, video_grid_thw)
        kinds.update("video" if "video" in key else "image" for key in multimodal)
    return sorted(kinds)
