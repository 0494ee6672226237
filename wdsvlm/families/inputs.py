"""A batch of a processor's family to the model's forward arguments (``model_inputs``), with
its uint8 units normalised on the device (``normalise``) as the processor would."""

from __future__ import annotations

from typing import Any

from .registry import family_class


def _rescale_then_normalise(x, divisor, mean, std):
    return x.div_(divisor).sub_(mean).div_(std)


def _fused(x, divisor, mean, std):  # the torchvision processors fold the rescale in
    return x.sub_(mean * divisor).div_(std * divisor)


_FORMULAS = (_rescale_then_normalise, _fused)
_exact_formula: dict[tuple, Any] = {}  # (device, affine) -> the formula equal to the table


def normalise(units, table, affine=None, dtype=None, out=None):
    """uint8 units ``[N, 3, S, S]`` to the processor's normalised values (float32), on their
    device; written into ``out`` (float32, that shape, any strides) when given.

    The table (``hf_processor.pixel_table``) is the truth. Arithmetic on ``affine``
    (``hf_processor.pixel_affine``) is used instead where, checked once per device on all 256
    values of each channel, it gives exactly the table's values: it is about three times as
    fast as the lookup.
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
    cls = family_class(batch.get("family"))
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
    videos = batch.get("video_pixels")
    if videos is not None and len(videos):
        table, affine = batch["video_table"], batch.get("video_affine")

        def normalised_videos(units, out=None):
            return normalise(units, table, affine, out=out)

        moved = {k: move(batch[k]) for k in cls.video_device_fields if k in batch}
        # (a family whose model takes the frames with the images gets the images' fields)
        fields = cls.video_model_fields({**batch, **moved}, move(videos), normalised_videos, out)
        for key in ("pixel_values_videos", "pixel_values"):
            if dtype is not None and key in fields:
                fields[key] = fields[key].to(dtype)
        out.update(fields)
    return out
