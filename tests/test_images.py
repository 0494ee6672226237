"""What the writer learns of an image: kept format, displayed size, decodability."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from wdsvlm.images import UnreadableImage, probe_image, stored_bytes


def encode(img: Image.Image, fmt: str, **save) -> bytes:
    out = io.BytesIO()
    img.save(out, format=fmt, **save)
    return out.getvalue()


@pytest.mark.parametrize("fmt, ext", [("JPEG", "jpg"), ("PNG", "png"), ("WEBP", "webp")])
def test_jpeg_png_webp_are_kept_as_their_bytes(fmt, ext):
    data = encode(Image.new("RGB", (40, 30), (200, 10, 10)), fmt)
    info = probe_image(data)
    assert (info.ext, info.width, info.height, info.reencoded) == (ext, 40, 30, False)
    assert stored_bytes(data, info) is data


@pytest.mark.parametrize("fmt, mode", [("GIF", "P"), ("BMP", "RGB"), ("TIFF", "CMYK")])
def test_other_formats_become_png_with_the_same_pixels(fmt, mode):
    img = Image.new("RGB", (21, 13), (10, 120, 250)).convert(mode)
    data = encode(img, fmt)
    info = probe_image(data)
    assert (info.ext, info.reencoded, info.width, info.height) == ("png", True, 21, 13)
    png = stored_bytes(data, info)
    back = Image.open(io.BytesIO(png))
    assert back.format == "PNG"
    assert back.convert("RGB").tobytes() == Image.open(io.BytesIO(data)).convert("RGB").tobytes()


def test_exif_rotated_size_is_the_displayed_size():
    exif = Image.Exif()
    exif[0x0112] = 8
    info = probe_image(encode(Image.new("RGB", (64, 16)), "JPEG", exif=exif))
    assert (info.width, info.height) == (16, 64)


@pytest.mark.parametrize("cut", [0.3, 0.9])
def test_truncated_or_garbage_bytes_are_unreadable(cut):
    data = encode(Image.effect_noise((256, 256), 60).convert("RGB"), "JPEG")
    with pytest.raises(UnreadableImage):
        probe_image(data[: int(len(data) * cut)])
    with pytest.raises(UnreadableImage):
        probe_image(b"GIF89a but not really")
