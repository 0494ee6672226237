"""Image files as a dataset holds them: what the writer records of an image, and decoding one
as displayed (RGB, EXIF orientation applied). No torch: the writer uses this module.

A sample's images are its members ``0.jpg``, ``1.png``, ... (``image_members``, by
``format.members``' rule). The sizes the
index records are the displayed ones, so a reader can plan an image's tokens before decoding
it, and refuses an image that decodes to another size (``ImageSizeMismatch``).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .members import IMAGE, read_members

# Formats stored as their original bytes; anything else is re-encoded to PNG.
KEPT_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
# EXIF orientations that turn the image by 90 or 270 degrees (width and height swap).
_TRANSPOSED_ORIENTATIONS = {5, 6, 7, 8}
_EXIF_ORIENTATION = 0x0112
_WHITE = (255, 255, 255)
# What Pillow raises for bytes that are no image it can decode completely.
BAD_IMAGE_ERRORS = (
    UnidentifiedImageError,
    OSError,
    SyntaxError,
    ValueError,
    Image.DecompressionBombError,
)


class UnreadableImage(ValueError):
    """The bytes are not an image Pillow can decode completely."""


class UnusableImage(ValueError):
    """The image reads, but the model family's processor refuses its size (the Qwen
    processors refuse an aspect ratio over 200, say)."""


class ImageSizeMismatch(UnreadableImage):
    """The image decodes to another size than the index recorded for it."""


@dataclass(frozen=True)
class ImageInfo:
    """What the index records of one image: its stored extension, bytes and displayed size."""

    ext: str
    width: int
    height: int
    reencoded: bool


def _checked_size(img: Image.Image, expected_size: Sequence[int] | None) -> tuple[int, int]:
    """The displayed size of ``img``, refused where the index recorded another."""
    width, height = _displayed_size(img)
    if expected_size is not None and (width, height) != tuple(expected_size):
        raise ImageSizeMismatch(
            f"decodes to {width}x{height}, the index says {expected_size[0]}x{expected_size[1]}"
        )
    return width, height


def _displayed_size(img: Image.Image) -> tuple[int, int]:
    width, height = img.size
    if img.getexif().get(_EXIF_ORIENTATION, 1) in _TRANSPOSED_ORIENTATIONS:
        return height, width
    return width, height


def probe_image(data: bytes) -> ImageInfo:
    """Identify and fully decode ``data``; sizes are as displayed (EXIF orientation applied).

    JPEGs are decoded in draft mode (at 1/8 scale), which still reads the whole stream, so a
    truncated or corrupt file is caught at a fraction of the cost of a full decode.
    """
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = img.format
            width, height = _displayed_size(img)
            if fmt == "JPEG":
                img.draft(img.mode, (max(1, img.width // 8), max(1, img.height // 8)))
            img.load()
    except BAD_IMAGE_ERRORS as e:
        raise UnreadableImage(str(e) or type(e).__name__) from e
    ext = KEPT_FORMATS.get(fmt or "")
    return ImageInfo(ext=ext or "png", width=width, height=height, reencoded=ext is None)


def image_size(data: bytes) -> tuple[int, int]:
    """Displayed ``(width, height)`` from the header alone (no decode)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return _displayed_size(img)
    except BAD_IMAGE_ERRORS as e:
        raise UnreadableImage(str(e) or type(e).__name__) from e


def stored_bytes(data: bytes, info: ImageInfo) -> bytes:
    """The bytes the shard holds for an image: the original, or a PNG for other formats."""
    if not info.reencoded:
        return data
    with Image.open(io.BytesIO(data)) as img:
        img.seek(0)  # the first frame of an animation
        img = ImageOps.exif_transpose(img)  # PNG keeps no orientation tag: apply it
        if img.mode not in ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"):
            img = img.convert("RGBA" if "A" in img.getbands() else "RGB")
        out = io.BytesIO()
        img.save(out, format="PNG")
        return out.getvalue()


def to_rgb(img: Image.Image) -> Image.Image:
    """Any Pillow mode as RGB: alpha composited on white, 16-bit scaled to 8-bit."""
    if img.mode == "RGB":
        return img
    if img.mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
        if img.mode == "RGB":
            return img
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        # 16-bit samples (PNG, TIFF): keep the top 8 bits. Pillow's own convert clips instead.
        values = np.asarray(img, dtype=np.uint32) >> 8
        return Image.fromarray(np.clip(values, 0, 255).astype(np.uint8), "L").convert("RGB")
    if img.mode == "F":
        return Image.fromarray(np.clip(np.asarray(img), 0, 255).astype(np.uint8), "L").convert(
            "RGB"
        )
    if "A" in img.getbands() or img.mode in ("RGBa", "La", "PA"):
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, _WHITE)
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")


