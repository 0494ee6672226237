"""Video in the Qwen2-VL, Qwen2.5-VL and Qwen3-VL family, as the processor's video processor
makes it, planned from what the index records of a video (``format.videos.VideoInfo``).

- **Frames**: the video processor's own ``sample_frames`` on the video's metadata, with its
  settings (``fps`` or ``num_frames``, ``min_frames``, ``max_frames``, the multiple of
  ``temporal_patch_size``), as ``preprocess`` calls it; all frames where it does not sample.
- **Size**: each frame resized as its ``resize`` resizes them: Qwen2/2.5-VL bound a frame's
  pixels, Qwen3-VL the video's (frames x pixels); ``cap_pixels_per_frame`` as set.
- **Pixels**: the frames resized by the processor's own torchvision resize, cut into patches in
  the processor's order (temporal patches of ``temporal_patch_size`` frames, the last frame
  repeated to fill the last), shipped uint8 ``[patches, T, 3, P, P]``; normalised per channel
  on the device, that is the processor's ``pixel_values_videos`` bit for bit.
- **Text**: Qwen2/2.5-VL put ``patches / merge**2`` video tokens in place of the template's one;
  Qwen3-VL puts, per temporal patch, ``<t seconds>`` (the mean time of its frames, one decimal)
  then that patch's tokens between vision markers.
- **Time**: Qwen2.5-VL's ``second_per_grid_ts`` is ``temporal_patch_size`` over the sampled
  frame rate, kept fractional; its rotary positions step by ``tokens_per_second`` times that.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..format.videos import VideoInfo
from .qwen_sizes import smart_resize, smart_resize_video
from .video import ProcessorVideo


class QwenVideo(ProcessorVideo):
    """The video side of one Qwen processor: frames, sizes, tokens and times of a video."""

    def __init__(self, processor: Any, name: str):
        super().__init__(processor, needs=("patchify",))
        vp = self.vp
        self.name = name
        self.tokenizer = processor.tokenizer
        self.patch_size = int(vp.patch_size)
        self.merge_size = int(vp.merge_size)
        self.temporal = int(vp.temporal_patch_size)
        self.factor = self.patch_size * self.merge_size
        self.min_pixels = int(vp.size["shortest_edge"])
        self.max_pixels = int(vp.size["longest_edge"])
        self.cap = bool(getattr(vp, "cap_pixels_per_frame", False))
        self.max_video_tokens = int(getattr(vp, "max_video_tokens", 0) or 0)
        self.unit_shape = (self.temporal, 3, self.patch_size, self.patch_size)  # of a unit
        if name == "qwen3_vl":
            self.start_id = int(processor.vision_start_token_id)
            self.end_id = int(processor.vision_end_token_id)

    def resized(self, info: VideoInfo, frames: int) -> tuple[int, int]:
        """``(width, height)`` every frame of the video is resized to, for ``frames`` frames."""
        height, width = info.height, info.width
        if self.name == "qwen3_vl":
            max_pixels = self.max_pixels
            if self.cap:
                cap = self.max_video_tokens * self.factor * self.factor
                per_frame = max(min(cap, self.max_pixels // frames), int(self.min_pixels * 1.05))
                max_pixels = per_frame * frames
            h, w = smart_resize_video(
                frames, height, width, self.temporal, self.factor, self.min_pixels, max_pixels
            )
            return w, h
        max_pixels = self.max_pixels
        if self.cap:
            total = int(self.max_video_tokens * self.factor * self.factor * 0.9)
            max_pixels = max(
                min(max_pixels, total * self.temporal // frames), int(self.min_pixels * 1.05)
            )
        h, w = smart_resize(height, width, self.factor, self.min_pixels, max_pixels)
        return w, h

    def grid(self, info: VideoInfo) -> tuple[int, int, int]:
        """``(t, h, w)`` in patches: the video's row of ``video_grid_thw``."""
        n = len(self.frames(info))
        w, h = self.resized(info, n)
        return -(-n // self.temporal), h // self.patch_size, w // self.patch_size

    def cost(self, info: VideoInfo) -> int:
        """Patches of the video: its vision units."""
        t, h, w = self.grid(info)
        return t * h * w

    def second_per_grid(self, info: VideoInfo) -> float:
        """Seconds a temporal patch spans: ``temporal_patch_size`` over the sampled frame rate
        (transformers' ``VideoMetadata.sampled_fps``)."""
        sampled_fps = len(self.frames(info)) / info.frames * info.fps
        return self.temporal / sampled_fps

    def timestamps(self, info: VideoInfo) -> list[float]:
        """Qwen3-VL's time of each temporal patch: the mean of its first and last frame's."""
        indices = [int(i) for i in self.frames(info)]
        if len(indices) % self.temporal:
            indices += [indices[-1]] * (self.temporal - len(indices) % self.temporal)
        times = [i / info.fps for i in indices]
        return [
            (times[i] + times[i + self.temporal - 1]) / 2
            for i in range(0, len(times), self.temporal)
        ]

    def runs(
        self, info: VideoInfo, tokens_per_second: float
    ) -> list[tuple[tuple[int, int, int], float]]:
        """The video's runs of video tokens, each its ``(t, h, w)`` and the step of its
        temporal position, for ``mrope_positions``: one run for Qwen2/2.5-VL (Qwen2.5-VL steps
        by ``tokens_per_second`` of the model's vision config x seconds per temporal patch,
        in float32 as the model computes it), one per temporal patch for Qwen3-VL (its
        timestamps in the text stand between them)."""
        t, h, w = self.grid(info)
        if self.name == "qwen3_vl":
            return [((1, h, w), 1.0)] * t
        if self.name == "qwen2_5_vl":
            step = np.float32(tokens_per_second) * np.float32(self.second_per_grid(info))
            return [((t, h, w), float(step))]
        return [((t, h, w), 1.0)]

    def token_ids(self, info: VideoInfo) -> np.ndarray:
        """The ids that stand for the video in place of the template's one video token."""
        t, h, w = self.grid(info)
        per_patch = h * w // self.merge_size**2
        if self.name != "qwen3_vl":
            return np.full(t * per_patch, self.video_token_id, dtype=np.int64)
        out: list[int] = []
        for seconds in self.timestamps(info):
            out += self.tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
            out += [self.start_id] + [self.video_token_id] * per_patch + [self.end_id]
        return np.asarray(out, dtype=np.int64)

    def units(self, frames: np.ndarray, info: VideoInfo, out: Any) -> None:
        """Resize ``frames`` (``[n, H, W, 3]`` uint8, the sampled ones) as the processor does
        and write their patches, uint8, into ``out`` ``[patches, T, 3, P, P]`` in the
        processor's order."""
        import torch

        n = len(frames)
        width, height = self.resized(info, n)
        pixels = self.resize(frames, height, width)
        if pad := -n % self.temporal:
            pixels = torch.cat([pixels, pixels[-1:].expand(pad, -1, -1, -1)])
        p, m, t = self.patch_size, self.merge_size, self.temporal
        gt, gh, gw = pixels.shape[0] // t, height // p, width // p
        patches = pixels.reshape(gt, t, 3, gh // m, m, p, gw // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 1, 2, 5, 8)
        out.copy_(patches.reshape(gt * gh * gw, t, 3, p, p))
