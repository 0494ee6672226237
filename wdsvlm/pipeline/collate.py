"""Collate: packs in, fixed-shape batches out (the batch format, described in docs/loading.md,
"A batch"), and the attention helpers that keep packed samples apart.

A batch always has ``batch_size`` rows of ``max_length`` tokens, so a compiled model never
recompiles; rows without a pack (at the very end of a pass) are all padding. Images that were
not decoded yet are decoded here, straight into the batch's one uint8 tensor (in shared memory
inside a DataLoader worker, so it crosses to the training process without a copy).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..families.base import Family
from ..families.tiling import ImageConfig, TilingFamily
from ..format.containers import MAX_VIDEO_PIXELS, VIDEO_THREADS, VideoTooLarge
from ..format.images import UnreadableImage
from ..format.videos import UnreadableVideo, VideoInfo, decode_frames, video_members
from .images import uint8_tiles
from .memory import private_uint8, shared_uint8
from .stats import SkipStats, sample_name
from .timing import stretch
from .tokenize import IGNORE_INDEX
from .usermap import ImageMap, MapFailed


class Collate:
    """Batch maker: a list of up to ``batch_size`` packs -> a dict of tensors.

    Each pack is a list of tokenized samples (``input_ids``, ``labels``, ``image_tiles``, and
    ``pixel_values`` or image members still to decode). A sample whose image fails to decode
    here is left out of its row (counted as ``undecodable_image``); the row pads instead.
    ``image_map`` (``usermap.ImageMap``, the Loader's ``image_map=``) edits each image once
    decoded, before the family resizes it; a sample it fails on is left out as ``map_error``.

    Images become the ``family``'s uint8 units (without one, the default tiling with
    ``image_config``) and the batch gets the family's fields: for a processor's family its
    name (``family``), the pixel table that ``model_inputs`` normalises with, and for the
    Qwen family ``image_grid_thw`` and ``position_ids`` ``[4, B, L]``.

    Every batch of one Collate has the same keys, whatever its rows hold: with ``sources``
    (a mixture) ``sample_sources`` is there also in a batch of empty rows (the end of an
    evaluation pass, a batch whose every sample failed), as B empty lists.

    ``clock`` (a ``timing.StageClock``, set by the Loader's stream in each worker): decoding
    is charged to it as ``decode_image`` (decode and resize into the family's units: one call
    of the family's, not split) and ``decode_video``; the rest is the caller's stage.
    """

    clock = None

    def __init__(
        self,
        max_length: int,
        batch_size: int,
        pad_token_id: int,
        *,
        image_config: ImageConfig | None = None,
        family: Family | None = None,
        stats: SkipStats | None = None,
        image_map: ImageMap | None = None,
        sources: bool = False,
        max_video_pixels: int = MAX_VIDEO_PIXELS,
        video_threads: int = VIDEO_THREADS,
    ):
        self.family = family or TilingFamily(image_config)
        self.max_video_pixels, self.video_threads = max_video_pixels, video_threads
        self.sources = sources
        self.image_map = image_map
        self._constant_fields = self.family.constant_fields()  # made once, in every batch
        self.max_length = max_length
        self.batch_size = batch_size
        self.pad_token_id = pad_token_id
        self.stats = stats if stats is not None else SkipStats()

    def __call__(self, packs: Sequence[list[dict]]) -> dict[str, Any]:
        if len(packs) > self.batch_size:
            raise ValueError(f"{len(packs)} packs for a batch of {self.batch_size}")
        rows = [list(pack) for pack in packs] + [[]] * (self.batch_size - len(packs))
        samples = [s for row in rows for s in row]
        counts = [sum(s["image_tiles"]) for s in samples]
        pixels = uint8_tiles(sum(counts), self.family.unit_size)
        video = getattr(self.family, "video", None)
        frames = [sum(s.get("video_units", ())) for s in samples]
        videos = None if video is None else uint8_units((sum(frames), *video.unit_shape))
        failed, start, at = [], 0, 0
        images, frames_of = stretch(self.clock, "decode_image"), stretch(self.clock, "decode_video")
        for sample, n, m in zip(samples, counts, frames, strict=True):
            try:
                if n:
                    with images:
                        self._fill(sample, pixels[start : start + n])
                if m:
                    with frames_of:
                        self._fill_videos(sample, videos[at : at + m])
            except UnreadableImage as e:
                self.stats.skip("collate", "undecodable_image", sample, str(e))
                failed.append((sample, (start, n), (at, m)))
            except VideoTooLarge as e:
                self.stats.skip("collate", "video_too_large", sample, str(e))
                failed.append((sample, (start, n), (at, m)))
            except UnreadableVideo as e:
                self.stats.skip("collate", "undecodable_video", sample, str(e))
                failed.append((sample, (start, n), (at, m)))
            except MapFailed as e:
                self.stats.skip("collate", "map_error", sample, str(e))
                failed.append((sample, (start, n), (at, m)))
            start += n
            at += m
        if failed:  # rare: leave the failed samples out, their rows pad instead
            pixels = _without(pixels, [images for _, images, _ in failed])
            if videos is not None:
                videos = _without(videos, [of_videos for _, _, of_videos in failed])
            gone = {id(s) for s, _, _ in failed}
            rows = [[s for s in row if id(s) not in gone] for row in rows]
        batch = collate_rows(rows, self.max_length, self.pad_token_id, pixels, sources=self.sources)
        if videos is not None:
            batch["video_pixels"] = videos
            kept = [s for row in rows for s in row]
            batch["video_units"] = torch.tensor(
                [u for s in kept for u in s.get("video_units", ())], dtype=torch.long
            )
        batch.update(self._constant_fields)
        batch.update(self.family.batch_fields(rows, batch))
        return batch

    def _fill_videos(self, sample: dict, out: torch.Tensor) -> None:
        """Decode the sample's videos' sampled frames into their units, video by video."""
        video = self.family.video
        infos = [VideoInfo.from_dict(v) for v in sample["__meta__"]["videos"]]
        names = video_members(sample)
        if len(names) != len(infos):
            raise UnreadableVideo(f"{len(names)} video members, the index lists {len(infos)}")
        start = 0
        for name, info, n in zip(names, infos, sample["video_units"], strict=True):
            frames = decode_frames(
                sample[name],
                video.frames(info),
                info,
                max_pixels=self.max_video_pixels,
                threads=self.video_threads,
            )
            video.units(frames, info, out[start : start + n])
            start += n

    def _fill(self, sample: dict, out: torch.Tensor) -> None:
        if "pixel_values" in sample:
            out.copy_(torch.as_tensor(sample["pixel_values"]))
        elif self.image_map is None:  # decoded straight into the batch's tensor
            self.family.decode(sample, out)
        else:
            self.family.decode(sample, out, self.image_map.for_sample(sample))


def _without(pixels: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    keep = torch.ones(len(pixels), dtype=torch.bool)
    for start, n in ranges:
        keep[start : start + n] = False
    out = uint8_units((int(keep.sum()), *pixels.shape[1:]))
    out.copy_(pixels[keep])
    return out


def uint8_units(shape: tuple[int, ...]) -> torch.Tensor:
    """An empty uint8 tensor of ``shape``, in shared memory inside a DataLoader worker (as
    ``images.uint8_tiles``)."""
    from torch.utils.data import get_worker_info

    return private_uint8(shape) if get_worker_info() is None else shared_uint8(shape)


def collate_rows(
    rows: list[list[dict]],
    max_length: int,
    pad_token_id: int,
    pixels: torch.Tensor,
    *,
    sources: bool = False,
) -> dict[str, Any]:
    """The batch tensors for ``rows`` (each a list of samples, in pack order); ``pixels``
    holds their tiles already, in the same order. ``sample_sources`` comes with ``sources``
    (a mixture's batches: there even when every row is empty) or with any sample that names
    its source."""
    b = len(rows)
    input_ids = np.full((b, max_length), pad_token_id, dtype=np.int64)
    labels = np.full((b, max_length), IGNORE_INDEX, dtype=np.int64)
    attention = np.zeros((b, max_length), dtype=np.int64)
    positions = np.zeros((b, max_length), dtype=np.int64)
    segments = []
    for r, row in enumerate(rows):
        at = 0
        for sample in row:
            n = len(sample["input_ids"])
            if at + n > max_length:
                raise ValueError(f"a pack of {at + n} tokens does not fit max_length={max_length}")
            input_ids[r, at : at + n] = sample["input_ids"]
            labels[r, at : at + n] = sample["labels"]
            attention[r, at : at + n] = 1
            positions[r, at : at + n] = np.arange(n)
            segments.append(n)
            at += n
        if at < max_length:  # padding: a segment of its own, positions from 0
            positions[r, at:] = np.arange(max_length - at)
            segments.append(max_length - at)
    samples = [s for row in rows for s in row]
    tiles = [t for s in samples for t in s["image_tiles"]]
    if sum(tiles) != len(pixels):
        raise ValueError(f"{len(pixels)} tiles for {sum(tiles)} in the samples' image_tiles")
    labels_t = torch.from_numpy(labels)
    batch = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.from_numpy(attention),
        "labels": labels_t,
        "position_ids": torch.from_numpy(positions),
        "cu_seqlens": torch.from_numpy(np.cumsum([0, *segments], dtype=np.int32)),
        "max_seqlen": max(segments),
        "pixel_values": pixels,
        "image_tiles": torch.tensor(tiles, dtype=torch.long),
        "num_loss_tokens": (labels_t != IGNORE_INDEX).sum(),
        "sample_keys": [[sample_name(s) for s in row] for row in rows],
        "sample_passes": [[s.get("__pass__", 0) for s in row] for row in rows],
    }
    if any("__piece__" in s for s in samples):  # which piece of its document (None: whole)
        batch["sample_pieces"] = [[s.get("__piece__") for s in row] for row in rows]
    if sources or any("__source__" in s for s in samples):  # which source each sample is of
        batch["sample_sources"] = [[s.get("__source__") for s in row] for row in rows]
    return batch


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per token, the number of its packed segment in its row (a new one where positions
    restart at 0); padding, which restarts too, is a segment of its own."""
    return torch.cumsum((position_ids == 0).long(), dim=-1)


def block_causal_mask(
    position_ids: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The 4-D additive mask ``[B, 1, L, L]`` for eager/SDPA attention over packed rows: a
    token sees the earlier tokens of its own sample only (0 where allowed, the dtype's lowest
    value elsewhere). Pass it as ``attention_mask`` together with ``position_ids``."""
    seg = segment_ids(position_ids)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]
