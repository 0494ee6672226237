"""LLaVA-OneVision: anyres crops, unpadded features with a newline per row, one view per image
of several.

The image processor (``LlavaOnevisionImageProcessorPil``, or the torchvision-backed
``LlavaOnevisionImageProcessor``, whose own resize and padding are called) treats an image by
whether it is its sample's only one:

- **Alone** (anyres): the resolution of ``image_grid_pinpoints`` that keeps the most of the
  image and wastes the least (transformers' ``select_best_resolution``) is picked; the image is
  resized into it with its aspect ratio kept, centred on black (uint8 0) and cut into
  ``S x S`` crops, row by row, after a first view of the whole image squeezed to ``S x S``.
  Its tokens: the first view's ``num_image_tokens``, plus the crops' features with the black
  margin taken off again (``unpad``), shrunk when they are more than 1.1 times
  ``anyres_max_N``'s N views, plus a newline token per row of them.
- **One of several**: the image is centred on a square of the image mean's colour, resized to
  ``S x S``, and is one view: ``num_image_tokens`` and one newline.

(Both minus one token with ``vision_feature_select_strategy="default"``, which drops the CLS
token.) The token counts follow the processor's ``_get_number_of_features`` expression by
expression, so that floats round as they do there. Every resize is Pillow's with the
processor's resample (its numpy round trips are lossless on uint8); a crop already ``S x S`` is
not resampled again (Pillow copies it). The crops ship as uint8 ``[crops, 3, S, S]``, each
image's first view first; the model takes them flattened (4-D ``pixel_values``) with
``image_sizes`` ``[images, 2]`` (height, width) and ``batch_num_images`` (images per packed
sample), from which it finds each image's crops and whether it was alone.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import compat
from ..format.images import open_image
from ..format.videos import VideoInfo
from .base import Edit, decode_each
from .hf_processor import ProcessorFamily
from .video import NoVideoProcessor, ProcessorVideo


class LlavaOnevisionFamily(ProcessorFamily):
    """Crops, token ids and image sizes for a ``LlavaOnevisionProcessor``."""

    names = ("llava_onevision",)  # what batch["family"] says
    name = "llava_onevision"
    unit_name = "crops"  # what a vision unit is, in messages
    device_fields = ("image_sizes", "batch_num_images")  # batch tensors model_fields hands on

    def __init__(self, processor: Any):
        super().__init__(processor)
        ip = self.image_processor
        kind = type(ip).__name__
        self.backend = getattr(ip, "backend", "pil")
        side, width = ip.size["height"], ip.size["width"]
        if not side or width != side:
            raise ValueError(f"{kind} has size {ip.size}: wdsvlm needs a square height and width")
        crop = getattr(ip, "crop_size", None)
        if (crop and crop["height"] != side) or getattr(ip, "do_center_crop", None):
            raise ValueError(f"{kind} crops (crop_size {crop}): wdsvlm needs crops of its size")
        if not ip.do_resize:
            raise ValueError(f"{kind} has do_resize=False: wdsvlm needs do_resize=True")
        self.unit_size = int(side)
        self.pinpoints = [tuple(map(int, p)) for p in ip.image_grid_pinpoints]
        if any(h % side or w % side for h, w in self.pinpoints):
            raise ValueError(
                f"{kind}'s image_grid_pinpoints {self.pinpoints} are not all multiples of its "
                f"size {side}: wdsvlm needs whole crops"
            )
        self.resample = ip.resample
        self.background = tuple(int(x * 255) for x in ip.image_mean)  # the processor's square
        self.view_tokens = int(processor.num_image_tokens)
        self.drop_cls = processor.vision_feature_select_strategy == "default"
        aspect = processor.vision_aspect_ratio
        if not (aspect.startswith("anyres_max_") and aspect[len("anyres_max_") :].isdigit()):
            raise ValueError(f"vision_aspect_ratio {aspect!r}: wdsvlm knows anyres_max_N")
        self.max_views = int(aspect[len("anyres_max_") :])
        self.image_token_id = int(processor.image_token_id)
        try:  # its videos, where its video processor takes them
            self.video: LlavaOnevisionVideo | None = LlavaOnevisionVideo(processor)
        except NoVideoProcessor as e:
            self.video, self.no_video = None, str(e)

    def best_resolution(self, width: int, height: int) -> tuple[int, int]:
        """``(height, width)`` of the pinpoint an image alone is resized into."""
        from transformers.image_processing_utils import select_best_resolution

        return select_best_resolution((height, width), self.pinpoints)

    def image_cost(self, width: int, height: int, alone: bool = True) -> int:
        """Crops: the first view and the best resolution's crops, alone; else one view."""
        if not alone:
            return 1
        h, w = self.best_resolution(width, height)
        return 1 + (h // self.unit_size) * (w // self.unit_size)

    def image_token_ids(self, width: int, height: int, alone: bool = True) -> np.ndarray:
        n = self._features(width, height) if alone else self.view_tokens + 1
        return np.full(n - self.drop_cls, self.image_token_id, dtype=np.int64)

    def _features(self, width: int, height: int) -> int:
        """Features of an image alone, as the processor counts them."""
        best_h, best_w = self.best_resolution(width, height)
        side = int(math.sqrt(self.view_tokens))  # features across a view
        rows, cols = side * (best_h // self.unit_size), side * (best_w // self.unit_size)
        if width / height > cols / rows:  # black above and below: unpad rows
            kept = int(round(height * (cols / width), 7))
            rows -= (rows - kept) // 2 * 2
        else:
            kept = int(round(width * (rows / height), 7))
            cols -= (cols - kept) // 2 * 2
        unpadded, newlines = rows * cols, rows
        ratio = math.sqrt(rows * cols / (self.max_views * side**2))
        if ratio > 1.1:  # the model shrinks the features to about max_views views
            unpadded = int(rows // ratio) * int(cols // ratio)
            newlines = int(rows // ratio)
        return unpadded + newlines + self.view_tokens

    def decode(self, sample: dict, out: Any, edit: Edit | None = None) -> None:
        """The sample's images as crops, one image after another."""

        alone = len(sample["__meta__"]["images"]) == 1

        def fill(data: bytes, size: Any, part: Any, one: Any) -> None:
            image = open_image(data, size)
            self.image_units(image if one is None else one(image), part, alone)

        decode_each(sample, out, self.image_cost, fill, edit)

    def image_units(self, image: Any, out: Any, alone: bool = True) -> None:
        """Write the crops of ``image`` (PIL, RGB, as displayed), uint8, into ``out``
        ``[crops, 3, S, S]`` in the processor's order."""
        import torch
        from PIL import Image

        s = self.unit_size
        width, height = image.size
        if self.backend == "torchvision":
            out.copy_(self._torchvision_units(image, alone))
            return
        if not alone:
            side = max(width, height)
            square = Image.new("RGB", (side, side), self.background)
            square.paste(image, ((side - width) // 2, (side - height) // 2))
            out[0] = torch.from_numpy(np.array(square.resize((s, s), self.resample))).permute(
                2, 0, 1
            )
            return
        best_h, best_w = self.best_resolution(width, height)
        if width * best_h > height * best_w:  # the width fills the pinpoint
            new_w, new_h = best_w, min(math.ceil(height * (best_w / width)), best_h)
        else:
            new_w, new_h = min(math.ceil(width * (best_h / height)), best_w), best_h
        canvas = np.zeros((best_h, best_w, 3), dtype=np.uint8)
        top, left = (best_h - new_h) // 2, (best_w - new_w) // 2
        canvas[top : top + new_h, left : left + new_w] = image.resize((new_w, new_h), self.resample)
        rows, cols = best_h // s, best_w // s
        crops = torch.from_numpy(canvas).view(rows, s, cols, s, 3).permute(0, 2, 4, 1, 3)
        out[1:].view(rows, cols, 3, s, s).copy_(crops)
        out[0] = torch.from_numpy(np.array(image.resize((s, s), self.resample))).permute(2, 0, 1)

    def _torchvision_units(self, image: Any, alone: bool):
        """The crops as the torchvision-backed processor makes them, with its own ``resize``
        and padding: alone, the image resized into its pinpoint (aspect ratio kept), centred
        on black and cut, after the whole image resized to ``S x S``; one of several, centred
        on a square of the mean's colour. Every view is then resized to ``S x S`` once more,
        as the processor resizes all of them together."""
        import torch
        from torchvision.transforms.v2 import functional as tvf

        ip, s = self.image_processor, self.unit_size

        def resize(pixels, height, width):
            return compat.torchvision_resize(ip, pixels, height, width)

        pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).contiguous()
        if not alone:
            views = ip.pad_to_square(pixels, background_color=self.background)[None]
        else:
            width, height = image.size
            best_h, best_w = self.best_resolution(width, height)
            if width * best_h > height * best_w:  # the width fills the pinpoint
                new_w, new_h = best_w, min(math.ceil(height * (best_w / width)), best_h)
            else:
                new_w, new_h = min(math.ceil(width * (best_h / height)), best_w), best_h
            resized = resize(pixels, new_h, new_w)
            left, top = (best_w - new_w) // 2, (best_h - new_h) // 2
            padded = tvf.pad(resized, [left, top, best_w - new_w - left, best_h - new_h - top])
            rows, cols = best_h // s, best_w // s
            crops = padded.view(3, rows, s, cols, s).permute(1, 3, 0, 2, 4).reshape(-1, 3, s, s)
            views = torch.cat([resize(pixels, s, s)[None], crops])
        return resize(views, s, s)

    def batch_fields(self, rows: list[list[dict]], batch: dict) -> dict:
        """``image_sizes`` ``[images, 2]`` (height, width) and ``batch_num_images`` (images
        per sample that has any), in the order of the batch's crops."""
        import torch

        sizes = [[h, w] for row in rows for sample in row for w, h in sample["__meta__"]["images"]]
        counts = [n for row in rows for s in row if (n := len(s["__meta__"]["images"]))]
        return {
            "image_sizes": torch.tensor(sizes, dtype=torch.long).reshape(-1, 2),
            "batch_num_images": torch.tensor(counts, dtype=torch.long),
        }

    @staticmethod
    def model_fields(batch: dict, units: Any, normalised: Any) -> dict:
        """``pixel_values`` ``[crops, 3, S, S]`` normalised, ``image_sizes`` and
        ``batch_num_images``."""
        return {
            "pixel_values": normalised(units),
            "image_sizes": batch["image_sizes"],
            "batch_num_images": batch["batch_num_images"],
        }

    @staticmethod
    def video_model_fields(batch: dict, videos: Any, normalised: Any, fields: Any = None) -> dict:
        """``pixel_values_videos`` ``[videos, frames, 3, S, S]`` normalised: the model stacks
        a batch's videos, so each must have the same number of frames."""
        counts = batch["video_units"].tolist()
        if len(set(counts)) > 1:
            raise ValueError(
                f"LLaVA-OneVision takes a batch's videos stacked, so each needs the same number "
                f"of frames; this batch has {counts}: set the video processor's num_frames "
                "(with do_sample_frames=True)"
            )
        frames = normalised(videos)
        return {"pixel_values_videos": frames.reshape(len(counts), counts[0], *frames.shape[1:])}


class LlavaOnevisionVideo(ProcessorVideo):
    """A video as ``LlavaOnevisionVideoProcessor`` makes it: the frames it samples, each
    resized to its ``size`` (no aspect kept, no crop) and one unit ``[3, S, S]``; the model
    pools each frame's features 2x2 and adds one newline after the video, so its tokens are
    ``frames x ceil(side / 2) ** 2 + 1`` (``side`` x ``side`` features a view)."""

    def __init__(self, processor: Any):
        super().__init__(processor)
        vp = self.vp
        kind = type(vp).__name__
        height, width = vp.size.get("height"), vp.size.get("width")
        if not height or not width or not vp.do_resize:
            raise NoVideoProcessor(
                f"{kind} has size {vp.size}: wdsvlm needs do_resize to a height and width"
            )
        if getattr(vp, "do_center_crop", None):
            raise NoVideoProcessor(f"{kind} crops its frames: wdsvlm takes them resized whole")
        if not self.samples or not getattr(vp, "num_frames", None):
            raise NoVideoProcessor(
                f"{kind} samples no fixed number of frames (do_sample_frames="
                f"{self.samples}, num_frames={getattr(vp, 'num_frames', None)}): LLaVA-OneVision "
                "stacks a batch's videos, so wdsvlm takes its videos only with num_frames set"
            )
        self.height, self.width = int(height), int(width)
        self.unit_shape = (3, self.height, self.width)
        side = int(math.sqrt(processor.num_image_tokens))
        self.per_frame = math.ceil(side / 2) ** 2

    def cost(self, info: VideoInfo) -> int:
        """Frames sampled: a video's vision units."""
        return len(self.frames(info))

    def token_ids(self, info: VideoInfo) -> np.ndarray:
        return np.full(self.cost(info) * self.per_frame + 1, self.video_token_id, dtype=np.int64)

    def units(self, frames: np.ndarray, info: VideoInfo, out: Any) -> None:
        """The sampled ``frames`` (``[n, H, W, 3]`` uint8) resized by the processor's own
        resize into ``out`` ``[n, 3, S, S]`` uint8."""
        out.copy_(self.resize(frames, self.height, self.width))
