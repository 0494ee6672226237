"""What the writer learns of an image: kept format, displayed size, decodability."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from wdsvlm.format.images import (
    ImageSizeMismatch,
    UnreadableImage,
    decode_pixels,
    open_image,
    probe_image,
    stored_bytes,
)


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


# --- tiling -------------------------------------------------------------------------------

from wdsvlm.families.tiling import ImageConfig, image_tiles, tile_count, tile_grid  # noqa: E402
from wdsvlm.pipeline.images import DecodeImages  # noqa: E402
from wdsvlm.pipeline.stats import SkipStats  # noqa: E402


@pytest.mark.parametrize(
    "size, config, grid, tiles",
    [
        ((300, 200), ImageConfig(), (1, 1), 1),  # fits one tile: no thumbnail
        ((512, 512), ImageConfig(), (1, 1), 1),  # exactly tile_size
        ((513, 512), ImageConfig(), (2, 1), 3),  # one pixel over: two columns + thumbnail
        ((512, 1024), ImageConfig(), (1, 2), 3),
        ((1024, 400), ImageConfig(), (2, 1), 3),
        ((1536, 1024), ImageConfig(max_image_side=1536), (3, 2), 7),
        ((3000, 2000), ImageConfig(max_image_side=1536), (3, 2), 7),  # scaled down first
        ((4000, 100), ImageConfig(), (2, 1), 3),  # extreme aspect: 1024 x 26
        ((30, 2000), ImageConfig(), (1, 2), 3),  # 15 x 1024
        ((1, 1), ImageConfig(), (1, 1), 1),  # tiny
        ((100, 60), ImageConfig(upscale=True), (2, 2), 5),  # 1024 x 614 only with upscale
        ((100, 60), ImageConfig(tile_size=32, max_image_side=64), (2, 2), 5),  # 64 x 38
    ],
)
def test_tile_counts_follow_the_formula(size, config, grid, tiles):
    assert tile_grid(*size, config) == grid
    assert tile_count(*size, config) == tiles
    image = encode(Image.new("RGB", size, (1, 2, 3)), "PNG")
    out = image_tiles(image, config)
    t = config.tile_size
    assert out.shape == (tiles, 3, t, t) and out.dtype == torch.uint8


def _quadrants(size):
    """Red top-left, green top-right, blue bottom-left, white bottom-right."""
    w, h = size
    img = Image.new("RGB", size)
    img.paste((255, 0, 0), (0, 0, w // 2, h // 2))
    img.paste((0, 255, 0), (w // 2, 0, w, h // 2))
    img.paste((0, 0, 255), (0, h // 2, w // 2, h))
    img.paste((255, 255, 255), (w // 2, h // 2, w, h))
    return img


def _corner_colors(tile):
    """Mean colour of each quadrant of a [3, S, S] tile, as rounded RGB tuples."""
    s = tile.shape[1]
    q = s // 4
    spots = [(q, q), (q, 3 * q), (3 * q, q), (3 * q, 3 * q)]  # (row, col)
    return [tuple(int(v) for v in tile[:, r, c]) for r, c in spots]


def test_tiles_are_row_major_after_a_thumbnail():
    config = ImageConfig(tile_size=64, max_image_side=128)
    out = image_tiles(encode(_quadrants((128, 128)), "PNG"), config)
    assert out.shape[0] == 5
    red, green, blue, white = (255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)
    assert _corner_colors(out[0]) == [red, green, blue, white]  # thumbnail: whole image
    assert [tuple(int(v) for v in t[:, 32, 32]) for t in out[1:]] == [red, green, blue, white]


@pytest.mark.parametrize(
    "orientation, transpose",
    [
        (3, Image.Transpose.ROTATE_180),
        (6, Image.Transpose.ROTATE_90),
        (8, Image.Transpose.ROTATE_270),
        (2, Image.Transpose.FLIP_LEFT_RIGHT),
    ],
)
def test_exif_rotated_images_come_out_upright(orientation, transpose):
    upright = _quadrants((96, 64))
    exif = Image.Exif()
    exif[0x0112] = orientation
    stored = encode(upright.transpose(transpose), "JPEG", quality=95, exif=exif)
    config = ImageConfig(tile_size=64, max_image_side=96)
    out = image_tiles(stored, config, expected_size=(96, 64))
    assert out.shape[0] == 3  # 96 x 64 -> 2 x 1 tiles + thumbnail
    colors = _corner_colors(out[0])
    expected = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255)]
    for got, want in zip(colors, expected, strict=True):
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 40, (colors, orientation)


def _single_color(out):
    return tuple(int(v) for v in out[0, :, 8, 8])


@pytest.mark.parametrize(
    "make, fmt, want",
    [
        (lambda: Image.new("L", (16, 16), 128), "PNG", (128, 128, 128)),
        (lambda: Image.new("RGB", (16, 16), (200, 30, 60)).quantize(4), "PNG", (200, 30, 60)),
        (lambda: Image.new("RGBA", (16, 16), (255, 0, 0, 0)), "PNG", (255, 255, 255)),
        (lambda: Image.new("RGBA", (16, 16), (0, 0, 255, 255)), "PNG", (0, 0, 255)),
        (lambda: Image.new("LA", (16, 16), (0, 0)), "PNG", (255, 255, 255)),
        (lambda: Image.new("CMYK", (16, 16), (0, 255, 255, 0)), "JPEG", (255, 0, 0)),
        (lambda: Image.new("I;16", (16, 16), 40000), "PNG", (156, 156, 156)),
        (lambda: Image.new("1", (16, 16), 1), "PNG", (255, 255, 255)),
    ],
)
def test_every_mode_comes_out_rgb(make, fmt, want):
    img = make()
    out = image_tiles(encode(img, fmt), ImageConfig(tile_size=16, max_image_side=16))
    assert out.shape == (1, 3, 16, 16)
    got = _single_color(out)
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 3, (img.mode, got)


def test_palette_with_transparency_composites_on_white():
    img = Image.new("P", (16, 16), 0)
    img.putpalette([10, 20, 30] + [0] * 765)
    img.info["transparency"] = 0
    out = image_tiles(encode(img, "PNG", transparency=0), ImageConfig(tile_size=16))
    assert _single_color(out) == (255, 255, 255)


def test_large_jpegs_decode_at_the_scale_of_pillows_draft_mode():
    big = encode(photo(4000, 3000), "JPEG")
    requested = []

    def target(width, height):
        requested.append((width, height))
        return 1024, 768  # a 2 x 2 grid of 512 px tiles

    half = decode_pixels(big, (4000, 3000), draft=target)
    assert requested == [(4000, 3000)] and half.shape == (1500, 2000, 3)  # decoded at half size
    with Image.open(io.BytesIO(big)) as img:
        img.draft("RGB", (1024, 768))
        assert np.array_equal(half, np.asarray(img))  # Pillow's draft decode, pixel for pixel
    assert image_tiles(big, ImageConfig()).shape[0] == 5
    small = encode(photo(1500, 1000), "JPEG")  # 1024 x 683: more than half the source
    assert decode_pixels(small, draft=lambda w, h: (1024, 683)).shape == (1000, 1500, 3)


def photo(width: int, height: int) -> Image.Image:
    """Gradients and noise: a JPEG's every block differs."""
    rng = np.random.default_rng(width * 7 + height)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width, 1), y * 255 // max(height, 1), (x * y) % 256], -1)
    return Image.fromarray((base + rng.integers(0, 40, base.shape)).clip(0, 255).astype(np.uint8))


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("draft", [None, (60, 40)])
def test_decoded_pixels_are_pillows_in_every_exif_orientation(orientation, draft):
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encode(photo(240, 160), "JPEG", exif=exif.tobytes())
    shown = (160, 240) if orientation in (5, 6, 7, 8) else (240, 160)

    def target(width, height):
        return draft if shown[0] > shown[1] else draft[::-1]

    fast = decode_pixels(data, shown, draft=target if draft else None)
    expected = np.asarray(open_image(data, shown, draft=target if draft else None))
    assert fast.shape == expected.shape and np.array_equal(fast, expected)
    assert fast.shape[:2][::-1] == (shown if draft is None else (shown[0] // 4, shown[1] // 4))


@pytest.mark.parametrize("mode, fmt", [("L", "JPEG"), ("CMYK", "JPEG"), ("RGB", "PNG")])
def test_grey_cmyk_and_other_formats_decode_as_open_image_does(mode, fmt):
    data = encode(photo(64, 48).convert(mode), fmt)
    assert np.array_equal(decode_pixels(data), np.asarray(open_image(data)))


@pytest.mark.parametrize("cut", [0.1, 0.5, 0.9, 0.999])
def test_truncated_jpeg_pixels_are_refused_as_unreadable(cut):
    data = encode(photo(300, 200), "JPEG")
    with pytest.raises(UnreadableImage):
        decode_pixels(data[: int(len(data) * cut)])
    with pytest.raises(ImageSizeMismatch, match="decodes to 300x200, the index says 301x200"):
        decode_pixels(data, (301, 200))


def test_decode_stage_skips_a_bad_image_and_keeps_the_rest():
    good = encode(Image.new("RGB", (40, 40), (0, 128, 0)), "JPEG")
    samples = [
        {"__key__": "a", "__shard__": "s", "0.jpg": good, "__meta__": {"images": [[40, 40]]}},
        {"__key__": "b", "__shard__": "s", "0.jpg": good[:100], "__meta__": {"images": [[40, 40]]}},
        {"__key__": "c", "__shard__": "s", "0.jpg": good, "__meta__": {"images": [[41, 40]]}},
        {"__key__": "d", "__shard__": "s", "__meta__": {"images": []}},
        {
            "__key__": "e",
            "__shard__": "s",
            "0.jpg": good,
            "1.jpg": good,
            "__meta__": {"images": [[40, 40]]},
        },
    ]
    stats = SkipStats()
    out = list(DecodeImages(ImageConfig(tile_size=32), stats=stats)(iter(samples)))
    assert [s["__key__"] for s in out] == ["a", "d"]
    assert out[0]["image_tiles"] == [5] and out[0]["pixel_values"].shape == (5, 3, 32, 32)
    assert "0.jpg" not in out[0]
    assert out[1]["image_tiles"] == [] and out[1]["pixel_values"].shape == (0, 3, 32, 32)
    assert stats.counts == {
        "undecodable_image": 1,
        "image_size_mismatch": 1,
        "image_count_mismatch": 1,
    }
    assert stats.examples == {
        "undecodable_image": ["s/b"],
        "image_size_mismatch": ["s/c"],
        "image_count_mismatch": ["s/e"],
    }
