"""Video files as a dataset holds them: what the writer records of a video, and decoding the
frames a sample needs. No torch: the writer uses this module. PyAV (``pip install av``, FFmpeg
bundled) reads them from bytes.

What the index records (``probe_video``) is what planning needs without decoding: the frame
count and average frame rate as the container states them (what transformers' ``load_video``
reads, so frames are sampled as the processor samples them), the duration, the stored size,
the display rotation, the codec, and the frame index of each keyframe, so that a reader seeks
to the keyframe before the first frame it needs and decodes from there, never the whole
stream. Frame ``i`` is the ``i``-th frame the decoder gives from the start, as ``load_video``
counts them.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .images import UnreadableImage, decode_pixels, image_size
from .members import FRAMES, VIDEO, VIDEO_EXTENSIONS, read_members  # noqa: F401 (shards.py's)
from .tarball import HashingTarWriter, tar_members


def video_members(sample: dict) -> list[str]:
    """The sample's video member names (``1.mp4``, ...), in video order, by the one rule of
    ``format.members``."""
    return read_members(sample, VIDEO)


class UnreadableVideo(ValueError):
    """The bytes are not a video PyAV can demux and decode: truncated, no video stream, a
    codec FFmpeg cannot decode, no frames."""


@dataclass(frozen=True)
class VideoInfo:
    """What the index records of one video."""

    ext: str
    frames: int  # as the container states it (transformers' total_num_frames)
    fps: float  # the container's average frame rate
    duration: float  # seconds, frames / fps as load_video computes it
    width: int  # as stored (before rotation)
    height: int
    rotation: int  # degrees counter-clockwise to display it (0, 90, 180, 270)
    codec: str
    # (frame index, presentation time in the stream's time base) of each keyframe, in order
    keyframes: tuple[tuple[int, int], ...]

    def as_dict(self) -> dict:
        out = asdict(self)
        out["keyframes"] = [list(k) for k in self.keyframes]
        return out

    @classmethod
    def from_dict(cls, meta: dict) -> VideoInfo:
        return cls(**{**meta, "keyframes": tuple(tuple(k) for k in meta["keyframes"])})


def _av() -> Any:
    try:
        import av
    except ImportError as e:  # pragma: no cover - the test environment has it
        raise ImportError("video needs PyAV: pip install 'wdsvlm[video]' (or av)") from e
    return av


def _open(data: bytes) -> Any:
    av = _av()
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError) as e:
        reason = getattr(e, "strerror", None) or e
        raise UnreadableVideo(f"not a video container FFmpeg can open ({reason})") from e
    if not container.streams.video:
        container.close()
        raise UnreadableVideo("no video stream")
    return container


def probe_video(data: bytes, ext: str | None = None) -> VideoInfo:
    """What the index records of ``data`` (stored as ``ext``, by default its container's);
    refused (``UnreadableVideo``) unless every packet demuxes, the first frame decodes and the
    container's frame count is the decoder's."""
    av = _av()
    container = _open(data)
    if ext is None:  # FFmpeg's names of the container: "mov,mp4,m4a,3gp,3g2,mj2", "avi", ...
        names = str(container.format.name).split(",")
        ext = "mkv" if "matroska" in names else "avi" if "avi" in names else "mp4"
    try:
        stream = container.streams.video[0]
        if stream.codec_context is None or stream.codec_context.name is None:
            raise UnreadableVideo("a video stream with no codec FFmpeg can decode")
        rate = stream.average_rate
        stated = int(stream.frames)
        times: list[int] = []
        keys: list[int] = []
        try:
            for packet in container.demux(stream):
                if packet.size and packet.is_corrupt:  # cut short: a truncated file
                    raise UnreadableVideo(f"frame {len(times)} of its stream is cut short")
                if packet.size and packet.pts is not None:
                    times.append(packet.pts)
                    if packet.is_keyframe:
                        keys.append(packet.pts)
        except av.FFmpegError as e:
            raise UnreadableVideo(f"its stream breaks off after {len(times)} frames: {e}") from e
        if not times:
            raise UnreadableVideo("no frames")
        if not rate:
            raise UnreadableVideo("no frame rate in the container")
        if stated not in (0, len(times)):
            raise UnreadableVideo(
                f"the container says {stated} frames, its stream holds {len(times)}"
            )
        order = {pts: i for i, pts in enumerate(sorted(times))}
        keyframes = tuple(sorted((order[pts], pts) for pts in keys))
        if not keyframes or keyframes[0][0] != 0:
            raise UnreadableVideo("the first frame is no keyframe: it cannot be decoded alone")
        container.seek(0)
        first = next(container.decode(stream), None)
        if first is None:
            raise UnreadableVideo("its first frame does not decode")
        rotation = int(round(getattr(first, "rotation", 0) or 0)) % 360
        frames = stated or len(times)
        return VideoInfo(
            ext=ext,
            frames=frames,
            fps=float(rate),
            duration=float(frames / rate),
            width=int(stream.width),
            height=int(stream.height),
            rotation=rotation,
            codec=str(stream.codec_context.name),
            keyframes=keyframes,
        )
    except av.FFmpegError as e:
        raise UnreadableVideo(str(e)) from e
    finally:
        container.close()


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


def decode_frames(data: bytes, indices: Sequence[int], info: VideoInfo) -> np.ndarray:
    """``[len(indices), height, width, 3]`` uint8 RGB: the frames ``indices``, in that order,
    as stored (no rotation), decoded from the keyframe before each run of them on, never from
    the start of the stream unless a frame there is asked for, straight into the output (a
    worker holds about the sampled frames' pixels, not the stream's)."""
    if info.ext == FRAMES:
        wanted = [int(i) for i in indices]
        if wanted and (min(wanted) < 0 or max(wanted) >= info.frames):
            low, high = min(wanted), max(wanted)
            raise ValueError(f"frames {low}..{high} asked of a video of {info.frames}")
        return _stored_frames(data, wanted, info)
    av = _av()
    wanted = sorted(set(int(i) for i in indices))
    if wanted and (wanted[0] < 0 or wanted[-1] >= info.frames):
        raise ValueError(f"frames {wanted[0]}..{wanted[-1]} asked of a video of {info.frames}")
    rows: dict[int, list[int]] = {}  # the rows of the output each frame goes to
    for row, i in enumerate(indices):
        rows.setdefault(int(i), []).append(row)
    out = np.empty((len(indices), info.height, info.width, 3), dtype=np.uint8)
    done = 0
    container = _open(data)
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        starts = [k for k, _ in info.keyframes]
        at = -1  # the index of the frame the decoder gave last
        frames = None
        first_pts = None
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
    except av.FFmpegError as e:
        raise UnreadableVideo(f"frame {done} of {len(wanted)} does not decode: {e}") from e
    finally:
        container.close()
    if done < len(wanted):
        raise UnreadableVideo(
            f"decodes to fewer frames than the index's {info.frames}: frame {wanted[done]} missing"
        )
    return out
