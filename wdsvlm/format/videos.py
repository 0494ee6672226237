"""Video files as a dataset holds them: what the writer records of a video, and decoding the
frames a sample needs. No torch: the writer uses this module. PyAV (``pip install av``, FFmpeg
bundled) reads them from bytes.

The bytes are untrusted: ``format.containers`` opens them (by their extension's demuxer,
nothing beside them, their size checked before a frame is decoded).

What the index records (``probe_video``) is what planning needs without decoding: the frame
count (the frames a sequential decode gives: the packets the decoder keeps, those an edit
list hides left out), the average frame rate as the container states it (what
transformers' ``load_video`` reads), the duration, the stored size, the display rotation, the
codec, and of each keyframe the number of the first frame shown from it on and its time, so
that a reader seeks to the keyframe before the first frame it needs and decodes from there,
never the whole stream. Frame ``i`` is the ``i``-th frame a sequential decode gives (``for
frame in container.decode(video=0)``, as ``load_video`` counts them), at probe time and at
decode time alike.
"""

from __future__ import annotations

import bisect
import io
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .containers import (
    MAX_VIDEO_PIXELS,
    VIDEO_THREADS,
    UnreadableVideo,
    av_module,
    check_pixels,
    header_size,
    open_container,
    open_unnamed,
)
from .images import UnreadableImage, decode_pixels, image_size
from .members import FRAMES, VIDEO, VIDEO_EXTENSIONS, read_members  # noqa: F401 (shards.py's)
from .tarball import HashingTarWriter, tar_members


def video_members(sample: dict) -> list[str]:
    """The sample's video member names (``1.mp4``, ...), in video order, by the one rule of
    ``format.members``."""
    return read_members(sample, VIDEO)


@dataclass(frozen=True)
class VideoInfo:
    """What the index records of one video."""

    ext: str
    frames: int  # as a sequential decode gives them (the processor samples from it)
    fps: float  # the container's average frame rate
    duration: float  # seconds, frames / fps as load_video computes it
    width: int  # as stored (before rotation)
    height: int
    rotation: int  # degrees counter-clockwise to display it (0, 90, 180, 270)
    codec: str
    # of each keyframe, in order: (the number of the first frame shown from it on, its
    # presentation time in the stream's time base)
    keyframes: tuple[tuple[int, int], ...]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["keyframes"] = [list(k) for k in self.keyframes]
        return out

    @classmethod
    def from_dict(cls, meta: dict) -> VideoInfo:
        return cls(**{**meta, "keyframes": tuple(tuple(k) for k in meta["keyframes"])})


def probe_video(
    data: bytes, ext: str | None = None, max_pixels: int = MAX_VIDEO_PIXELS
) -> VideoInfo:
    """What the index records of ``data`` stored as ``ext`` (None: bytes that came without an
    extension, tried as ``_UNNAMED`` in turn); refused (``UnreadableVideo``) unless it opens
    with its extension's demuxer, every packet demuxes, its first frame decodes and it keeps
    within ``max_pixels`` (``check_pixels``, from its headers before a frame is decoded)."""
    av = av_module()
    container, ext = open_unnamed(data) if ext is None else (open_container(data, ext), ext)
    with container:  # closed on every path, so no FFmpeg thread outlives the probe
        try:
            return _probe(av, container, ext, max_pixels)
        except av.FFmpegError as e:
            raise UnreadableVideo(str(e)) from e


