"""What the families of a Hugging Face processor share (``qwen.py``, ``smolvlm.py``).

Every number (sizes, patch and merge sizes, tokens per image, resample, mean and std, the chat
template, the special tokens) is read from the processor object, never from a model's
defaults. The conversation is rendered with the processor's chat template as content lists
(each ``<image>`` marker an image item). Images are decoded into compact uint8 units
(before rescale and normalisation); ``model_inputs`` normalises them on the device through a
256-entry table per channel made by the processor's own rescale and normalise
(``pixel_table``), which is exact because both are per-pixel.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from ..format.conversation import IMAGE_MARKER, VIDEO_MARKER
from ..format.images import open_image
from .base import Edit, decode_each

_MARKERS = re.compile(f"({re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)})")
# Image sizes whose costs and token ids stand for a processor's settings in a fingerprint.
_PROBE_SIZES = [(1, 1), (64, 48), (640, 480), (300, 1700), (1600, 900)]


def content_items(text: str) -> list[dict]:
    """A stored message's content as a content list: each ``<image>`` or ``<video>`` marker an
    image or video item at its place, the text around it text items; a newline right after a
    marker is dropped (the marker stood on a line of its own). Empty content is one empty
    text item."""
    items: list[dict] = []
    for n, part in enumerate(_MARKERS.split(text)):
        if n % 2:
            items.append({"type": "image" if part == IMAGE_MARKER else "video"})
            continue
        if n > 0 and part.startswith("\n"):
            part = part[1:]
        if part:
            items.append({"type": "text", "text": part})
    return items or [{"type": "text", "text": ""}]  # an empty answer is still an answer


def conversation(messages: list[dict]) -> list[dict]:
    """Stored messages (string content with ``<image>`` markers) as the content lists that
    processors' chat templates take."""
    return [{"role": m["role"], "content": content_items(m["content"])} for m in messages]


def pixel_table(image_processor: Any):
    """``[3, 256]`` float32: what the processor's own rescale and normalise make of each uint8
    value in each channel. Both are per-pixel, so looking pixels up in it equals running
    them on the whole image, bit for bit."""
    import torch

    ip = image_processor
    values = np.tile(np.arange(256, dtype=np.uint8), (3, 1))[:, None, :]  # [3, 1, 256]
    if getattr(ip, "backend", "pil") == "torchvision":
        x = ip.rescale_and_normalize(
            torch.from_numpy(values)[None],
            ip.do_rescale,
            ip.rescale_factor,
            ip.do_normalize,
            ip.image_mean,
            ip.image_std,
        )[0]
    else:
        x = values
        if ip.do_rescale:
            x = ip.rescale(x, ip.rescale_factor)
        if ip.do_normalize:
            x = ip.normalize(x, ip.image_mean, ip.image_std)
    return torch.as_tensor(np.asarray(x, dtype=np.float32)).reshape(3, 256).contiguous()


def pixel_affine(image_processor: Any):
    """``[3, 3]`` float32: the processor's divisor (1 / rescale factor), mean and std per
    channel, for the arithmetic ``normalise`` uses where it gives the table's values."""
    import torch

    ip = image_processor
    divisor = 1 / ip.rescale_factor if ip.do_rescale else 1.0
    mean = ip.image_mean if ip.do_normalize else 0.0
    std = ip.image_std if ip.do_normalize else 1.0
    rows = [np.broadcast_to(np.asarray(v, dtype=np.float64), (3,)) for v in (divisor, mean, std)]
    return torch.tensor(np.stack(rows), dtype=torch.float32)


class ProcessorFamily:
    """The members of the Family interface that every processor's family has alike; a
    subclass sets ``name``, ``names``, ``unit_name``, ``unit_size`` and ``device_fields``
    and gives ``image_cost``, ``image_token_ids``, ``image_units``, ``batch_fields`` and
    ``model_fields``."""

    name: str
    unit_size: int
    video: Any = None  # the family's video side (families.video.ProcessorVideo), if it takes video
    # the tokens put around an image's ids in a document (pipeline/documents.py), where its
    # ids do not hold their own; none by default
    image_wrap: tuple[str, str] = ("", "")
    video_device_fields: tuple[str, ...] = ()  # batch tensors video_model_fields hands on
    no_video = "its processor takes no video in wdsvlm"  # why video is None

    def __init__(self, processor: Any):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.image_processor = processor.image_processor
        self.placeholder: str = processor.image_token

    @property
    def chat_template(self) -> Any:
        return self.processor.chat_template

    @property
    def modules(self) -> tuple[str, ...]:
        return (
            type(self).__module__,
            type(self.processor).__module__,
            type(self.image_processor).__module__,
        )

    def chat_messages(self, messages: list[dict]) -> list[dict]:
        """The messages as content lists (see ``conversation``)."""
        return conversation(messages)

    def fingerprint_facts(self) -> list:
        """The family, its image processor's settings, and the costs and token ids of a few
        image sizes (settings of the processor itself, such as SmolVLM's image_seq_len)."""
        image = self.image_processor.to_dict()
        return [self.name, json.dumps(image, sort_keys=True, default=str)] + [
            [self.image_cost(w, h), self.image_token_ids(w, h).tolist()] for w, h in _PROBE_SIZES
        ]

    def decode(self, sample: dict, out: Any, edit: Edit | None = None) -> None:
        """The sample's images as the family's units, one image after another."""

        def fill(data: bytes, size: Any, part: Any, one: Any) -> None:
            image = open_image(data, size)
            self.image_units(image if one is None else one(image), part)

        decode_each(sample, out, self.image_cost, fill, edit)

    def constant_fields(self) -> dict:
        """The family's name, and the pixel table (and affine) ``model_inputs`` normalises
        with; the video processor's too, where the family takes videos."""
        out = {
            "family": self.name,
            "pixel_table": pixel_table(self.image_processor),
            "pixel_affine": pixel_affine(self.image_processor),
        }
        if self.video is not None:
            out["video_table"] = pixel_table(self.video.vp)
            out["video_affine"] = pixel_affine(self.video.vp)
        return out
