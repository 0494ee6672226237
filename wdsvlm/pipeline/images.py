"""Images: the pipeline stage that decodes a sample's images into one uint8 tensor, as the
family says (``families/base.py``: the default tiling, or a processor's units).

What an image file is and how it reads (``UnreadableImage``, ``open_image``, ...) lives in
``format/images.py``; the tiling (``ImageConfig``, ``tile_count``, ...) in
``families/tiling.py``. ``ImageConfig`` is importable from here too.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..families.base import Family
from ..families.tiling import ImageConfig, TilingFamily
from ..format.images import (
    ImageSizeMismatch,
    UnreadableImage,
    UnusableImage,
    image_members,
    image_size,
)
from .memory import private_uint8, shared_uint8
from .stats import SkipStats

if TYPE_CHECKING:
    import torch

__all__ = ["DecodeImages", "ImageConfig", "uint8_tiles"]


class DecodeImages:
    """Pipeline stage: image members -> ``pixel_values`` (a uint8 tensor ``[N, 3, S, S]``) and
    ``image_tiles`` (tiles per image, in order). The image bytes are dropped.

    A sample with an image that does not decode, or that disagrees with the index, is skipped
    and counted (``undecodable_image``, ``image_size_mismatch``, ``image_count_mismatch``).
    ``family`` (``registry.family_of(processor)``, say) decides the units: ``pixel_values``
    holds the family's uint8 units and ``image_tiles`` the units per image; without it, the
    default tiling with ``config``.
    """

    def __init__(
        self,
        config: ImageConfig | None = None,
        *,
        family: Family | None = None,
        stats: SkipStats | None = None,
    ):
        self.family = family or TilingFamily(config)
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
        """All units of a sample in one uint8 tensor, written in place image by image."""
        if sizes is None:  # no index entry: the sizes from the image headers
            sizes = [list(image_size(sample[name])) for name in names]
            sample.setdefault("__meta__", {})["images"] = sizes
        counts = [self.family.image_cost(w, h, len(sizes) == 1) for w, h in sizes]
        pixels = uint8_tiles(sum(counts), self.family.unit_size)
        self.family.decode(sample, pixels)
        for name in names:
            del sample[name]
        return pixels, counts


def uint8_tiles(n_tiles: int, tile: int) -> torch.Tensor:
    """An empty ``[n_tiles, 3, tile, tile]`` uint8 tensor; inside a DataLoader worker it lives
    in shared memory, so it crosses to the training process without a copy (``memory.py``:
    how its pages are made cheap to write)."""
    from torch.utils.data import get_worker_info

    shape = (n_tiles, 3, tile, tile)
    return private_uint8(shape) if get_worker_info() is None else shared_uint8(shape)
