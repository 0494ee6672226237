"""Model families: a Hugging Face processor decides how images become tokens and pixels.

Pass ``processor=`` to the Loader and its family's conventions replace the default tiling:
Qwen2-VL, Qwen2.5-VL and Qwen3-VL (``qwen.py``: dynamic resolution, flattened patches, mRoPE
positions) and SmolVLM / Idefics3 (``smolvlm.py``: tiles and a global image). Every number
(sizes, patch and merge sizes, tokens per image, resample, mean and std, the chat template,
the special tokens) is read from the processor object, never from a model's defaults.

A family answers, from an image's size alone, how many image tokens it becomes (the ids that
replace its placeholder) and how many vision units it costs (patches or tiles: the vision
budget of a pack), so packing stays on index metadata. At decode time it writes the image as
compact uint8 units ``[cost, 3, S, S]`` (before rescale and normalisation); ``model_inputs``
normalises them on the device through a 256-entry table per channel made by the processor's
own rescale and normalise, which is exact because both are per-pixel.
"""

from __future__ import annotations

import os
from functools import cache
from importlib import import_module
from typing import Any

import numpy as np

from ..format.conversation import IMAGE_MARKER
from ..pipeline.images import decode_each, open_image

# processor class -> (module, family class); checked along the processor's class hierarchy
SUPPORTED = {
    "Qwen2VLProcessor": ("qwen", "QwenFamily"),
    "Qwen2_5_VLProcessor": ("qwen", "QwenFamily"),
    "Qwen3VLProcessor": ("qwen", "QwenFamily"),
    "SmolVLMProcessor": ("smolvlm", "SmolVLMFamily"),
    "Idefics3Processor": ("smolvlm", "SmolVLMFamily"),
}


def load_processor(processor: Any) -> Any:
    """A Hugging Face processor object as is, or one loaded by name or path."""
    if not isinstance(processor, (str, os.PathLike)):
        return processor
    from transformers import AutoProcessor

    name = str(processor)
    try:
        return AutoProcessor.from_pretrained(name)
    except (OSError, ValueError, ImportError) as e:
        raise ValueError(f"cannot load the processor {name!r}: {e}") from None


def _family_class(module: str, name: str) -> type:
    return getattr(import_module(f".{module}", __package__), name)


@cache
def _by_name() -> dict[str, type]:
    """batch["family"] -> its family class (each class lists the names it gives)."""
    classes = {_family_class(*where) for where in SUPPORTED.values()}
    return {name: cls for cls in classes for name in cls.names}


def family_of(processor: Any):
    """The family object for a processor (object, name or path); an unsupported one is
    refused, listing the supported processor classes."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise ValueError(
            f"processor= needs transformers 5 or later (this is {transformers.__version__}): "
            "pip install -U transformers"
        )
    processor = load_processor(processor)
    for cls in type(processor).__mro__:
        if cls.__name__ in SUPPORTED:
            return _family_class(*SUPPORTED[cls.__name__])(processor)
    raise ValueError(
        f"wdsvlm does not support the processor {type(processor).__name__}: supported are "
        f"{', '.join(SUPPORTED)} (or pass tokenizer= for the default tiling)"
    )


def content_items(text: str) -> list[dict]:
    """A stored message's content as a content list: each ``<image>`` marker an image item at
    its place, the text around it text items; a newline right after a marker is dropped
    (the marker stood on a line of its own). Empty content is one empty text item."""
    items: list[dict] = []
    parts = text.split(IMAGE_MARKER)
    for n, part in enumerate(parts):
        if n > 0:
            items.append({"type": "image"})
            if part.startswith("\n"):
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


def _rescale_then_normalise(x, divisor, mean, std):
    return x.div_(divisor).sub_(mean).div_(std)


def _fused(x, divisor, mean, std):  # the torchvision processors fold the rescale in
    return x.sub_(mean * divisor).div_(std * divisor)


_FORMULAS = (_rescale_then_normalise, _fused)
_exact_formula: dict[tuple, Any] = {}  # (device, affine) -> the formula equal to the table


def normalise(units, table, affine=None, dtype=None, out=None):
    """uint8 units ``[N, 3, S, S]`` to the processor's normalised values (float32), on their
    device; written into ``out`` (float32, that shape, any strides) when given.

    The table (``pixel_table``) is the truth. Arithmetic on ``affine`` (``pixel_affine``)
    is used instead where, checked once per device on all 256 values of each channel, it
    gives exactly the table's values: it is about three times as fast as the lookup.
    """
    import torch

    device = units.device
    formula = None
    if affine is not None:
        key = (str(device), affine.cpu().numpy().tobytes(), table.cpu().numpy().tobytes())
        if key not in _exact_formula:
            _exact_formula[key] = _pick_formula(table.to(device), affine.to(device))
        formula = _exact_formula[key]
    if formula is None:
        table = table.to(device)
        channel = torch.arange(3, device=device).view(1, 3, 1, 1)
        values = table[channel, units.long()]
        if out is not None:
            values = out.copy_(values)
    else:
        divisor, mean, std = (a.to(device).view(1, 3, 1, 1) for a in affine)
        values = units.to(torch.float32) if out is None else out.copy_(units)
        values = formula(values, divisor, mean, std)
    return values if dtype is None else values.to(dtype)


def _pick_formula(table, affine):
    import torch

    values = torch.arange(256, device=table.device, dtype=torch.float32).expand(1, 3, 1, 256)
    divisor, mean, std = (a.view(1, 3, 1, 1) for a in affine)
    for formula in _FORMULAS:
        if torch.equal(formula(values.clone(), divisor, mean, std).view(3, 256), table):
            return formula
    return None


def decode_units(sample: dict, family: Any, out: Any) -> None:
    """Decode a sample's images into ``out``: the family's units, one image after another."""
    decode_each(
        sample,
        out,
        family.image_cost,
        lambda data, size, part: family.image_units(open_image(data, size), part),
    )


def model_inputs(
    batch: dict, device: Any = None, dtype: Any = None, non_blocking: bool = False
) -> dict:
    """The keyword arguments of the family's ``forward`` for a batch of a Loader made with
    ``processor=``: ``model(**wdsvlm.model_inputs(batch, device="cuda", dtype=torch.bfloat16))``.

    Pixels are normalised on ``device`` (and cast to ``dtype``). Packed rows stay isolated:
    no 2-D ``attention_mask`` is passed (transformers then finds the packed samples from
    ``position_ids``) and ``use_cache=False`` (a cache would let packed samples attend to
    each other).
    """
    cls = _by_name().get(batch.get("family"))
    if cls is None:
        raise ValueError(
            "model_inputs takes the batches of a Loader made with processor= (this batch has "
            "no model family); for the default tiling use input_ids, labels, position_ids "
            "and pixel_values as they are"
        )

    def move(t):
        return t.to(device, non_blocking=non_blocking) if device is not None else t

    out = {
        "input_ids": move(batch["input_ids"]),
        "labels": move(batch["labels"]),
        "position_ids": move(batch["position_ids"]),
        "use_cache": False,
    }
    units = batch["pixel_values"]
    if len(units):
        table, affine = batch["pixel_table"], batch.get("pixel_affine")

        def normalised(units, out=None):
            return normalise(units, table, affine, out=out)

        moved = {k: move(batch[k]) for k in cls.device_fields}
        fields = cls.model_fields({**batch, **moved}, move(units), normalised)
        if dtype is not None:
            fields["pixel_values"] = fields["pixel_values"].to(dtype)
        out.update(fields)
    return out