def open_image(
    data: bytes,
    expected_size: Sequence[int] | None = None,
    draft: Callable[[int, int], tuple[int, int]] | None = None,
) -> Image.Image:
    """Decode one image as displayed: RGB, EXIF orientation applied.

    ``expected_size`` is the displayed size the index recorded; an image of another size is
    refused (``ImageSizeMismatch``), since the tokens planned for it would not match.
    ``draft(width, height)``, if given, returns the displayed size the image will be resized
    to; a JPEG is then decoded at reduced size (PIL draft mode) when that is at most half
    the source.
    """
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = _checked_size(img, expected_size)
            if draft is not None and img.format == "JPEG":
                target = draft(width, height)
                img.draft("RGB", target if img.size == (width, height) else target[::-1])
            return to_rgb(ImageOps.exif_transpose(img))
    except UnreadableImage:
        raise
    except BAD_IMAGE_ERRORS as e:
        raise UnreadableImage(str(e) or type(e).__name__) from e


# Pillow's transposes of the EXIF orientations (ImageOps.exif_transpose), on [H, W, 3] arrays.
_ORIENTED = {
    2: lambda a: a[:, ::-1],  # mirrored
    3: lambda a: a[::-1, ::-1],  # turned 180 degrees
    4: lambda a: a[::-1],  # flipped
    5: lambda a: a.transpose(1, 0, 2),  # transposed
    6: lambda a: a.transpose(1, 0, 2)[:, ::-1],  # turned 90 degrees clockwise
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),  # transversed
    8: lambda a: a.transpose(1, 0, 2)[::-1],  # turned 90 degrees counter-clockwise
}


def decode_pixels(
    data: bytes,
    expected_size: Sequence[int] | None = None,
    draft: Callable[[int, int], tuple[int, int]] | None = None,
) -> np.ndarray:
    """``open_image`` as a uint8 ``[height, width, 3]`` array: the same pixels, faster.

    A colour JPEG is decoded by OpenCV's libjpeg-turbo straight into the array, at the
    reduced scale Pillow's draft mode picks (the largest of 1/2, 1/4, 1/8 that keeps the image
    at least ``draft``'s size), and turned as its EXIF orientation says; Pillow would decode
    the same pixels, then copy them twice (its orientation step and its array interface).
    Any other image is ``open_image``'s."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = _checked_size(img, expected_size)
            if img.format != "JPEG" or img.mode != "RGB":  # grey, CMYK, PNG, ...: Pillow's
                return np.asarray(open_image(data, expected_size, draft))
            scale = 1
            if draft is not None:
                target = draft(width, height)
                target = target if img.size == (width, height) else target[::-1]
                most = min(img.size[0] // target[0], img.size[1] // target[1])
                scale = next((s for s in (8, 4, 2) if most >= s), 1)
            orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
    except UnreadableImage:
        raise
    except BAD_IMAGE_ERRORS as e:
        raise UnreadableImage(str(e) or type(e).__name__) from e
    cv2 = opencv()
    reduced = {1: 0, 2: cv2.IMREAD_REDUCED_GRAYSCALE_2, 4: cv2.IMREAD_REDUCED_GRAYSCALE_4}
    reduced[8] = cv2.IMREAD_REDUCED_GRAYSCALE_8  # with IMREAD_COLOR_RGB: reduced, in colour
    flags = reduced[scale] | cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION
    pixels = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
    if pixels is None:
        raise UnreadableImage("the JPEG data does not decode (truncated or corrupt)")
    turn = _ORIENTED.get(orientation)
    return pixels if turn is None else np.ascontiguousarray(turn(pixels))


_opencv_threads_off = False


def opencv() -> Any:
    """cv2, with its thread pool off in this process (``setNumThreads(0)``, before its first
    use): a pool that has run does not survive a fork, and a DataLoader worker forked after
    it (``multiprocessing_context="fork"``) would hang in its first resize. Workers run on one
    thread each anyway, as torch runs them."""
    global _opencv_threads_off
    import cv2

    if not _opencv_threads_off:
        cv2.setNumThreads(0)
        _opencv_threads_off = True
    return cv2


def image_members(sample: dict) -> list[str]:
    """The sample's image member names, in image order, by the one rule of
    ``format.members`` (the one ``wdsvlm index`` and the writer follow)."""
    return read_members(sample, IMAGE)
