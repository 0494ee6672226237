"""Images: what the writer needs to know of an image file, and (later) decode and tiling."""

from __future__ import annotations

import io
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

# Formats stored as their original bytes; anything else is re-encoded to PNG.
KEPT_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
# EXIF orientations that turn the image by 90 or 270 degrees (width and height swap).
_TRANSPOSED_ORIENTATIONS = {5, 6, 7, 8}
_EXIF_ORIENTATION = 0x0112


class UnreadableImage(ValueError):
    """The bytes are not an image Pillow can decode completely."""


@dataclass(frozen=True)
class ImageInfo:
    """What the index records of one image: its stored extension, bytes and displayed size."""

    ext: str
    width: int
    height: int
    reencoded: bool


def probe_image(data: bytes) -> ImageInfo:
    """Identify and fully decode ``data``; sizes are as displayed (EXIF orientation applied).

    JPEGs are decoded in draft mode (at 1/8 scale), which still reads the whole stream, so a
    truncated or corrupt file is caught at a fraction of the cost of a full decode.
    """
    try:
        with Image.open(io.BytesIO(data)) as img:
            fmt = img.format
            width, height = img.size
            orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
            if fmt == "JPEG":
                img.draft(img.mode, (max(1, width // 8), max(1, height // 8)))
            img.load()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise UnreadableImage(str(e) or type(e).__name__) from e
    if orientation in _TRANSPOSED_ORIENTATIONS:
        width, height = height, width
    ext = KEPT_FORMATS.get(fmt or "")
    return ImageInfo(ext=ext or "png", width=width, height=height, reencoded=ext is None)


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
