"""The Qwen2-VL, Qwen2.5-VL and Qwen3-VL family: dynamic resolution, flattened patches, mRoPE.

An image is resized as the processor resizes it (``smart_resize``: both sides multiples of
``patch_size * merge_size``, the area within the processor's min and max pixels, the aspect
ratio kept), cut into ``patch_size`` patches in the processor's order (blocks of
``merge_size x merge_size`` patches, row by row) and shipped as uint8 ``[patches, 3, P, P]``;
``model_fields`` normalises them and repeats each over ``temporal_patch_size`` frames, which is
the processor's flattened ``pixel_values`` ``[patches, 3 * T * P * P]``. In the text, the
template's one ``<|image_pad|>`` per image becomes ``patches / merge_size**2`` of them.

Positions: row 0 of ``position_ids`` ``[4, B, L]`` restarts at 0 for each packed sample (that
is how transformers finds the packed samples); rows 1-3 are the 3-D rotary positions of each
sample computed alone, as the model's ``get_rope_index`` computes them: text tokens count up
on all three axes, an image's tokens take ``start + (t, row, column)`` of its merged grid, and
the text after it goes on from ``start + max(rows, columns)``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..format.images import UnusableImage
from .hf_processor import ProcessorFamily

_NAMES = {
    "Qwen2VLProcessor": "qwen2_vl",
    "Qwen2_5_VLProcessor": "qwen2_5_vl",
    "Qwen3VLProcessor": "qwen3_vl",
}


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """``(height, width)`` the Qwen processors resize an image to: multiples of ``factor``,
    an area within ``[min_pixels, max_pixels]``, the aspect ratio kept as closely as may be."""
    if max(height, width) / min(height, width) > 200:
        raise UnusableImage(
            f"an image of {width}x{height} has an aspect ratio over 200, which the Qwen "
            "processors refuse"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def mrope_positions(
    input_ids: np.ndarray, grids: list[tuple[int, int, int]], image_token_id: int, merge: int
) -> np.ndarray:
    """``[3, n]`` rotary positions (temporal, height, width) of one sample alone, as the
    model's ``get_rope_index`` gives them; ``grids``: each image's ``(t, h, w)`` in patches,
    in the order of the image-token runs."""
    is_image = np.asarray(input_ids) == image_token_id
    edges = np.flatnonzero(np.diff(is_image.astype(np.int8), prepend=0, append=0))
    runs = list(zip(edges[::2], edges[1::2], strict=True))
    if len(runs) != len(grids):
        raise ValueError(f"{len(runs)} runs of image tokens for {len(grids)} images")
    out = np.empty((3, len(is_image)), dtype=np.int64)
    at = pos = 0
    for (start, stop), (t, h, w) in zip(runs, grids, strict=True):
        out[:, at:start] = np.arange(start - at) + pos
        pos += start - at
        rows, cols = h // merge, w // merge
        if stop - start != t * rows * cols:
            raise ValueError(f"an image run of {stop - start} tokens for a grid of {t}x{h}x{w}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij")
        out[:, start:stop] = np.stack([tt, hh, ww]).reshape(3, -1) + pos
        pos += max(rows, cols)
        at = stop
    out[:, at:] = np.arange(len(is_image) - at) + pos
    return out


class QwenFamily(ProcessorFamily):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL, with the numbers of the processor given."""

    names = tuple(_NAMES.values())  # what batch["family"] says
    unit_name = "patches"  # what a vision unit is, in messages
    device_fields = ("image_grid_thw",)  # batch tensors model_fields hands to the model

    def __init__(self, processor: Any):
        super().__init__(processor)
        self.name = next(
            _NAMES[c.__name__] for c in type(processor).__mro__ if c.__name__ in _NAMES
        )
        ip = self.image_processor
        if not getattr(ip, "do_resize", True):
            raise ValueError(
                f"{type(ip).__name__} has do_resize=False: wdsvlm resizes as the processor "
                "does, so it needs do_resize=True"
            )
        self.patch_size = int(ip.patch_size)
        self.merge_size = int(ip.merge_size)
        self.temporal_patch_size = int(ip.temporal_patch_size)
        size = ip.size
        self.min_pixels = int(size["shortest_edge"])
        self.max_pixels = int(size["longest_edge"])
        self.resample = ip.resample
        self.backend = getattr(ip, "backend", "pil")
        self.image_token_id = int(processor.image_token_id)
        self.unit_size = self.patch_size

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """``(width, height)`` of the image as the processor resizes it."""
        h, w = smart_resize(
            height,
            width,
            self.patch_size * self.merge_size,
            self.min_pixels,
            self.max_pixels,
        )
        return w, h

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``(t, h, w)`` in patches: the image's row of ``image_grid_thw``."""
        w, h = self.resized(width, height)
        return 1, h // self.patch_size, w // self.patch_size

    def image_cost(self, width: int, height: int, alone: bool = True) -> int:
        """Patches of the image: its vision units."""
        t, h, w = self.grid(width, height)
        return t * h * w

    def image_token_ids(self, width: int, height: int, alone: bool = True) -> np.ndarray:
        n = self.image_cost(width, height) // self.merge_size**2
        return np.full(n, self.image_token_id, dtype=np.int64)

    def image_units(self, image: Any, out: Any) -> None:
        """Resize ``image`` (RGB, as displayed) as the processor does and write its patches,
        uint8, into ``out`` ``[patches, 3, P, P]`` in the processor's order."""
        import torch

        width, height = self.resized(*image.size)
        if self.backend == "torchvision":
            pixels = self._torchvision_resize(image, width, height)
        else:  # the PIL processors resize with Pillow: the same call, the same pixels
            resized = image.resize((width, height), resample=self.resample)
            pixels = torch.from_numpy(np.array(resized)).permute(2, 0, 1)
        p, m = self.patch_size, self.merge_size
        gh, gw = height // p, width // p
        patches = pixels.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        out.copy_(patches.reshape(gh * gw, 3, p, p))

    def _torchvision_resize(self, image: Any, width: int, height: int):
        """The processor's own torchvision resize (its class's base ``resize``, which the
        Qwen class wraps with ``smart_resize``)."""
        import torch
        from transformers.image_utils import SizeDict

        base = next(c for c in type(self.image_processor).__mro__ if c.__name__.endswith("Backend"))
        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()
        return base.resize(
            self.image_processor,
            pixels,
            SizeDict(height=height, width=width),
            resample=self.resample,
        )

    def batch_fields(self, rows: list[list[dict]], batch: dict) -> dict:
        """``image_grid_thw`` in image-token order, and ``position_ids`` ``[4, B, L]``: the
        batch's text positions, then each sample's own mRoPE positions (padding keeps its
        text positions on all rows)."""
        import torch

        positions = np.repeat(batch["position_ids"].numpy()[None], 4, axis=0)
        grids: list[tuple[int, int, int]] = []
        for r, row in enumerate(rows):
            at = 0
            for sample in row:
                n = len(sample["input_ids"])
                mine = [self.grid(w, h) for w, h in sample["__meta__"]["images"]]
                positions[1:, r, at : at + n] = mrope_positions(
                    sample["input_ids"], mine, self.image_token_id, self.merge_size
                )
                grids += mine
                at += n
        return {
            "image_grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
            "temporal_patch_size": self.temporal_patch_size,
            "position_ids": torch.from_numpy(positions),
        }

    @staticmethod
    def model_fields(batch: dict, units: Any, normalised: Any) -> dict:
        """``pixel_values`` ``[patches, 3 * T * P * P]``: each patch normalised
        (``normalised(units, out=...)``) and repeated over the temporal patch, as the
        processor does for an image; and ``image_grid_thw``. The patches are normalised
        straight into the first temporal slot and copied on: one pass over the output fewer
        than normalising then expanding."""
        import torch

        n, c, p, _ = units.shape
        t = batch["temporal_patch_size"]
        out = torch.empty((n, c, t, p, p), dtype=torch.float32, device=units.device)
        first = normalised(units, out=out[:, :, 0])
        if t > 1:
            out[:, :, 1:].copy_(first.unsqueeze(2).expand(n, c, t - 1, p, p))
        flat = out.view(n, c * t * p * p)
        return {"pixel_values": flat, "image_grid_thw": batch["image_grid_thw"]}
