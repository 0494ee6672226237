"""Short test videos made here with PyAV (H.264 in MP4, FFmpeg's libx264 as PyAV bundles it):
several frame rates, sizes, a rotated one and one with a variable frame rate. Nothing is
downloaded; the same arguments give the same frames.

Each frame shows its own number: a bar whose place and colour follow the frame index, over a
gradient, so that a test can tell which frames it got.
"""

from __future__ import annotations

import io
import os
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np


@dataclass(frozen=True)
class VideoSpec:
    """One test video: ``fps`` (exact, e.g. ``Fraction(30000, 1001)``), ``seconds`` long,
    ``width`` x ``height`` as stored, ``rotation`` (degrees, counter-clockwise, in the
    container's display matrix), ``vfr``: frame times drawn at random around ``1 / fps``."""

    name: str
    fps: Fraction
    seconds: float
    width: int
    height: int
    rotation: int = 0
    vfr: bool = False

    @property
    def frames(self) -> int:
        return max(1, round(self.seconds * self.fps))


# The set the tests and the demo use: the frame rates of the corpora people train on, from half
# a second to a few seconds; BIG adds a 30 s 720p clip for the benchmarks.
SPECS = (
    VideoSpec("fps24", Fraction(24), 2.0, 320, 240),
    VideoSpec("fps25", Fraction(25), 0.5, 160, 120),
    VideoSpec("fps2997", Fraction(30000, 1001), 3.0, 640, 360),
    VideoSpec("fps30-rot90", Fraction(30), 1.0, 256, 192, rotation=90),
    VideoSpec("fps60", Fraction(60), 2.0, 320, 180),
    VideoSpec("vfr", Fraction(30), 2.0, 320, 240, vfr=True),
)
BIG = VideoSpec("fps30-720p-30s", Fraction(30), 30.0, 1280, 720)


def frame_pixels(index: int, width: int, height: int) -> np.ndarray:
    """``[height, width, 3]`` uint8: frame ``index``'s picture."""
    x = np.linspace(0, 255, width, dtype=np.float32)
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    out = np.empty((height, width, 3), dtype=np.uint8)
    out[..., 0] = (x[None, :] + index * 7) % 256
    out[..., 1] = np.broadcast_to(y, (height, width))
    out[..., 2] = (index * 37) % 256
    bar = max(2, width // 16)
    at = (index * bar) % max(1, width - bar)
    out[:, at : at + bar] = (255, 255 - (index * 11) % 256, 0)
    return out


def make_video(spec: VideoSpec, gop: int = 12, seed: int = 0, faststart: bool = False) -> bytes:
    """The MP4 bytes of ``spec``: H.264, yuv420p, a keyframe every ``gop`` frames; with
    ``faststart`` the container's index comes before the frames (as streamed files have it)."""
    import av

    if faststart:  # the muxer moves its index in a second pass over a file
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "video.mp4")
            options = {"movflags": "faststart"}
            _write(av.open(path, "w", format="mp4", options=options), spec, gop, seed)
            with open(path, "rb") as f:
                return f.read()
    out = io.BytesIO()
    _write(av.open(out, "w", format="mp4"), spec, gop, seed)
    return out.getvalue()


def _write(container: Any, spec: VideoSpec, gop: int, seed: int) -> None:
    import av

    with container:
        stream = container.add_stream("libx264", rate=spec.fps)
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
        stream.options = {"preset": "ultrafast", "g": str(gop), "bf": "0"}
        if spec.vfr:  # milliseconds; each frame 0.5-1.5 of the nominal interval after the last
            stream.codec_context.time_base = Fraction(1, 1000)
            gaps = np.random.default_rng(seed).uniform(0.5, 1.5, spec.frames) / float(spec.fps)
            times = np.concatenate([[0], np.cumsum(gaps)[:-1]])
            pts = np.unique(np.round(times * 1000).astype(np.int64))
        else:
            pts = np.arange(spec.frames)
        if spec.rotation:
            stream.set_display_rotation(spec.rotation)
        for i, p in enumerate(pts):
            frame = av.VideoFrame.from_ndarray(
                frame_pixels(i, spec.width, spec.height), format="rgb24"
            )
            frame.pts = int(p)
            if spec.vfr:
                frame.time_base = Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def frame_files(spec: VideoSpec, count: int, quality: int = 90) -> list[bytes]:
    """JPEG files of the first ``count`` frames of ``spec``, as datasets ship pre-extracted
    frames."""
    from PIL import Image

    files = []
    for i in range(count):
        out = io.BytesIO()
        picture = Image.fromarray(frame_pixels(i, spec.width, spec.height))
        picture.save(out, format="JPEG", quality=quality)
        files.append(out.getvalue())
    return files


def bad_videos() -> dict[str, bytes]:
    """Each kind of bad video, by name: cut short (its index at the front, the last frames
    missing), cut before its index, no frames, no video stream (sound only), a codec FFmpeg
    does not know."""
    import av

    good = make_video(SPECS[0], faststart=True)
    empty, sound = io.BytesIO(), io.BytesIO()
    with av.open(empty, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
    with av.open(sound, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=16000)
        frame = av.AudioFrame.from_ndarray(
            np.zeros((1, 1024), np.float32), format="fltp", layout="mono"
        )
        frame.sample_rate, frame.pts = 16000, 0
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return {
        "truncated": good[: len(good) * 3 // 4],
        "truncated-before-index": make_video(SPECS[0])[:5000],
        "no-frames": empty.getvalue(),
        "no-video-stream": sound.getvalue(),
        "unknown-codec": good.replace(b"avc1", b"zzz1"),
    }
