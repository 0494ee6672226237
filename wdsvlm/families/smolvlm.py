"""SmolVLM / Idefics3: image costs from the size alone, and uint8 tiles equal to the processor's.

The packer must know, before any image is decoded, how many tokens and vision tiles ("units")
each image costs; the decoder must then produce pixels that, once normalised on the device by
a per-channel lookup table, equal the processor's own ``pixel_values`` bit for bit. So this
module replays the image processor's geometry (the same float expressions, hence the same
rounding; its own ``get_number_of_image_patches`` rounds differently and disagrees with its
output when ``size`` is no multiple of the tile) and its resizes, stopping before
rescale/normalise, which are per-value maps:

1. ``size["longest_edge"]``: the long side is scaled to it, up or down (a 1x1 image becomes
   L x L); the short side is truncated and rounded up to even; both are then capped at the
   module's ``MAX_IMAGE_SIZE`` (4096).
2. With ``do_image_splitting``: the image is resized so both sides are multiples of the tile
   side S = ``max_image_size["longest_edge"]`` (the long side rounded up, the short side
   scaled with it, truncated, rounded up). If it is larger than one tile it is cut into
   ``rows x cols`` tiles, row by row, and the global image (the step-2 image resized to S x S)
   comes LAST. Without splitting, the step-1 image is resized to S x S: one unit.

Every resize is on uint8 with the processor's ``resample`` (LANCZOS): Pillow's, as the PIL
backend does (its numpy round trips between resizes are lossless); with the torchvision
backend (transformers' default for these processors once torchvision >= 0.27), the image
processor's own ``resize`` on a uint8 tensor (not tested here: no torchvision). Every tile is
S x S, so the processor never pads a tile: ``pixel_attention_mask`` is all ones, which is
also what the model assumes when it is not given.

The model takes ``pixel_values`` as [batch, images, 3, S, S], drops all-zero images as
padding, and scatters the tiles' features into the ``<image>`` tokens of the flattened
``input_ids`` in order: a packed batch passes its tiles as one [1, N, 3, S, S] "sample". (A
real tile whose every value normalises to exactly 0.0 would be dropped too; with the usual
mean = std = 0.5 no uint8 value normalises to 0.)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import compat
from ..format.videos import VideoInfo
from .hf_processor import ProcessorFamily
from .video import NoVideoProcessor, ProcessorVideo, video_metadata

if TYPE_CHECKING:
    import torch
    from PIL import Image


class SmolVLMFamily(ProcessorFamily):
    """Image costs, token ids and uint8 tiles for a SmolVLMProcessor or Idefics3Processor."""

    names = ("smolvlm", "idefics3")  # what batch["family"] says
    unit_name = "tiles"  # what a vision unit is, in messages
    device_fields = ()  # batch tensors model_fields hands to the model
    video_device_fields = ("vision_order",)  # those video_model_fields uses

    def __init__(self, processor: Any):
        from PIL import Image

        ip = processor.image_processor
        idefics3 = any(c.__name__ == "Idefics3Processor" for c in type(processor).__mro__)
        self.name = "idefics3" if idefics3 else "smolvlm"
        if not hasattr(processor, "replace_image_token"):
            raise TypeError(
                f"{type(processor).__name__} has no replace_image_token(): SmolVLMFamily needs a "
                "SmolVLMProcessor or Idefics3Processor from transformers >= 5."
            )
        super().__init__(processor)
        self.unit_size: int = int(ip.max_image_size["longest_edge"])
        self.longest_edge: int | None = int(ip.size["longest_edge"]) if ip.do_resize else None
        self.split: bool = bool(ip.do_image_splitting)
        self.max_side: int = compat.smolvlm_max_image_size(ip)  # in its module
        # The torchvision backend resamples in torch (see _resize).
        self.torch_backend = getattr(ip, "backend", "pil") == "torchvision"
        self.resample = Image.Resampling(ip.resample if ip.resample is not None else Image.BILINEAR)
        self._ids: dict[tuple[int, int], np.ndarray] = {}
        self.video_chat_template = None
        try:  # its videos, where its video processor takes them
            self.video: SmolVLMVideo | None = SmolVLMVideo(processor)
            # what its apply_chat_template renders a conversation with a video by, when no
            # template is asked for
            self.video_chat_template = compat.smolvlm_video_template()
        except (NoVideoProcessor, compat.UnsupportedVersionError) as e:  # images still work
            self.video, self.no_video = None, str(e)

    # Geometry: the processor's expressions, in its order, so floats truncate the same way.

    def _resized(self, width: int, height: int) -> tuple[int, int]:
        """Step 1: the size after scaling the long side to ``size["longest_edge"]``."""
        if self.longest_edge is None:
            return width, height
        aspect = width / height
        if width >= height:
            width = self.longest_edge
            height = int(width / aspect)
            height += height % 2
        else:
            height = self.longest_edge
            width = int(height * aspect)
            width += width % 2
        width, height = max(width, 1), max(height, 1)
        aspect = width / height
        if width >= height and width > self.max_side:
            width = self.max_side
            height = int(width / aspect)
        elif height > width and height > self.max_side:
            height = self.max_side
            width = int(height * aspect)
        return max(width, 1), max(height, 1)

    def _grid(self, width: int, height: int) -> tuple[int, int]:
        """Step 2: the size resized to whole tiles (``resize_for_vision_encoder``)."""
        s = self.unit_size
        aspect = width / height
        if width >= height:
            width = math.ceil(width / s) * s
            height = math.ceil(int(width / aspect) / s) * s
        else:
            height = math.ceil(height / s) * s
            width = math.ceil(int(height * aspect) / s) * s
        return width, height

    def _rows_cols(self, width: int, height: int) -> tuple[int, int]:
        """Tile rows and columns; (0, 0) for an image that stays one tile."""
        if not self.split:
            return 0, 0
        w, h = self._grid(*self._resized(width, height))
        if w <= self.unit_size and h <= self.unit_size:
            return 0, 0
        return h // self.unit_size, w // self.unit_size

    def image_cost(self, width: int, height: int, alone: bool = True) -> int:
        """Vision units (S x S tiles) of a ``width x height`` image: rows * cols + global, or 1."""
        rows, cols = self._rows_cols(width, height)
        return rows * cols + 1

    def image_token_ids(self, width: int, height: int, alone: bool = True) -> np.ndarray:
        """The ids replacing one placeholder token: the processor's expansion, tokenized.

        The expansion (the processor's own ``replace_image_token``) starts and ends with
        ``<fake_token_around_image>``, a special token, so tokenizing it alone equals tokenizing
        it inside the text (the tests check this). Cached per grid; the array is read-only.
        """
        key = self._rows_cols(width, height)
        ids = self._ids.get(key)
        if ids is None:
            rows, cols = key
            text = self.processor.replace_image_token({"rows": [[rows]], "cols": [[cols]]}, 0)
            ids = np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], np.int64)
            ids.flags.writeable = False
            self._ids[key] = ids
        return ids

    def image_units(self, image: Image.Image, out: torch.Tensor) -> None:
        """Fill ``out`` (uint8 [cost, 3, S, S]) with the image's tiles in the processor's order."""
        import torch

        s = self.unit_size
        rows, cols = self._rows_cols(*image.size)
        if out.shape != (rows * cols + 1, 3, s, s) or out.dtype != torch.uint8:
            raise ValueError(
                f"image_units: out is {out.dtype} {tuple(out.shape)} for a {image.size} image; "
                f"expected uint8 {(rows * cols + 1, 3, s, s)} (image_cost of the displayed size)."
            )
        # A PIL image on the PIL backend (its numpy round trips between resizes are lossless),
        # a uint8 [3, H, W] tensor on the torchvision one.
        x: Any = torch.from_numpy(np.array(image)).permute(2, 0, 1) if self.torch_backend else image
        size = self._resized(*image.size)
        x = self._resize(x, size)
        if not self.split:
            out[0] = self._chw(self._resize(x, (s, s)))
            return
        x = self._resize(x, self._grid(*size))
        if rows:
            # [3, rows*S, cols*S] -> [rows, cols, 3, S, S]: row-major tiles, as the processor cuts.
            tiles = self._chw(x).reshape(3, rows, s, cols, s).permute(1, 3, 0, 2, 4)
            out[:-1].view(rows, cols, 3, s, s).copy_(tiles)
            x = self._resize(x, (s, s))
        out[-1] = self._chw(x)

    def _resize(self, x: Any, size: tuple[int, int]) -> Any:
        """Resize to ``(width, height)`` as the image processor does."""
        if not self.torch_backend:
            return x.resize(size, self.resample)
        from transformers.image_utils import SizeDict

        ip = self.processor.image_processor
        return ip.resize(x, SizeDict(height=size[1], width=size[0]), resample=ip.resample)

    def _chw(self, x: Any) -> torch.Tensor:
        import torch

        return x if self.torch_backend else torch.from_numpy(np.array(x)).permute(2, 0, 1)

    def batch_fields(self, rows: list[list[dict]], batch: dict) -> dict:
        """Every tile is S x S, so there is no padding and no pixel_attention_mask. Where the
        batch has videos, ``vision_order``: the rows of [tiles, frames] in the order of the
        batch's image tokens (each sample's images and videos by where their tokens start)."""
        import torch

        if self.video is None or "video_units" not in batch:
            return {}
        samples = [s for row in rows for s in row]
        tiles = sum(sum(s["image_tiles"]) for s in samples)
        order: list[int] = []
        image = frame = 0
        for s in samples:
            media = [
                (at, "image", n) for at, n in zip(s["image_at"], s["image_tiles"], strict=True)
            ]
            units = s.get("video_units", ())
            media += [(at, "video", n) for at, n in zip(s.get("video_at", ()), units, strict=True)]
            for _, kind, n in sorted(media):
                if kind == "image":
                    order += range(image, image + n)
                    image += n
                else:
                    order += range(tiles + frame, tiles + frame + n)
                    frame += n
        return {"vision_order": torch.tensor(order, dtype=torch.long)}

    @staticmethod
    def model_fields(batch: dict, units: torch.Tensor, normalised: Any) -> dict:
        """Forward kwargs: the batch's tiles, normalised (``normalised(units)``), as one
        [1, N, 3, S, S] image list (see module doc)."""
        return {"pixel_values": normalised(units)[None]} if units.shape[0] else {}

    @staticmethod
    def video_model_fields(
        batch: dict, videos: torch.Tensor, normalised: Any, fields: dict
    ) -> dict:
        """The videos' frames are images to the model, in the text's order: ``pixel_values``
        [1, N, 3, S, S] of the batch's tiles and frames, each sample's in the order of its
        tokens (``vision_order``: the tiles' then the frames' rows, reordered)."""
        import torch

        parts = [fields["pixel_values"][0]] if fields and "pixel_values" in fields else []
        both = torch.cat([*parts, normalised(videos).to(parts[0].dtype if parts else None)])
        return {"pixel_values": both[batch["vision_order"]][None]}


class SmolVLMVideo(ProcessorVideo):
    """A video as ``SmolVLMVideoProcessor`` and its processor make it: the frames its
    ``sample_frames`` takes, each resized as a single image (its longest edge to ``size``,
    then to the tile's ``S x S``) and one unit; in the text, its processor's prompt (the frame
    count in words, the duration, then per frame its time and a single image's tokens), put
    in place of the video's marker before the text is tokenized, as the processor does. Its
    frames travel with the images, in text order; a sample of images and videos is refused,
    as the processor's own output drops the images' pixels then."""

    in_text = True
    with_images = False

    def __init__(self, processor: Any):
        super().__init__(processor, needs=("max_image_size",))
        if not hasattr(processor, "replace_video_token"):
            raise NoVideoProcessor(f"{type(processor).__name__} has no replace_video_token()")
        self.processor = processor
        self.tokenizer = processor.tokenizer
        side = int(self.vp.max_image_size["longest_edge"])
        tile = int(processor.image_processor.max_image_size["longest_edge"])
        if side != tile:
            raise NoVideoProcessor(
                f"its video processor's frames are {side} px, its image tiles {tile} px: the "
                "model takes both as one stream of images, of one size"
            )
        self.unit_shape = (3, side, side)
        self._ids: dict[VideoInfo, np.ndarray] = {}

    def cost(self, info: VideoInfo) -> int:
        """Frames sampled: a video's vision units."""
        return len(self.frames(info))

    def prompt(self, info: VideoInfo, count: int | None = None) -> str:
        """The text the processor puts in place of the video's marker. ``count``: the frame
        count it says in words, by default the video's; the processor says its call's most
        (with several videos in a sample, the longest one's) for each."""
        indices = self.frames(info)
        metadata = video_metadata(info, [int(i) for i in indices])
        shape = np.empty((1, count or len(indices), 0))  # what the processor reads of pixels
        return self.processor.replace_video_token(
            {"pixel_values": shape, "video_metadata": [metadata]}, 0
        )

    def token_ids(self, info: VideoInfo) -> np.ndarray:
        """The prompt's ids, tokenized alone (in its sample, the text around it may join a
        token or two at its ends: the sample's own count is the one packing uses); kept for
        the last few thousand videos, as the epoch estimate asks for many."""
        found = self._ids.get(info)
        if found is None:
            if len(self._ids) >= 4096:
                self._ids.clear()
            ids = self.tokenizer(self.prompt(info), add_special_tokens=False)["input_ids"]
            found = self._ids[info] = np.asarray(ids, dtype=np.int64)
            found.flags.writeable = False
        return found

    def units(self, frames: np.ndarray, info: VideoInfo, out: Any) -> None:
        """The sampled ``frames`` (``[n, H, W, 3]`` uint8) resized by the video processor's
        own resize (both steps) into ``out`` ``[n, 3, S, S]`` uint8."""
        import torch

        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
        out.copy_(self.vp.resize(video[None].contiguous(), self.vp.size, self.vp.resample)[0])
