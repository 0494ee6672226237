"""Short test videos made here with PyAV (H.264 in MP4, FFmpeg's libx264 as PyAV bundles it):
several frame rates, sizes, a rotated one and one with a variable frame rate; encoded with
B-frames or open GOPs, remuxed with an edit list that hides leading frames, or with headers
that state another size; and files that are no video but name other files (a concat script,
a playlist). Nothing is downloaded; the same arguments give the same frames.

Each frame shows its own number: a bar whose place and colour follow the frame index, over a
gradient, so that a test can tell which frames it got.
"""

from __future__ import annotations

import io
import os
import struct
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


def make_video(
    spec: VideoSpec,
    gop: int = 12,
    seed: int = 0,
    faststart: bool = False,
    encoding: str = "plain",
) -> bytes:
    """The MP4 bytes of ``spec``: H.264, yuv420p, a keyframe every ``gop`` frames; with
    ``faststart`` the container's index comes before the frames (as streamed files have it).
    ``encoding``: ``"plain"`` (no B-frames), ``"bframes"`` (x264's default preset: B-frames
    as references, shown out of decode order, and an edit list for the delay they bring) or
    ``"open-gop"`` (the same with open GOPs: B-frames shown before a keyframe refer to the GOP
    before it)."""
    import av

    if faststart:  # the muxer moves its index in a second pass over a file
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "video.mp4")
            options = {"movflags": "faststart"}
            _write(av.open(path, "w", format="mp4", options=options), spec, gop, seed, encoding)
            with open(path, "rb") as f:
                return f.read()
    out = io.BytesIO()
    _write(av.open(out, "w", format="mp4"), spec, gop, seed, encoding)
    return out.getvalue()


ENCODINGS = {
    "plain": {"preset": "ultrafast", "bf": "0"},
    "bframes": {"preset": "medium", "x264-params": "scenecut=0"},
    "open-gop": {"preset": "medium", "x264-params": "scenecut=0:open-gop=1"},
}


def _write(container: Any, spec: VideoSpec, gop: int, seed: int, encoding: str) -> None:
    import av

    with container:
        stream = container.add_stream("libx264", rate=spec.fps)
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
        stream.options = {**ENCODINGS[encoding], "g": str(gop)}
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


def hide_start(data: bytes, frames: int = 1) -> bytes:
    """``data`` (an MP4 of one video stream) remuxed with its first ``frames`` frames before
    time 0, as a cut with ``ffmpeg -ss ... -c copy`` leaves them: the muxer writes an edit list
    that hides them, the demuxer gives their packets (flagged to discard), the decoder decodes
    them (later frames refer to them) and shows none."""
    import av

    out = io.BytesIO()
    with av.open(io.BytesIO(data), format="mp4") as source, av.open(out, "w", format="mp4") as sink:
        stream = source.streams.video[0]
        copy = sink.add_stream_from_template(stream)
        packets = [packet for packet in source.demux(stream) if packet.size]
        shift = sorted(packet.pts for packet in packets)[frames]  # that frame's time: 0
        for packet in packets:
            if packet.size:
                packet.pts -= shift
                packet.dts -= shift
                packet.stream = copy
                sink.mux(packet)
    return out.getvalue()


def stated_size(data: bytes, side: int) -> bytes:
    """``data`` (an MP4 of one H.264 stream, its index after its frames, as ``make_video``
    writes it without ``faststart``) with headers that say its frames are ``side`` x ``side``:
    the track, the sample entry and the sequence parameter set. The frames are the small ones;
    a decoder makes frames of the stated size (the rest of each concealed), as it would for a
    file made to exhaust a reader's memory."""
    if data.find(b"moov") < data.find(b"mdat"):
        raise ValueError("stated_size rewrites MP4s whose index comes after their frames")

    def edit(kind: bytes, body: bytes) -> bytes:
        if kind == b"tkhd":  # its last fields: width and height, 16.16 fixed point
            return body[:-8] + struct.pack(">II", side << 16, side << 16)
        if kind == b"avc1":  # after reserved fields and the data reference: width, height
            return body[:24] + struct.pack(">HH", side, side) + body[28:]
        if kind == b"avcC":  # its first parameter set: the sequence's
            n = struct.unpack_from(">H", body, 6)[0]
            sps = _sized_sps(body[8 : 8 + n], side, side)
            return body[:6] + struct.pack(">H", len(sps)) + sps + body[8 + n :]
        return body

    return _boxes(data, edit)


