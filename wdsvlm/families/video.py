"""What every family's video side shares: the frames the processor's video processor samples
of a video, planned from what the index records of it (``format.videos.VideoInfo``), its
resize, and the facts a resume checks. Each family adds its sizes, units and tokens
(``qwen_video.QwenVideo``, ``llava_onevision.LlavaOnevisionVideo``).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .. import compat
from ..format.videos import VideoInfo

# (frames, fps, width, height) of the videos whose tokens stand for a processor's settings
_PROBE_VIDEOS = [(12, 24.0, 64, 48), (90, 30000 / 1001, 640, 360), (1800, 60.0, 1280, 720)]


def video_metadata(info: VideoInfo, frames_indices: list[int] | None = None) -> Any:
    """transformers' ``VideoMetadata`` of a video, from what the index records of it (as
    ``load_video`` would give it; with the indices of the frames sampled, as a processor
    keeps it after sampling)."""
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(
        total_num_frames=info.frames,
        fps=info.fps,
        width=info.width,
        height=info.height,
        duration=info.duration,
        video_backend="pyav",
        frames_indices=frames_indices,
    )


class NoVideoProcessor(ValueError):
    """The processor has no video processor that can take a video."""


class ProcessorVideo:
    """The video side of one processor. A family's subclass gives ``cost(info)`` (vision
    units), ``token_ids(info)``, ``units(frames, info, out)`` and ``unit_shape``; one whose
    processor writes a video's prompt into the text before tokenizing it sets ``in_text`` and
    gives ``prompt(info)``."""

    unit_shape: tuple[int, ...]
    in_text = False  # the video's prompt goes into the text, tokenized with it
    with_images = True  # a sample may hold videos and images

    def __init__(self, processor: Any, needs: tuple[str, ...] = ()):
        vp = getattr(processor, "video_processor", None)
        if vp is None or not all(hasattr(vp, n) for n in ("sample_frames", *needs)):
            raise NoVideoProcessor(
                f"{type(processor).__name__} has no video processor that takes videos "
                f"({type(vp).__name__}); transformers' video processors need torchvision"
            )
        self.vp = vp
        self.video_token: str | None = getattr(processor, "video_token", None)
        # SmolVLM's processor replaces its video marker in the text: it need be no token (-1)
        found = getattr(processor, "video_token_id", None)
        if found is None and self.video_token is not None:
            found = processor.tokenizer.convert_tokens_to_ids(self.video_token)
        if found is None and self.video_token is None:
            raise NoVideoProcessor(f"{type(processor).__name__} has no video token")
        unknown = getattr(processor.tokenizer, "unk_token_id", None)
        self.video_token_id = -1 if found is None or found == unknown else int(found)
        self.sampling = {
            k: getattr(vp, k, None)
            for k in vp.valid_kwargs.__annotations__
            if k not in compat.video_settings_not_sampling()  # as its preprocess does
        }
        self.samples = bool(getattr(vp, "do_sample_frames", False))
        self._frames: dict[VideoInfo, np.ndarray] = {}

    def cost(self, info: VideoInfo) -> int:
        raise NotImplementedError

    def token_ids(self, info: VideoInfo) -> np.ndarray:
        raise NotImplementedError

    def fingerprint_facts(self) -> list:
        """The video processor's settings and what it makes of a few videos: frames sampled,
        units and token ids (checked when a loader resumes on a dataset with videos)."""
        facts: list = [json.dumps(self.vp.to_dict(), sort_keys=True, default=str)]
        for frames, fps, width, height in _PROBE_VIDEOS:
            info = VideoInfo("mp4", frames, fps, frames / fps, width, height, 0, "h264", ((0, 0),))
            try:
                facts.append(
                    [self.frames(info).tolist(), self.cost(info), self.token_ids(info).tolist()]
                )
            except ValueError as e:  # a video this processor does not take: that is a fact too
                facts.append(str(e))
        return facts

    def frames(self, info: VideoInfo) -> np.ndarray:
        """The indices of the frames the processor samples of the video (all of them where it
        does not sample); asked for again by every step of a sample, so kept for the last
        few thousand videos."""
        found = self._frames.get(info)
        if found is None:
            if len(self._frames) >= 4096:
                self._frames.clear()
            found = self._frames[info] = self._sample(info)
        return found

    def _sample(self, info: VideoInfo) -> np.ndarray:
        if not self.samples:
            return np.arange(info.frames, dtype=np.int64)
        indices = self.vp.sample_frames(metadata=video_metadata(info), **self.sampling)
        return np.asarray(indices, dtype=np.int64)

    def resize(self, frames: np.ndarray, height: int, width: int) -> Any:
        """``frames`` (``[n, H, W, 3]`` uint8) resized to ``height x width`` by the video
        processor's own torchvision resize: uint8 ``[n, 3, height, width]``."""
        import torch

        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        return compat.torchvision_resize(self.vp, video[None].contiguous(), height, width)[0]