def _probe(av: Any, container: Any, ext: str, max_pixels: int) -> VideoInfo:
    stream = container.streams.video[0]
    if stream.codec_context is None or stream.codec_context.name is None:
        raise UnreadableVideo("a video stream with no codec FFmpeg can decode")
    stated, width, height = header_size(container)
    check_pixels(stated, width, height, max_pixels)
    rate = stream.average_rate
    shown: list[int] = []  # the times of the frames a sequential decode gives
    keys: list[int] = []  # the keyframes' times, shown or not
    try:
        for packet in container.demux(stream):
            if not packet.size or packet.pts is None:
                continue
            if packet.is_corrupt:  # cut short: a truncated file
                raise UnreadableVideo(f"frame {len(shown)} of its stream is cut short")
            if packet.is_keyframe:
                keys.append(packet.pts)
            if not packet.is_discard:  # an edit list hides it: the decoder drops its frame
                shown.append(packet.pts)
            if len(shown) * width * height > max_pixels:  # the container did not say
                check_pixels(len(shown), width, height, max_pixels)
    except av.FFmpegError as e:
        raise UnreadableVideo(f"its stream breaks off after {len(shown)} frames: {e}") from e
    if not shown:
        raise UnreadableVideo("no frames")
    if not rate:
        raise UnreadableVideo("no frame rate in the container")
    shown.sort()
    # a keyframe's number: the frames shown before it, as a sequential decode counts them
    keyframes = tuple(sorted((bisect.bisect_left(shown, pts), pts) for pts in keys))
    if not keyframes or keyframes[0][0] != 0:
        raise UnreadableVideo("the first frame is no keyframe: it cannot be decoded alone")
    stream.codec_context.thread_count = 1
    container.seek(keyframes[0][1], stream=stream, backward=True, any_frame=False)
    first = next(container.decode(stream), None)
    if first is None:
        raise UnreadableVideo("its first frame does not decode")
    rotation = int(round(getattr(first, "rotation", 0) or 0)) % 360
    return VideoInfo(
        ext=ext,
        frames=len(shown),
        fps=float(rate),
        duration=float(len(shown) / rate),
        width=width,
        height=height,
        rotation=rotation,
        codec=str(stream.codec_context.name),
        keyframes=keyframes,
    )


FRAMES_META = "meta.json"  # the frame rate of a video stored as its frames, in its tar


def frames_meta(fps: float) -> bytes:
    """The member of a frames tar that keeps the video's frame rate."""
    return json.dumps({"fps": fps}).encode()


def frames_video(files: Sequence[tuple[bytes, str]], fps: float) -> bytes:
    """The member that stores a video given as its frames: a tar of the frame files
    ``(bytes, extension)``, as they are, named ``000000.jpg``, ... in order, and its frame
    rate (``meta.json``)."""
    out = io.BytesIO()
    tar = HashingTarWriter(out)
    for i, (data, ext) in enumerate(files):
        tar.member(f"{i:06d}.{ext}", data)
    tar.member(FRAMES_META, frames_meta(fps))
    tar.close()
    return out.getvalue()


def frames_info(sizes: Sequence[tuple[int, int]], fps: float, codec: str) -> VideoInfo:
    """What the index records of a video given as frames of displayed ``sizes`` at ``fps``;
    refused (``UnreadableVideo``) unless it has frames, all of one size, and a frame rate."""
    if not sizes:
        raise UnreadableVideo("no frames")
    for i, size in enumerate(sizes):
        if tuple(size) != tuple(sizes[0]):
            raise UnreadableVideo(
                f"frame {i} is {size[0]}x{size[1]}, frame 0 is {sizes[0][0]}x{sizes[0][1]}"
            )
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < math.inf:
        raise UnreadableVideo(f"its frame rate {fps!r} is not a positive number")
    width, height = sizes[0]
    return VideoInfo(
        FRAMES, len(sizes), float(fps), len(sizes) / fps, int(width), int(height), 0, codec, ()
    )


def _frame_files(data: bytes) -> tuple[list[tuple[str, bytes]], dict]:
    """The frame files of a frames tar, in order, and its ``meta.json``."""
    try:
        members = tar_members(data)
        meta = json.loads(members.pop(FRAMES_META, b"{}"))
    except Exception as e:  # noqa: BLE001 - tarfile's and json's errors: not a frames tar
        raise UnreadableVideo(f"its frames are not a readable tar: {e}") from e
    return sorted(members.items()), meta


def probe_frames(data: bytes) -> VideoInfo:
    """What the index records of a stored frames tar (``wdsvlm index`` of a shard that holds
    one): its frames' sizes from their headers, its rate from its ``meta.json``."""
    files, meta = _frame_files(data)
    sizes, codecs = [], set()
    for name, body in files:
        try:
            sizes.append(image_size(body))
        except UnreadableImage as e:
            raise UnreadableVideo(f"frame {name} is not a readable image: {e}") from e
        codecs.add(name.rsplit(".", 1)[-1].lower())
    if "fps" not in meta:
        raise UnreadableVideo(f"its frames tar has no {FRAMES_META} with the frame rate")
    return frames_info(sizes, meta["fps"], "+".join(sorted(codecs)))


