"""Decoding the images and videos of a prompt, within bounds, with an error naming the part at fault.

Each check comes before the work it guards: the number of media before any
is read, an encoded size before it is decoded, and an image's declared
width and height (PIL reads only the header when it opens a file) before
its pixels are: a decompression bomb (a small PNG declaring 100,000 x
100,000 pixels) is refused from its header. Every failure is an
:class:`~twinkle_core.errors.InvalidMediaError` naming the part
(``Trajectory.images[1]``), a ``ValueError``: with ``on_invalid="skip"``
only that prompt fails.

Remote ``http(s)`` URLs are refused unless :class:`MediaLimits` allows
them: a sampler must not fetch from the network on its user's behalf. PIL
is imported when the first medium is decoded.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import attrs

from twinkle_core.data_format.media import MediaRef, is_image_object
from twinkle_core.errors import ConfigError, InvalidMediaError

__all__ = ["ACCEPTED_IMAGE_FORMATS", "MediaLimits", "load_image", "load_media"]

#: The image formats decoded (PIL's names); others are refused rather than handed to a rarely used decoder.
ACCEPTED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_MIME_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
_MIME_FORMATS |= {"image/gif": "GIF", "image/bmp": "BMP", "application/octet-stream": ""}


def _at_least_one(_self: Any, attribute: Any, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"MediaLimits.{attribute.name}={value!r} is invalid: expected an integer >= 1.")


@attrs.frozen(kw_only=True)
class MediaLimits:
    """How much media one prompt may carry, and from where.

    Attributes:
        max_images: images per prompt.
        max_videos: videos per prompt.
        max_frames: frames per video.
        max_pixels: width x height of one image (or frame), read from its
            header before it is decoded. The default, 50 million, takes a
            photo of 8192 x 6144 and refuses a decompression bomb.
        max_bytes: the encoded size of one image.
        allow_remote_urls: fetch ``http(s)`` URLs (off: refused with an error).
        remote_timeout_s: how long one fetch may take, when allowed.
    """

    max_images: int = attrs.field(default=16, validator=_at_least_one)
    max_videos: int = attrs.field(default=2, validator=_at_least_one)
    max_frames: int = attrs.field(default=256, validator=_at_least_one)
    max_pixels: int = attrs.field(default=50_000_000, validator=_at_least_one)
    max_bytes: int = attrs.field(default=64 * 1024 * 1024, validator=_at_least_one)
    allow_remote_urls: bool = False
    remote_timeout_s: float = 30.0


def _data_url(url: str, where: str) -> tuple[bytes, str | None]:
    header, sep, payload = url[5:].partition(",")
    fields = header.split(";")
    if not sep or fields[-1] != "base64":
        raise InvalidMediaError(
            f"{where}={url!r:.60} is invalid: a data: URL must be base64 ('data:image/png;base64,...').", part=where
        )
    mime = fields[0].lower() or "application/octet-stream"
    if mime not in _MIME_FORMATS:
        raise InvalidMediaError(
            f"{where}={url!r:.60} is invalid: media type {mime!r} is not accepted; expected one of"
            f" {', '.join(sorted(_MIME_FORMATS))}.",
            part=where,
        )
    try:
        return base64.b64decode(payload, validate=True), _MIME_FORMATS[mime] or None
    except (binascii.Error, ValueError):
        raise InvalidMediaError(f"{where}={url!r:.60} is invalid: its data is not valid base64.", part=where) from None


def _fetch(url: str, where: str, limits: MediaLimits) -> bytes:
    if not limits.allow_remote_urls:
        raise InvalidMediaError(
            f"{where}={url!r:.80} is refused: twinkle does not fetch media from the network on your behalf. Pass the"
            " image itself (a PIL image, bytes, a file path or a data: URL), or allow it with"
            " MediaLimits(allow_remote_urls=True).",
            part=where,
        )
    try:
        with urllib.request.urlopen(url, timeout=limits.remote_timeout_s) as response:
            data: bytes = response.read(limits.max_bytes + 1)
    except OSError as exc:
        raise InvalidMediaError(f"{where}={url!r:.80} could not be fetched: {exc}.", part=where) from None
    return data


def _read_bytes(source: Any, where: str, limits: MediaLimits) -> tuple[bytes, str | None]:
    """The encoded bytes of an image source, and the format its ``data:`` URL declares."""
    if isinstance(source, (bytes, bytearray)):
        return bytes(source), None
    if source.startswith("data:"):
        return _data_url(source, where)
    if source.startswith(("http://", "https://")):
        return _fetch(source, where, limits), None
    path = Path(source.removeprefix("file://"))
    if "://" in source and not source.startswith("file://"):
        raise InvalidMediaError(
            f"{where}={source!r:.80} is invalid: expected a file path, a data: URL or an http(s) URL.", part=where
        )
    try:
        size = os.stat(path).st_size
        if size > limits.max_bytes:
            raise InvalidMediaError(
                f"{where}={source!r:.80} is {size} bytes, more than MediaLimits.max_bytes={limits.max_bytes}.",
                part=where,
            )
        return path.read_bytes(), None
    except OSError as exc:
        raise InvalidMediaError(f"{where}={source!r:.80} cannot be read: {exc.strerror or exc}.", part=where) from None


def _check_pixels(width: int, height: int, where: str, limits: MediaLimits) -> None:
    if width * height > limits.max_pixels:
        raise InvalidMediaError(
            f"{where} is {width}x{height} = {width * height} pixels, more than MediaLimits.max_pixels="
            f"{limits.max_pixels}: refused before decoding.",
            part=where,
        )


def load_image(source: Any, where: str, limits: MediaLimits | None = None) -> Any:
    """Decode one image source into a loaded PIL image, checking its size from its header first.

    Raises:
        InvalidMediaError: unreadable, undecodable or truncated; a format or
            ``data:`` URL not accepted; too many bytes or pixels; a remote URL
            not allowed.
    """
    limits = limits or MediaLimits()
    if is_image_object(source):
        width, height = source.size
        _check_pixels(width, height, where, limits)
        return source
    data, declared = _read_bytes(source, where, limits)
    if len(data) > limits.max_bytes:
        raise InvalidMediaError(
            f"{where} is {len(data)} bytes or more, more than MediaLimits.max_bytes={limits.max_bytes}.", part=where
        )
    from PIL import Image, UnidentifiedImageError

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the bound below is the one that counts
        try:
            image = Image.open(io.BytesIO(data))  # reads the header only
        except Image.DecompressionBombError as exc:
            raise InvalidMediaError(
                f"{where} declares too many pixels ({exc}); MediaLimits.max_pixels={limits.max_pixels}: refused before"
                " decoding.",
                part=where,
            ) from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
            raise InvalidMediaError(
                f"{where} ({len(data)} bytes, starting {data[:8]!r}) is not a decodable image: expected"
                f" {', '.join(ACCEPTED_IMAGE_FORMATS)}.",
                part=where,
            ) from None
        if image.format not in ACCEPTED_IMAGE_FORMATS or (declared and declared != image.format):
            raise InvalidMediaError(
                f"{where} is a {image.format} image"
                + (f" declared as {declared}" if declared and declared != image.format else "")
                + f": format not accepted; expected one of {', '.join(ACCEPTED_IMAGE_FORMATS)}.",
                part=where,
            )
        _check_pixels(*image.size, where, limits)
        try:
            image.load()
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise InvalidMediaError(
                f"{where} is a truncated or corrupt {image.format} image: {exc}.", part=where
            ) from None
    return image


def _load_video(source: Any, where: str, limits: MediaLimits) -> list[Any]:
    if isinstance(source, str):
        raise InvalidMediaError(
            f"{where}={source!r:.80} is a video file: twinkle bundles no video decoder. Pass the video as a list of"
            " frames (PIL images, bytes, file paths or data: URLs).",
            part=where,
        )
    if not source:
        raise InvalidMediaError(f"{where} is a video with no frames: expected at least one frame.", part=where)
    if len(source) > limits.max_frames:
        raise InvalidMediaError(
            f"{where} has {len(source)} frames, more than MediaLimits.max_frames={limits.max_frames}.", part=where
        )
    return [load_image(frame, f"{where}[{k}]", limits) for k, frame in enumerate(source)]


def load_media(refs: list[MediaRef], limits: MediaLimits | None = None) -> tuple[list[Any], list[list[Any]]]:
    """The decoded images and videos (lists of frames) of a prompt, in order; counts checked before any is read.

    Raises:
        InvalidMediaError: more media than ``limits`` allow, or a medium that cannot be used.
    """
    limits = limits or MediaLimits()
    for kind, bound in (("image", limits.max_images), ("video", limits.max_videos)):
        found = [where for k, _, where in refs if k == kind]
        if len(found) > bound:
            raise InvalidMediaError(
                f"The prompt holds {len(found)} {kind}s, more than MediaLimits.max_{kind}s={bound} (the"
                f" {bound + 1}th is {found[bound]}).",
                part=found[bound],
            )
    images = [load_image(source, where, limits) for kind, source, where in refs if kind == "image"]
    videos = [_load_video(source, where, limits) for kind, source, where in refs if kind == "video"]
    return images, videos
