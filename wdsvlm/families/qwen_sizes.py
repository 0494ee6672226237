"""The sizes the Qwen2/2.5/3-VL processors resize to: an image or a video frame
(``smart_resize``, Qwen2-VL's, which bounds one picture's pixels) and a video's frames under
Qwen3-VL (``smart_resize_video``, which bounds the pixels of all its frames together)."""

from __future__ import annotations

import math

from ..format.images import UnusableImage


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """``(height, width)`` the Qwen processors resize an image to: multiples of ``factor``,
    an area within ``[min_pixels, max_pixels]``, the aspect ratio kept as closely as may be."""
    if max(height, width) / min(height, width) > 200:
        raise UnusableImage(
            f"an image of {width}x{height} has an aspect ratio over 200, which the Qwen "
            "processors refuse"
        )
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def smart_resize_video(
    frames: int,
    height: int,
    width: int,
    temporal: int,
    factor: int,
    min_pixels: int,
    max_pixels: int,
) -> tuple[int, int]:
    """Qwen3-VL's: the video's pixels (frames rounded to the temporal patch x height x width)
    within ``[min_pixels, max_pixels]``."""
    if frames < temporal:
        raise ValueError(f"{frames} frames, fewer than the temporal patch of {temporal}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"a video of {width}x{height} has an aspect ratio over 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(frames / temporal) * temporal
    if t * h * w > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w