def _stored_frames(data: bytes, indices: Sequence[int], info: VideoInfo) -> np.ndarray:
    """``decode_frames`` of a video stored as its frames: only the frames asked for decoded,
    as images are (EXIF orientation applied, RGB)."""
    files, _ = _frame_files(data)
    if len(files) < info.frames:
        raise UnreadableVideo(f"holds {len(files)} frames, the index says {info.frames}")
    out = np.empty((len(indices), info.height, info.width, 3), dtype=np.uint8)
    for row, index in enumerate(indices):
        name, body = files[int(index)]
        try:
            out[row] = decode_pixels(body, (info.width, info.height))
        except UnreadableImage as e:
            raise UnreadableVideo(f"frame {index} ({name}) does not decode: {e}") from e
    return out


def decode_frames(
    data: bytes,
    indices: Sequence[int],
    info: VideoInfo,
    *,
    max_pixels: int = MAX_VIDEO_PIXELS,
    threads: int = VIDEO_THREADS,
) -> np.ndarray:
    """``[len(indices), height, width, 3]`` uint8 RGB: the frames ``indices``, in that order,
    as stored (no rotation), decoded from the keyframe before each run of them on, never from
    the start of the stream unless a frame there is asked for, straight into the output (a
    worker holds about the sampled frames' pixels, not the stream's). The video is refused
    (``VideoTooLarge``) where the index or its own headers state more than ``max_pixels``,
    before a frame is decoded; FFmpeg decodes it with ``threads`` threads (0: its own count,
    one per core and one more)."""
    wanted = sorted(set(int(i) for i in indices))
    if wanted and (wanted[0] < 0 or wanted[-1] >= info.frames):
        raise ValueError(f"frames {wanted[0]}..{wanted[-1]} asked of a video of {info.frames}")
    check_pixels(info.frames, info.width, info.height, max_pixels)
    if info.ext == FRAMES:
        return _stored_frames(data, [int(i) for i in indices], info)
    av = av_module()
    rows: dict[int, list[int]] = {}  # the rows of the output each frame goes to
    for row, i in enumerate(indices):
        rows.setdefault(int(i), []).append(row)
    with open_container(data, info.ext) as container:  # closed on every path, its threads with it
        stated, width, height = header_size(container)
        check_pixels(max(stated, info.frames), width, height, max_pixels)
        if (width, height) != (info.width, info.height):
            raise UnreadableVideo(
                f"its header says {width}x{height}, the index {info.width}x{info.height}"
            )
        out = np.empty((len(indices), info.height, info.width, 3), dtype=np.uint8)
        try:
            done = _decode_into(container, wanted, rows, info, threads, out)
        except av.FFmpegError as e:
            raise UnreadableVideo(f"a frame of the {len(wanted)} asked does not decode: {e}") from e
    if done < len(wanted):
        raise UnreadableVideo(
            f"decodes to fewer frames than the index's {info.frames}: frame {wanted[done]} missing"
        )
    return out


def _decode_into(
    container: Any,
    wanted: list[int],
    rows: dict[int, list[int]],
    info: VideoInfo,
    threads: int,
    out: np.ndarray,
) -> int:
    """Decode the frames ``wanted`` (sorted) into their ``rows`` of ``out``; how many came."""
    stream = container.streams.video[0]
    stream.codec_context.thread_count = threads
    if threads != 1:
        stream.thread_type = "AUTO"  # frame and slice threads
    starts = [k for k, _ in info.keyframes]
    at = -1  # the number of the frame the decoder gave last
    frames = None
    first_pts = None
    done = 0
    for index in wanted:
        key, key_pts = info.keyframes[int(np.searchsorted(starts, index, side="right")) - 1]
        if frames is None or key > at + 1:  # seek, unless the decoder passes it on its way
            container.seek(key_pts, stream=stream, backward=True, any_frame=False)
            frames = container.decode(stream)
            at, first_pts = key - 1, key_pts
        for frame in frames:
            if first_pts is not None and frame.pts is not None and frame.pts < first_pts:
                continue  # a leading frame of an open GOP, from before the keyframe
            first_pts = None
            at += 1
            if at == index:
                pixels = frame.to_ndarray(format="rgb24")
                if pixels.shape != out.shape[1:]:
                    raise UnreadableVideo(
                        f"frame {index} decodes to {pixels.shape[1]}x{pixels.shape[0]}, "
                        f"the index says {info.width}x{info.height}"
                    )
                for row in rows[index]:
                    out[row] = pixels
                done += 1
                break
        else:
            break
    return done
