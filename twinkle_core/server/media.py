"""Where the images of a request may come from: what a served model reads is the operator's choice.

A chat message may carry ``image_url`` parts as vLLM's server takes them.
A ``data:`` URL is the image itself and always accepted. A local file
(``file://`` or a plain path) is read only under the folder the operator
names (``twinkle serve --allowed-local-media-path DIR``, vLLM's option of the
same name), none by default: a client must not read the server's disk. A
remote ``http(s)`` URL is fetched only where the operator opts in
(``--allow-remote-media``): a sampler does not fetch from the network on a
client's behalf. Each refusal is a 400 naming the part
(``messages[0].content[1]``), checked before anything is read or decoded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from twinkle_core.data_format import Message
from twinkle_core.data_format.media import media_kind, media_source
from twinkle_core.errors import ConfigError
from twinkle_core.server.protocol import ApiError

__all__ = ["MediaAccess", "check_message_media"]


def _folder(value: str | os.PathLike[str] | None) -> Path | None:
    if value is None:
        return None
    folder = Path(value).expanduser().resolve()
    if not folder.is_dir():
        raise ConfigError(f"allowed_local_media_path={str(value)!r} is invalid: expected an existing folder.")
    return folder


@attrs.frozen(kw_only=True)
class MediaAccess:
    """The operator's choice of where a request's media may come from.

    Attributes:
        allowed_local_media_path: the folder local files are read from (``None``: no local file).
        allow_remote_media: fetch ``http(s)`` URLs (off: refused).
    """

    allowed_local_media_path: Path | None = attrs.field(default=None, converter=_folder)
    allow_remote_media: bool = False


def _check_source(source: Any, where: str, access: MediaAccess) -> None:
    if not isinstance(source, str) or source.startswith("data:"):
        return  # the image itself (the template checks what it holds)
    if source.startswith(("http://", "https://")):
        if not access.allow_remote_media:
            raise ApiError(
                400,
                f"{where}: the URL {source!r:.80} is refused: this server does not fetch media from the network"
                " (the operator may allow it with twinkle serve --allow-remote-media). Send the image as a"
                " data: URL.",
                param=where,
            )
        return
    if "://" in source and not source.startswith("file://"):
        return  # not a local file: the template names what it does not take
    if access.allowed_local_media_path is None:
        raise ApiError(
            400,
            f"{where}: the local file {source!r:.80} is refused: this server reads no local files (the operator"
            " may allow a folder with twinkle serve --allowed-local-media-path DIR). Send the image as a data: URL.",
            param=where,
        )
    path = Path(source.removeprefix("file://")).expanduser().resolve()  # links and '..' resolved first
    if not path.is_relative_to(access.allowed_local_media_path):
        raise ApiError(
            400,
            f"{where}: the local file {source!r:.80} is refused: it is not under the folder this server reads"
            f" media from ({access.allowed_local_media_path}).",
            param=where,
        )


def check_message_media(messages: list[Message], access: MediaAccess) -> None:
    """Refuse, with a 400 naming the part, any medium whose source ``access`` does not allow."""
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            kind = media_kind(part)
            if kind is None:
                continue
            where = f"messages[{i}].content[{j}]"
            source = media_source(part, where)
            for item in source if isinstance(source, list) else [source]:
                _check_source(item, where, access)
