"""The default family: nanoVLM-style tiling, for a plain tokenizer.

The long side is scaled to at most ``max_image_side`` (up to it only with ``upscale``), the
image is resized to the grid of ``ceil(w / tile) x ceil(h / tile)`` whole tiles (stretching it
by less than one tile) and cut into those tiles, row by row. When there is more than one
tile, a global thumbnail of the whole image, resized to one tile, comes first. Colour JPEGs
are decoded by OpenCV straight into an array (``decode_pixels``: Pillow's pixels, without its
copies), at reduced size (the scale of Pillow's draft mode) whenever the grid is at most half
the source; decoding is most of the time on web-sized images.

In the text, each ``<image>`` marker becomes the image token (the tokenizer's own, or
``<image>``, added to a copy of the tokenizer when it lacks it), which is then repeated
``tokens_per_tile`` times for each tile. The batches go to the model as they are.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..format.conversation import IMAGE_MARKER
from ..format.images import decode_pixels, open_image, opencv
from .base import Edit, decode_each

if TYPE_CHECKING:
    import torch

log = logging.getLogger("wdsvlm.tiling")


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


def image_tiles(
    data: bytes,
    config: ImageConfig,
    expected_size: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
    edit: Callable[[Any], Any] | None = None,
) -> torch.Tensor:
    """Decode one image into uint8 tiles ``[n_tiles, 3, tile, tile]`` (thumbnail first).

    ``expected_size`` is the displayed size the index recorded; an image of another size is
    refused, since its tile count would not match the tokens already planned for it. ``out``,
    if given, receives the tiles (a slice of a batch's tensor, say) and is returned.
    ``edit(image)`` makes the decoded image (PIL, as displayed: no draft decode then) into the
    one to tile.
    Resizing is OpenCV's (``resize``): bicubic, after a box average by the whole factor where
    both sides shrink by 2 or more.
    """
    import torch  # here, not at the top: importing the tiling needs no torch

    tile = config.tile_size
    shape: list[int] = []  # (columns, rows), known once the size is

    def target(width: int, height: int) -> tuple[int, int]:
        shape[:] = tile_grid(width, height, config)
        return shape[0] * tile, shape[1] * tile

    if edit is None:
        pixels = decode_pixels(data, expected_size, draft=target)
    else:
        img = edit(open_image(data, expected_size))
        pixels = np.asarray(img)
    cols, rows = shape or tile_grid(pixels.shape[1], pixels.shape[0], config)
    n_tiles = rows * cols + (rows * cols > 1)
    if out is None:
        out = torch.empty((n_tiles, 3, tile, tile), dtype=torch.uint8)
    elif tuple(out.shape) != (n_tiles, 3, tile, tile):
        raise ValueError(f"out has shape {tuple(out.shape)}, the image needs {n_tiles} tiles")
    grid = resize(pixels, cols * tile, rows * tile)  # [H, W, 3]
    units = out.numpy()  # [n_tiles, 3, tile, tile]: each tile's three planes, written in place
    if n_tiles > 1:  # the thumbnail, from the grid
        planes(resize(grid, tile, tile), units[0])
    for r in range(rows):
        for c in range(cols):
            at = n_tiles - rows * cols + r * cols + c
            planes(grid[r * tile : (r + 1) * tile, c * tile : (c + 1) * tile], units[at])
    return out


def planes(pixels: np.ndarray, out: np.ndarray) -> None:
    """uint8 ``[h, w, 3]`` into ``out`` ``[3, h, w]`` (OpenCV's SIMD split, in place: four
    times as fast as a strided copy)."""
    split = opencv().split(pixels, list(out))
    if split[0].ctypes.data != out[0].ctypes.data:  # OpenCV made arrays of its own instead
        raise ValueError(f"cannot split {pixels.shape} pixels into {out.shape} planes")


def resize(pixels: np.ndarray, width: int, height: int) -> np.ndarray:
    """uint8 ``[h, w, 3]`` to ``[height, width, 3]`` with OpenCV (SIMD): shrinking both sides
    by one whole factor (a square grid's thumbnail) is the box average (``INTER_AREA``'s fast
    path); otherwise, where both sides shrink by 2 or more, the box average by the smaller whole
    factor comes first (antialiasing what is left out), then bicubic (``INTER_CUBIC``:
    a = -0.75, the kernel of torch and Pillow) to the size. OpenCV runs on the calling thread
    (``opencv``)."""
    cv2 = opencv()
    h, w = pixels.shape[:2]
    if (w, h) == (width, height):
        return np.array(pixels)  # never a view of the input
    if width <= w and height <= h:
        if w % width == 0 and h % height == 0 and w // width == h // height:
            return cv2.resize(pixels, (width, height), interpolation=cv2.INTER_AREA)
        factor = min(w // width, h // height)
        if factor >= 2:
            pixels = cv2.resize(pixels, (w // factor, h // factor), interpolation=cv2.INTER_AREA)
    return cv2.resize(pixels, (width, height), interpolation=cv2.INTER_CUBIC)


def decode_into(
    sample: dict, config: ImageConfig, out: torch.Tensor, edit: Edit | None = None
) -> None:
    """Decode a sample's images into ``out``: their tiles, one after another."""
    decode_each(
        sample,
        out,
        lambda w, h, alone: tile_count(w, h, config),
        lambda data, size, part, one: image_tiles(data, config, size, out=part, edit=one),
        edit,
    )


def load_tokenizer(tokenizer: Any):
    """A Hugging Face tokenizer object as is, or one loaded by name or path."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    name = str(tokenizer)
    local = os.path.isabs(name) or name.startswith(("./", "../", "~"))  # "org/name" is a hub id
    if local and not os.path.exists(os.path.expanduser(name)):
        raise ValueError(f"cannot load the tokenizer {name!r}: there is no such folder")
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer {str(tokenizer)!r}: {e}") from None


class TilingFamily:
    """The default tiling as a family (see the module doc).

    ``tokenizer``: a Hugging Face tokenizer, or a name/path for ``AutoTokenizer``; None for
    the image side alone (``DecodeImages``, ``Collate``). The image token is ``image_token``,
    else the tokenizer's own ``image_token``, else ``<image>``; when the vocabulary lacks it,
    it is added as a special token to a copy of the tokenizer (logged with its id: resize the
    model's embeddings to ``len(family.tokenizer)``).
    """

    name = "tiling"
    names: tuple[str, ...] = ()  # its batches carry no family name: no model_inputs
    unit_name = "tiles"
    no_video = "the default tiling tiles images only"
    device_fields: tuple[str, ...] = ()
    chat_template = None  # the tokenizer's own, else ChatML
    image_wrap = ("", "")  # an image in a document: its tokens alone

    def __init__(
        self,
        config: ImageConfig | None = None,
        tokenizer: Any = None,
        *,
        tokens_per_tile: int = 64,
        image_token: str | None = None,
    ):
        if tokens_per_tile < 1:
            raise ValueError(f"tokens_per_tile ({tokens_per_tile}) must be positive")
        self.config = config or ImageConfig()
        self.unit_size = self.config.tile_size
        self.tokens_per_tile = tokens_per_tile
        self.tokenizer = tok = None if tokenizer is None else load_tokenizer(tokenizer)
        self.placeholder = image_token or getattr(tok, "image_token", None) or IMAGE_MARKER
        self.image_token_id = None
        if tok is None:
            return
        if len(tok.encode(self.placeholder, add_special_tokens=False)) != 1:
            tok = self.tokenizer = copy.deepcopy(tok)
            tok.add_tokens([self.placeholder], special_tokens=True)
            log.warning(
                "added the image token %r to a copy of the tokenizer as id %d; the "
                "model's embeddings need %d rows",
                self.placeholder,
                tok.convert_tokens_to_ids(self.placeholder),
                len(tok),
            )
        self.image_token_id = tok.convert_tokens_to_ids(self.placeholder)

    @property
    def modules(self) -> tuple[str, ...]:
        return (type(self).__module__, "cv2")  # cv2: the resize

    def chat_messages(self, messages: list[dict]) -> list[dict]:
        """The messages with each ``<image>`` marker written as the image token."""
        if self.placeholder == IMAGE_MARKER:
            return messages
        return [
            {**m, "content": m["content"].replace(IMAGE_MARKER, self.placeholder)} for m in messages
        ]

    def image_cost(self, width: int, height: int, alone: bool = True) -> int:
        return tile_count(width, height, self.config)

    def image_token_ids(self, width: int, height: int, alone: bool = True) -> np.ndarray:
        """The image token, ``tokens_per_tile`` times for each tile."""
        n = self.image_cost(width, height) * self.tokens_per_tile
        return np.full(n, self.image_token_id, dtype=np.int64)

    def fingerprint_facts(self) -> list:
        """Nothing: the tiling's settings are checked on resume as settings of their own."""
        return []

    def decode(self, sample: dict, out: torch.Tensor, edit: Edit | None = None) -> None:
        decode_into(sample, self.config, out, edit)

    def constant_fields(self) -> dict:
        return {}

    def batch_fields(self, rows: list[list[dict]], batch: dict) -> dict:
        return {}

    @staticmethod
    def model_fields(batch: dict, units: Any, normalised: Any) -> dict:
        raise ValueError(
            "the default tiling's batches go to the model as they are: use input_ids, "
            "labels, position_ids and pixel_values"
        )
