"""Video containers as untrusted bytes: opened by name, never guessed, their size capped
before a frame is decoded. No torch: the writer uses this module.

FFmpeg reads far more than videos: a concat script, an HLS playlist or an image-sequence
pattern names other files, which FFmpeg opens when it guesses the format of bytes from their
content. Here the bytes are opened only with the demuxer their member's extension names
(``DEMUXERS``, an allow-list), and FFmpeg may open nothing else (no protocol is allowed, so no
file or URL: even an allowed demuxer cannot reach past the bytes given). A video whose frames
x width x height, as its headers state them, pass ``max_pixels``, or whose frame passes
Pillow's bound for one image, is refused (``VideoTooLarge``) before a frame is decoded:
opening decodes none (``_STREAM_OPTIONS``).
"""

from __future__ import annotations

import io
from typing import Any


class UnreadableVideo(ValueError):
    """The bytes are not a video PyAV can demux and decode: truncated, no video stream, a
    codec FFmpeg cannot decode, no frames, a container outside ``DEMUXERS``."""


class VideoTooLarge(UnreadableVideo):
    """The video's headers state more pixels than the bound allows (``max_pixels`` for the
    whole video, Pillow's for one frame): refused before a frame is decoded."""


# The demuxer each stored extension is opened with. Nothing else is opened: FFmpeg's other
# demuxers read playlists, scripts and image sequences that name files outside the bytes.
DEMUXERS = {
    "mp4": "mp4",
    "mov": "mov",
    "m4v": "mp4",
    "mkv": "matroska",
    "webm": "matroska",
    "avi": "avi",
}
# What bytes without an extension are tried as, in turn, and the extension each is stored as.
_UNNAMED = (("mp4", "mp4"), ("matroska", "mkv"), ("avi", "avi"))
# No protocol is allowed: whatever a demuxer would open beside the bytes (an MP4's external
# data references, ...) is refused. The list names no protocol FFmpeg has.
_CONTAINER_OPTIONS = {"protocol_whitelist": "none"}
# Opening a container decodes a few frames to learn what its headers leave open (H.264's
# frame delay): none is decoded before its size is checked (a forged 16000x16000 header cost
# 715 MB just to open). The decoder that reads the frames later is another, without it.
_STREAM_OPTIONS = {"skip_frame": "all"}
# frames x width x height a video may state: a 4K clip (3840x2160) of 30 s at 60 fps is
# 1.5e10, an hour of 720p at 30 fps 1.0e11.
MAX_VIDEO_PIXELS = 10**11
# FFmpeg's decode threads for one video: one per worker, which already has a core of its own.
VIDEO_THREADS = 1


def av_module() -> Any:
    try:
        import av
    except ImportError as e:  # pragma: no cover - the test environment has it
        raise ImportError("video needs PyAV: pip install 'wdsvlm[video]' (or av)") from e
    return av


def open_container(data: bytes, ext: str) -> Any:
    """The container of ``data`` stored as ``ext``, opened with that extension's demuxer."""
    av = av_module()
    demuxer = DEMUXERS.get(ext)
    if demuxer is None:
        raise UnreadableVideo(f"stored as .{ext}: videos are opened only as {', '.join(DEMUXERS)}")
    try:
        container = av.open(
            io.BytesIO(data),
            mode="r",
            format=demuxer,
            options=_STREAM_OPTIONS,
            container_options=_CONTAINER_OPTIONS,
        )
    except (av.FFmpegError, ValueError) as e:
        reason = getattr(e, "strerror", None) or e
        raise UnreadableVideo(f"not a .{ext} video FFmpeg can open ({reason})") from e
    if not container.streams.video:
        container.close()
        raise UnreadableVideo("no video stream")
    return container


def open_unnamed(data: bytes) -> tuple[Any, str]:
    """The container of bytes that come without an extension, and the extension to store them
    as: the first of ``_UNNAMED`` whose demuxer opens them."""
    reasons = []
    for demuxer, ext in _UNNAMED:
        try:
            return open_container(data, ext), ext
        except UnreadableVideo as e:
            reasons.append(f"{demuxer}: {e}")
    raise UnreadableVideo(f"not a video of the containers wdsvlm opens ({'; '.join(reasons)})")


def check_pixels(frames: int, width: int, height: int, max_pixels: int) -> None:
    """Refuse (``VideoTooLarge``) a video of ``frames`` of ``width`` x ``height`` over
    ``max_pixels`` in all, or whose frame is over Pillow's bound for one image (twice
    ``PIL.Image.MAX_IMAGE_PIXELS``, where Pillow refuses an image as a decompression bomb)."""
    from PIL import Image

    if Image.MAX_IMAGE_PIXELS and width * height > 2 * Image.MAX_IMAGE_PIXELS:
        raise VideoTooLarge(
            f"its frames are {width}x{height}, over Pillow's bound for one image "
            f"({2 * Image.MAX_IMAGE_PIXELS} pixels, PIL.Image.MAX_IMAGE_PIXELS x 2)"
        )
    if frames * width * height > max_pixels:
        raise VideoTooLarge(
            f"{frames} frames of {width}x{height} are {frames * width * height} pixels, over "
            f"max_video_pixels ({max_pixels})"
        )


def header_size(container: Any) -> tuple[int, int, int]:
    """``(frames, width, height)`` of the first video stream as its headers state them."""
    stream = container.streams.video[0]
    context = stream.codec_context
    width = max(int(stream.width or 0), int(getattr(context, "width", 0) or 0))
    height = max(int(stream.height or 0), int(getattr(context, "height", 0) or 0))
    return int(stream.frames or 0), width, height
