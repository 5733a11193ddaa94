"""Images and videos in prompts: the data formats, their round trip, and the typed errors of bad media."""

from __future__ import annotations

import base64
import io
import json
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

PIL = pytest.importorskip("PIL.Image")

from twinkle_core.data_format import InputFeature, Message, Trajectory  # noqa: E402
from twinkle_core.data_format.media_loading import MediaLimits, load_image, load_media  # noqa: E402
from twinkle_core.errors import InvalidInputError, InvalidMediaError, UnsupportedFeatureError  # noqa: E402
from twinkle_core.template import Template  # noqa: E402


def _image(seed: int, size: tuple[int, int] = (40, 30)) -> Any:
    from PIL import Image

    data = bytes((seed * 31 + i * 7) % 256 for i in range(size[0] * size[1] * 3))
    return Image.frombytes("RGB", size, data)


def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _pixels(image: Any) -> bytes:
    return bytes(image.convert("RGB").tobytes())


def _bomb_png(width: int, height: int) -> bytes:
    """A PNG header declaring ``width`` x ``height`` pixels, with a few bytes of data (never decoded here)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


# -- the formats ---------------------------------------------------------------------------------
def test_content_blocks_in_both_shapes_and_placeholders_give_the_media_in_order(tmp_path: Path) -> None:
    path = tmp_path / "a.png"
    path.write_bytes(_png(_image(1)))
    url = "data:image/png;base64," + base64.b64encode(_png(_image(2))).decode()
    hf = Message(role="user", content=[{"type": "image", "path": str(path)}, {"type": "text", "text": "and"}])
    openai = Message(role="user", content=[{"type": "image_url", "image_url": {"url": url}}])
    placed = Message(role="user", content="first <image> then <image>")
    trajectory = Trajectory(messages=[hf, openai, placed], images=[_image(3), _png(_image(4))])
    messages, refs = trajectory.media()
    assert [where for _, _, where in refs] == [
        "Trajectory.messages[0].content[0]",
        "Trajectory.messages[1].content[0]",
        "Trajectory.images[0]",
        "Trajectory.images[1]",
    ]
    assert [p["type"] for p in messages[2]["content"]] == ["text", "image", "text", "image"]
    images, _ = load_media(refs)
    expected = [_image(1), _image(2), _image(3), _image(4)]
    assert [_pixels(i) for i in images] == [_pixels(i) for i in expected]


def test_media_round_trip_through_json_and_pickle_without_loss(tmp_path: Path) -> None:
    path = tmp_path / "b.png"
    path.write_bytes(_png(_image(5)))
    original = Trajectory(
        messages=[
            {"role": "user", "content": [{"type": "image", "image": _image(6)}, {"type": "text", "text": "<image>?"}]},
        ],
        images=[str(path)],
        videos=[],
    )
    restored = Trajectory.from_dict(json.loads(json.dumps(original.to_dict())))
    assert restored.to_dict() == original.to_dict()
    pickled = pickle.loads(pickle.dumps(original))
    for copy in (restored, pickled):
        images, _ = load_media(copy.media()[1])
        assert [_pixels(i) for i in images] == [_pixels(_image(6)), _pixels(_image(5))]


def test_processed_inputs_round_trip_on_the_feature() -> None:
    import numpy as np

    pixels = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) / 7
    feature = InputFeature(input_ids=[1, 2, 3], multimodal={"pixel_values": pixels, "image_sizes": [[4, 4]]})
    restored = InputFeature.from_dict(json.loads(json.dumps(feature.to_dict())))
    assert restored.multimodal is not None and feature.multimodal is not None
    assert set(restored.multimodal) == {"pixel_values", "image_sizes"}
    for key, value in feature.multimodal.items():
        assert np.array_equal(restored.multimodal[key], value) and restored.multimodal[key].dtype == value.dtype


def test_placeholders_must_match_the_media_given() -> None:
    with pytest.raises(InvalidInputError, match=r"Trajectory.images holds 2 image\(s\).*1 '<image>'"):
        Trajectory(messages=[{"role": "user", "content": "one <image>"}], images=[_image(1), _image(2)])
    # without media, the text "<image>" is text
    assert Trajectory(messages=[{"role": "user", "content": "<image>"}]).media()[1] == []


@pytest.mark.parametrize(
    "part",
    [{"type": "image"}, {"type": "image", "image": 3}, {"type": "image_url", "image_url": {"url": 5}}],
)
def test_a_malformed_block_is_refused_when_the_message_is_built(part: dict[str, Any]) -> None:
    with pytest.raises(InvalidInputError, match=r"Message.content\[1\]"):
        Message(role="user", content=[{"type": "text", "text": "x"}, part])


# -- bad media: a typed error naming the part -------------------------------------------------------
@pytest.mark.parametrize(
    ("source", "message"),
    [
        (b"not an image at all", "is not a decodable image"),
        (_png(_image(1))[:60], "truncated or corrupt PNG"),
        ("data:image/png,rawtext", "must be base64"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:image/svg+xml;base64,PHN2Zz4=", "media type 'image/svg\\+xml' is not accepted"),
        ("https://example.com/cat.png", "does not fetch media from the network"),
        ("/no/such/file.png", "cannot be read"),
    ],
)
def test_bad_images_get_a_typed_error_naming_the_part(source: Any, message: str) -> None:
    trajectory = Trajectory(messages=[{"role": "user", "content": "a <image> b <image>"}], images=[_image(1), source])
    with pytest.raises(InvalidMediaError, match=message) as info:
        load_media(trajectory.media()[1])
    assert info.value.part == "Trajectory.images[1]" and str(info.value).startswith("Trajectory.images[1]")
    assert pickle.loads(pickle.dumps(info.value)).part == "Trajectory.images[1]"


def test_an_unsupported_format_is_named() -> None:
    buffer = io.BytesIO()
    _image(1).save(buffer, format="TIFF")
    with pytest.raises(InvalidMediaError, match="is a TIFF image: format not accepted; expected one of PNG"):
        load_image(buffer.getvalue(), "Message.content[2]")


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InvalidMediaError, match=r"Trajectory.images\[0\] .*10000000000 pixels.*refused before"):
        load_image(_bomb_png(100_000, 100_000), "Trajectory.images[0]")
    with pytest.raises(InvalidMediaError, match=r"10000x10000 = 100000000 pixels, more than MediaLimits.max_pixels"):
        load_image(_bomb_png(10_000, 10_000), "Trajectory.images[0]")
    # 10 billion RGB pixels would be 30 GB; the check read a header of a few dozen bytes
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB


def test_limits_on_count_pixels_and_frames() -> None:
    refs = [("image", _image(i), f"Trajectory.images[{i}]") for i in range(3)]
    with pytest.raises(InvalidMediaError, match=r"3 images, more than MediaLimits.max_images=2") as info:
        load_media(refs, MediaLimits(max_images=2))
    assert info.value.part == "Trajectory.images[2]"
    with pytest.raises(InvalidMediaError, match=r"40x30 = 1200 pixels, more than MediaLimits.max_pixels=1000"):
        load_media(refs, MediaLimits(max_pixels=1000))
    with pytest.raises(InvalidMediaError, match="a video with no frames") as info:
        load_media([("video", [], "Trajectory.videos[0]")])
    assert info.value.part == "Trajectory.videos[0]"


def test_a_text_only_template_refuses_an_image_as_unsupported() -> None:
    from twinkle_core.testing.tokenizers import CharTokenizer

    template = Template(CharTokenizer())
    with_block = Trajectory(messages=[{"role": "user", "content": [{"type": "image", "image": _image(1)}]}])
    with_list = Trajectory(messages=[{"role": "user", "content": "<image>"}], images=[_image(1)])
    for trajectory in (with_block, with_list):
        with pytest.raises(UnsupportedFeatureError, match="has no processor"):
            template.encode(trajectory)


def test_an_episodes_processed_arrays_join_as_one_sequences() -> None:
    """Arrays per image are concatenated in order; arrays per token lie under the tokens they came with, zero under
    the tokens between (a sampled turn, a closing), and a run without them adds none."""
    import numpy as np

    from twinkle_core.episode_media import join_media

    opening = {"pixel_values": np.ones((1, 3, 2, 2)), "mm_token_type_ids": np.array([[0, 1, 1]])}
    screenshot = {"pixel_values": np.zeros((2, 3, 2, 2)), "mm_token_type_ids": np.array([[1, 1, 0, 1]])}
    joined = join_media([(0, opening), (5, {"image_grid_thw": np.array([[1, 2, 2]])}), (6, screenshot)], 11)
    assert joined["pixel_values"].tolist() == np.concatenate([np.ones((1, 3, 2, 2)), np.zeros((2, 3, 2, 2))]).tolist()
    assert joined["mm_token_type_ids"].tolist() == [[0, 1, 1, 0, 0, 0, 1, 1, 0, 1, 0]]
    assert joined["image_grid_thw"].tolist() == [[1, 2, 2]]
