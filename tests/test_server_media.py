"""Where a served request's images may come from: the operator's folder, data: URLs; a text model refuses them.

The server is the shared fixture's (the tiny Llama, text only, on the torch
engine) with one folder allowed for local files; an image reaching it must
be a clear 400, as must any source the operator did not allow. The image call
that samples is in ``plugins/twinkle_vllm/tests/test_vllm_media.py``.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from twinkle_core.errors import ConfigError
from twinkle_core.server.media import MediaAccess

openai = pytest.importorskip("openai")


def _png() -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 40, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def allowed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "red.png").write_bytes(_png())
    (folder.parent / "outside.png").write_bytes(_png())
    return folder


@pytest.fixture(scope="module")
def server(sampler: Any, allowed: Path) -> Iterator[Any]:
    from twinkle_core.server import start_server

    with start_server(sampler, model_name="tiny", allowed_local_media_path=allowed) as srv:
        yield srv


def _refusal(client: Any, url: str) -> Any:
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=2)
    return caught.value


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://example.com/cat.png", "does not fetch media from the network"),
        ("file:///etc/hostname", "not under the folder this server reads media from"),
        ("{allowed}/../outside.png", "not under the folder this server reads media from"),
    ],
)
def test_a_source_the_operator_did_not_allow_is_a_400_naming_the_part(
    client: Any, allowed: Path, url: str, says: str
) -> None:
    error = _refusal(client, url.format(allowed=allowed))
    assert says in error.message
    assert error.body["param"] == "messages[0].content[1]"


@pytest.mark.parametrize("source", ["data", "file"])
def test_an_image_for_a_text_only_model_is_a_clear_400(client: Any, allowed: Path, source: str) -> None:
    url = "data:image/png;base64," + base64.b64encode(_png()).decode() if source == "data" else str(allowed / "red.png")
    error = _refusal(client, url)
    assert "holds an image, but this model has no processor" in error.message


def test_no_local_file_is_read_by_default_and_the_folder_must_exist(tmp_path: Path) -> None:
    from twinkle_core.data_format import Message
    from twinkle_core.server.media import check_message_media
    from twinkle_core.server.protocol import ApiError

    message = Message(role="user", content=[{"type": "image_url", "image_url": {"url": "/tmp/x.png"}}])
    with pytest.raises(ApiError, match="this server reads no local files"):
        check_message_media([message], MediaAccess())
    with pytest.raises(ConfigError, match="expected an existing folder"):
        MediaAccess(allowed_local_media_path=tmp_path / "missing")


def test_completions_with_multi_modal_data_is_a_400_naming_the_field(client: Any) -> None:
    """vLLM 0.32's ``/v1/completions`` has no ``multi_modal_data`` field and ignores it (with a log line), so
    its images would be dropped; twinkle's refuses it, as any field it does not take."""
    image = {"image": ["data:image/png;base64," + base64.b64encode(_png()).decode()]}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=1, extra_body={"multi_modal_data": image})
    assert "multi_modal_data" in caught.value.message
