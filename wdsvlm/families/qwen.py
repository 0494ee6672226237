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

from typing import Any

import numpy as np

from .. import compat
from ..format.videos import VideoInfo
from .hf_processor import ProcessorFamily
from .qwen_sizes import smart_resize
from .qwen_video import QwenVideo
from .video import NoVideoProcessor

_NAMES = {
    "Qwen2VLProcessor": "qwen2_vl",
    "Qwen2_5_VLProcessor": "qwen2_5_vl",
    "Qwen3VLProcessor": "qwen3_vl",
}


def mrope_positions(
    input_ids: np.ndarray,
    grids: list[tuple[int, int, int]],
    image_token_id: int,
    merge: int,
    videos: list[tuple[tuple[int, int, int], float]] = (),
    video_token_id: int | None = None,
) -> np.ndarray:
    """``[3, n]`` rotary positions (temporal, height, width) of one sample alone, as the
    model's ``get_rope_index`` gives them; ``grids``: each image's ``(t, h, w)`` in patches, in
    the order of the image-token runs; ``videos``: each video-token run's ``(t, h, w)`` and
    the step of its temporal position (Qwen2.5-VL: ``tokens_per_second`` x seconds per
    temporal patch, in float32 as the model computes it; 1 otherwise)."""
    ids = np.asarray(input_ids)
    kinds = np.where(ids == image_token_id, 1, 0)
    if video_token_id is not None:
        kinds = np.where(ids == video_token_id, 2, kinds)
    edges = np.flatnonzero(np.diff(kinds, prepend=0, append=0))
    runs = [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True) if kinds[a]]
    of_kind = {1: iter([(g, 1.0) for g in grids]), 2: iter(videos)}
    if len(runs) != len(grids) + len(videos):
        raise ValueError(
            f"{len(runs)} runs of vision tokens for {len(grids)} images and {len(videos)} "
            "video runs"
        )
    out = np.empty((3, len(ids)), dtype=np.int64)
    at = pos = 0
    for start, stop in runs:
        (t, h, w), step = next(of_kind[int(kinds[start])])
        out[:, at:start] = np.arange(start - at) + pos
        pos += start - at
        rows, cols = h // merge, w // merge
        if stop - start != t * rows * cols:
            raise ValueError(f"a vision run of {stop - start} tokens for a grid of {t}x{h}x{w}")
        times = (np.arange(t, dtype=np.float32) * np.float32(step)).astype(np.int64)
        tt, hh, ww = np.meshgrid(times, np.arange(rows), np.arange(cols), indexing="ij")
        out[:, start:stop] = np.stack([tt, hh, ww]).reshape(3, -1) + pos
        pos += max(rows, cols)
        at = stop
    out[:, at:] = np.arange(len(ids) - at) + pos
    return out


class QwenFamily(ProcessorFamily):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL, with the numbers of the processor given."""

    names = tuple(_NAMES.values())  # what batch["family"] says
    unit_name = "patches"  # what a vision unit is, in messages
    device_fields = ("image_grid_thw",)  # batch tensors model_fields hands to the model
    video_device_fields = ("video_grid_thw", "second_per_grid_ts")  # those of the videos
    # Qwen2.5-VL's vision_config.tokens_per_second as published (its config class defaults
    # to 4): the step of a video's temporal positions per second
    tokens_per_second = 2

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
        # An image in a document goes between the vision markers, as the chat template puts
        # it and as Qwen-VL was pretrained on interleaved text (Qwen3-VL's processor names them).
        self.image_wrap = (
            getattr(processor, "vision_start_token", "<|vision_start|>"),
            getattr(processor, "vision_end_token", "<|vision_end|>"),
        )
        try:  # its videos, where its video processor takes them
            self.video: QwenVideo | None = QwenVideo(processor, self.name)
        except NoVideoProcessor as e:
            self.video, self.no_video = None, str(e)

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

        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()
        return compat.torchvision_resize(self.image_processor, pixels, height, width)

    def batch_fields(self, rows: list[list[dict]], batch: dict) -> dict:
        """``image_grid_thw`` in image-token order, and ``position_ids`` ``[4, B, L]``: the
        batch's text positions, then each sample's own mRoPE positions (padding keeps its
        text positions on all rows)."""
        import torch

        positions = np.repeat(batch["position_ids"].numpy()[None], 4, axis=0)
        grids: list[tuple[int, int, int]] = []
        video_grids: list[tuple[int, int, int]] = []
        seconds: list[float] = []
        for r, row in enumerate(rows):
            at = 0
            for sample in row:
                n = len(sample["input_ids"])
                mine = [self.grid(w, h) for w, h in sample["__meta__"]["images"]]
                runs = []
                for meta in sample["__meta__"].get("videos", ()):
                    info = VideoInfo.from_dict(meta)
                    runs += self.video.runs(info, self.tokens_per_second)
                    video_grids.append(self.video.grid(info))
                    seconds.append(self.video.second_per_grid(info))
                positions[1:, r, at : at + n] = mrope_positions(
                    sample["input_ids"],
                    mine,
                    self.image_token_id,
                    self.merge_size,
                    videos=runs,
                    video_token_id=None if self.video is None else self.video.video_token_id,
                )
                grids += mine
                at += n
        out = {
            "image_grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
            "temporal_patch_size": self.temporal_patch_size,
            "position_ids": torch.from_numpy(positions),
        }
        if self.video is not None:
            out["video_grid_thw"] = torch.tensor(video_grids, dtype=torch.long).reshape(-1, 3)
            if self.name == "qwen2_5_vl":
                out["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
        return out

    @staticmethod
    def video_model_fields(batch: dict, videos: Any, normalised: Any, fields: Any = None) -> dict:
        """``pixel_values_videos`` ``[patches, 3 * T * P * P]`` from the batch's uint8 video
        units ``[patches, T, 3, P, P]`` (each frame's patch normalised), ``video_grid_thw``
        and, for Qwen2.5-VL, ``second_per_grid_ts``."""
        n, t, c, p, _ = videos.shape
        flat = normalised(videos.reshape(n * t, c, p, p)).reshape(n, t, c, p, p)
        out = {
            "pixel_values_videos": flat.transpose(1, 2).reshape(n, c * t * p * p),
            "video_grid_thw": batch["video_grid_thw"],
        }
        if "second_per_grid_ts" in batch:
            out["second_per_grid_ts"] = batch["second_per_grid_ts"]
        return out

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