# MP4 boxes that hold boxes (and how many bytes of their own fields come before them)
_PARENTS = {b"moov": 0, b"trak": 0, b"mdia": 0, b"minf": 0, b"stbl": 0, b"stsd": 8, b"avc1": 78}


def _boxes(data: bytes, edit: Any) -> bytes:
    """``data``'s MP4 boxes, each box's body passed through ``edit(kind, body)`` (children
    first), their sizes made right."""
    out, at = bytearray(), 0
    while at < len(data):
        size, kind = struct.unpack_from(">I4s", data, at)
        body = data[at + 8 : at + size]
        if kind in _PARENTS:
            head = _PARENTS[kind]
            body = body[:head] + _boxes(body[head:], edit)
        body = edit(kind, bytes(body))
        out += struct.pack(">I4s", len(body) + 8, kind) + body
        at += size
    return bytes(out)


class _Bits:
    """An H.264 bitstream read bit by bit (exp-Golomb codes)."""

    def __init__(self, data: bytes, at: int = 0):
        self.data, self.at = data, at

    def u(self, n: int) -> int:
        value = 0
        for _ in range(n):
            value = (value << 1) | (self.data[self.at >> 3] >> (7 - (self.at & 7)) & 1)
            self.at += 1
        return value

    def ue(self) -> int:
        zeros = 0
        while self.u(1) == 0:
            zeros += 1
        return (1 << zeros) - 1 + self.u(zeros)

    def se(self) -> int:
        k = self.ue()
        return (k + 1) // 2 if k & 1 else -(k // 2)


def _ue(value: int) -> str:
    bits = bin(value + 1)[2:]
    return "0" * (len(bits) - 1) + bits


def _sized_sps(nal: bytes, width: int, height: int) -> bytes:
    """An H.264 sequence parameter set (NAL unit) with its size in macroblocks replaced."""
    rbsp = nal.replace(b"\x00\x00\x03", b"\x00\x00")
    r = _Bits(rbsp, 8)
    profile = r.u(8)
    r.u(16)  # constraint flags, level
    r.ue()  # its id
    if profile in (100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135):
        if r.ue() == 3:  # chroma format
            r.u(1)
        r.ue(), r.ue(), r.u(1)  # bit depths, lossless
        if r.u(1):
            raise ValueError("an SPS with scaling matrices")
    r.ue()  # frame number bits
    order = r.ue()
    if order == 0:
        r.ue()
    elif order == 1:
        r.u(1), r.se(), r.se()
        for _ in range(r.ue()):
            r.se()
    r.ue(), r.u(1)  # reference frames, gaps allowed
    head = r.at
    r.ue(), r.ue()  # the size, in macroblocks less one
    bits = "".join(f"{b:08b}" for b in rbsp)
    stop = bits.rindex("1")  # the last bit of the payload
    new = bits[:head] + _ue(width // 16 - 1) + _ue(height // 16 - 1) + bits[r.at : stop + 1]
    new += "0" * (-len(new) % 8)
    out, zeros = bytearray(), 0  # escaped again: no 00 00 0x (x <= 3) in a NAL unit
    for byte in int(new, 2).to_bytes(len(new) // 8, "big"):
        if zeros >= 2 and byte <= 3:
            out.append(3)
            zeros = 0
        out.append(byte)
        zeros = zeros + 1 if byte == 0 else 0
    return bytes(out)


def scripts(video: str, images: tuple[str, ...], segment: str) -> dict[str, bytes]:
    """Files that are no video but make FFmpeg, guessing their format, read others: a concat
    script of ``video``, one of ``images`` (read by FFmpeg's image2), and an HLS playlist of
    ``segment`` (paths relative to the reading process's working directory)."""
    concat = "".join(f"file '{name}'\n" for name in images)
    return {
        "concat-video": f"ffconcat version 1.0\nfile '{video}'\n".encode(),
        "concat-images": f"ffconcat version 1.0\n{concat}".encode(),
        "hls": (
            "#EXTM3U\n#EXT-X-VERSION:3\n#EXT-X-TARGETDURATION:2\n#EXT-X-MEDIA-SEQUENCE:0\n"
            f"#EXTINF:2.0,\n{segment}\n#EXT-X-ENDLIST\n"
        ).encode(),
    }
