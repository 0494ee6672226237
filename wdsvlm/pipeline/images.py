"""Images: what the writer needs to know of an image file, and decoding into uint8 tiles.

Tiling is nanoVLM-style. The long side is scaled to at most ``max_image_side`` (up to it only
with ``upscale``), the image is resized to the grid of ``ceil(w / tile) x ceil(h / tile)``
whole tiles (stretching it by less than one tile) and cut into those tiles, row by row. When
there is more than one tile, a global thumbnail of the whole image, resized to one tile, comes
first. JPEGs are decoded at reduced size (PIL draft mode) whenever the grid is at most half
the source, which is where most of the decode time goes on web-sized images.
"""

from __future__ import annotations

import io
import math
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..pipeline.stats import SkipStats

if TYPE_CHECKING:
    import torch

# Formats stored as their original bytes; anything else is re-encoded to PNG.
KEPT_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}
# EXIF orientations that turn the image by 90 or 270 degrees (width and height swap).
_TRANSPOSED_ORIENTATIONS = {5, 6, 7, 8}
_EXIF_ORIENTATION = 0x0112
_WHITE = (255, 255, 255)
# Image members of a sample: "0.jpg", "1.png", ...
IMAGE_MEMBER = re.compile(r"(\d+)\.[A-Za-z0-9]+")
_BAD_IMAGE = (
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
    except _BAD_IMAGE as e:
        raise UnreadableImage(str(e) or type(e).__name__) from e
    ext = KEPT_FORMATS.get(fmt or "")
    return ImageInfo(ext=ext or "png", width=width, height=height, reencoded=ext is None)


def image_size(data: bytes) -> tuple[int, int]:
    """Displayed ``(width, height)`` from the header alone (no decode)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            return _displayed_size(img)
    except _BAD_IMAGE as e:
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


@dataclass(frozen=True)
class ImageConfig:
    """How images become tiles."""

    tile_size: int = 512
    """Side of a square tile, in pixels."""
    max_image_side: int = 1024
    """The long side is scaled down to this (never up, unless ``upscale``)."""
    upscale: bool = False
    """Scale smaller images up so that their long side is ``max_image_side``."""

    def __post_init__(self):
        if self.tile_size < 1 or self.max_image_side < 1:
            raise ValueError(
                f"tile_size ({self.tile_size}) and max_image_side ({self.max_image_side}) "
                "must be positive"
            )


def tile_grid(width: int, height: int, config: ImageConfig) -> tuple[int, int]:
    """``(columns, rows)`` of whole tiles for an image displayed at ``width x height``."""
    long_side = max(width, height)
    scale = config.max_image_side / long_side
    if not config.upscale:
        scale = min(1.0, scale)
    w = max(1, round(width * scale))
    h = max(1, round(height * scale))
    return math.ceil(w / config.tile_size), math.ceil(h / config.tile_size)


def tile_count(width: int, height: int, config: ImageConfig) -> int:
    """Tiles of one image: the grid, plus the global thumbnail when the grid has several."""
    cols, rows = tile_grid(width, height, config)
    return cols * rows + (cols * rows > 1)


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
            width, height = _displayed_size(img)
            if expected_size is not None and (width, height) != tuple(expected_size):
                raise ImageSizeMismatch(
                    f"decodes to {width}x{height}, the index says "
                    f"{expected_size[0]}x{expected_size[1]}"
                )
            if draft is not None and img.format == "JPEG":
                target = draft(width, height)
                img.draft("RGB", target if img.size == (width, height) else target[::-1])
            return to_rgb(ImageOps.exif_transpose(img))
    except UnreadableImage:
        raise
    except _BAD_IMAGE as e:
        raise UnreadableImage(str(e) or type(e).__name__) from e


def image_tiles(
    data: bytes,
    config: ImageConfig,
    expected_size: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode one image into uint8 tiles ``[n_tiles, 3, tile, tile]`` (thumbnail first).

    ``expected_size`` is the displayed size the index recorded; an image of another size is
    refused, since its tile count would not match the tokens already planned for it. ``out``,
    if given, receives the tiles (a slice of a batch's tensor, say) and is returned.
    Resizing is torch's antialiased bicubic on uint8, which matches Pillow's bicubic to within
    2 levels and runs several times faster.
    """
    import torch  # here, not at the top: the writer uses this module and needs no torch

    tile = config.tile_size
    shape: list[int] = []  # (columns, rows), known once the size is

    def target(width: int, height: int) -> tuple[int, int]:
        shape[:] = tile_grid(width, height, config)
        return shape[0] * tile, shape[1] * tile

    img = open_image(data, expected_size, draft=target)
    cols, rows = shape or tile_grid(*img.size, config)
    with warnings.catch_warnings():  # read-only buffer: nothing below writes to it
        warnings.simplefilter("ignore", UserWarning)
        pixels = torch.frombuffer(img.tobytes(), dtype=torch.uint8)
    pixels = pixels.view(img.height, img.width, 3)
    target_size = (cols * tile, rows * tile)
    n_tiles = rows * cols + (rows * cols > 1)
    if out is None:
        out = torch.empty((n_tiles, 3, tile, tile), dtype=torch.uint8)
    elif tuple(out.shape) != (n_tiles, 3, tile, tile):
        raise ValueError(f"out has shape {tuple(out.shape)}, the image needs {n_tiles} tiles")
    # [1, 3, H, W]
    grid = _resize(pixels.permute(2, 0, 1).unsqueeze(0), target_size[1], target_size[0])
    tiles = grid[0].view(3, rows, tile, cols, tile).permute(1, 3, 0, 2, 4)
    if n_tiles > 1:
        out[0] = _resize(grid, tile, tile)[0]
    out[n_tiles - rows * cols :].view(rows, cols, 3, tile, tile).copy_(tiles)
    return out


def _resize(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[1, 3, h, w]`` uint8 to ``[1, 3, height, width]``, antialiased bicubic."""
    import torch
    from torch.nn.functional import interpolate

    if images.shape[-2:] == (height, width):
        return images.clone(memory_format=torch.contiguous_format)  # never a view of the input
    return interpolate(images, size=(height, width), mode="bicubic", antialias=True)


def image_members(sample: dict) -> list[str]:
    """The sample's image member names, in image order."""
    found = [(int(m.group(1)), k) for k in sample if (m := IMAGE_MEMBER.fullmatch(k))]
    return [k for _, k in sorted(found)]


class DecodeImages:
    """Pipeline stage: image members -> ``pixel_values`` (a uint8 tensor ``[N, 3, S, S]``) and
    ``image_tiles`` (tiles per image, in order). The image bytes are dropped.

    A sample with an image that does not decode, or that disagrees with the index, is skipped
    and counted (``undecodable_image``, ``image_size_mismatch``, ``image_count_mismatch``).
    With a model ``family`` (``processors.family_of(processor)``), ``pixel_values`` holds the
    family's uint8 units and ``image_tiles`` the units per image.
    """

    def __init__(
        self,
        config: ImageConfig | None = None,
        *,
        family=None,
        stats: SkipStats | None = None,
    ):
        self.config = config or ImageConfig()
        self.family = family
        self.stats = stats if stats is not None else SkipStats()

    def __call__(self, samples: Iterator[dict]) -> Iterator[dict]:
        for sample in samples:
            names = image_members(sample)
            sizes = sample.get("__meta__", {}).get("images")
            if sizes is not None and len(sizes) != len(names):
                self.stats.skip(
                    "images",
                    "image_count_mismatch",
                    sample,
                    f"{len(names)} image members, the index lists {len(sizes)}",
                )
                continue
            try:
                sample["pixel_values"], sample["image_tiles"] = self._decode(sample, names, sizes)
            except ImageSizeMismatch as e:
                self.stats.skip("images", "image_size_mismatch", sample, str(e))
                continue
            except UnreadableImage as e:
                self.stats.skip("images", "undecodable_image", sample, str(e))
                continue
            except UnusableImage as e:
                self.stats.skip("images", "unusable_image", sample, str(e))
                continue
            self.stats.ok("images")
            yield sample

    def _decode(self, sample: dict, names: list[str], sizes: list | None):
        """All tiles (or a family's units) of a sample in one uint8 tensor, written in place
        image by image."""
        if sizes is None:  # no index entry: the sizes from the image headers
            sizes = [list(image_size(sample[name])) for name in names]
            sample.setdefault("__meta__", {})["images"] = sizes
        family, config = self.family, self.config
        if family is not None:
            from ..families.processors import decode_units

            counts = [family.image_cost(w, h) for w, h in sizes]
            pixels = uint8_tiles(sum(counts), family.unit_size)
            decode_units(sample, family, pixels)
        else:
            counts = [tile_count(w, h, config) for w, h in sizes]
            pixels = uint8_tiles(sum(counts), config.tile_size)
            decode_into(sample, config, pixels)
        for name in names:
            del sample[name]
        return pixels, counts


def uint8_tiles(n_tiles: int, tile: int) -> torch.Tensor:
    """An empty ``[n_tiles, 3, tile, tile]`` uint8 tensor; inside a DataLoader worker it lives
    in shared memory, so it crosses to the training process without a copy."""
    import torch
    from torch.utils.data import get_worker_info

    shape = (n_tiles, 3, tile, tile)
    if get_worker_info() is None:
        return torch.empty(shape, dtype=torch.uint8)
    # made in shared memory at once: share_memory_() on a private tensor would fault in and
    # copy a private buffer first
    storage = torch.UntypedStorage._new_shared(n_tiles * 3 * tile * tile)
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


def decode_each(
    sample: dict,
    out: torch.Tensor,
    cost: Callable[[int, int], int],
    fill: Callable[[bytes, Sequence[int], torch.Tensor], object],
) -> None:
    """Decode a sample's images, in order, into ``out``: image by image, ``cost(w, h)``
    units each, written by ``fill(bytes, index size, its slice of out)``, which checks the
    image against the size in the sample's index entry."""
    start = 0
    for name, size in zip(image_members(sample), sample["__meta__"]["images"], strict=True):
        count = cost(*size)
        fill(sample[name], size, out[start : start + count])
        start += count


def decode_into(sample: dict, config: ImageConfig, out: torch.Tensor) -> None:
    """Decode a sample's images into ``out``: their tiles, one after another."""
    decode_each(
        sample,
        out,
        lambda w, h: tile_count(w, h, config),
        lambda data, size, part: image_tiles(data, config, size, out=part),
    )
