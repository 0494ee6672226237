"""Tiny, randomly initialised Hugging Face processors and models of the VLM families wdsvlm
supports, built offline.

Tests, the demo training script and benchmarks need a real processor (the family's chat
template, special tokens, image preprocessing and placeholder expansion) and a real model
class to run forward, but must not download checkpoints. Everything here is made from the
byte-level BPE tokenizer shipped with this package (``tokenizer.py``: the one trained on
``shards_example``), the family's published chat template (``qwen.py``, ``smolvlm.py``) and
config classes shrunk to a few thousand parameters per layer (``text_model.py``). Images are
made small (a few dozen image tokens) so that a forward pass takes milliseconds.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import PreTrainedModel, ProcessorMixin

from .. import compat
from .llava_onevision import onevision_model_config, onevision_processor
from .qwen import qwen_model_config, qwen_processor
from .smolvlm import smol_model_config, smol_processor

__all__ = ["FAMILIES", "tiny_model", "tiny_processor"]

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "smolvlm", "idefics3", "llava_onevision")


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")


def tiny_processor(family: str, backend: str = "pil", **image_kwargs: Any) -> ProcessorMixin:
    """The family's processor over a small tokenizer and small images.

    ``backend``: the image processor's, ``"pil"`` (``...ImageProcessorPil``) or
    ``"torchvision"`` (what ``AutoProcessor`` gives where torchvision is installed).
    ``image_kwargs`` override the image processor's settings (e.g. ``max_pixels`` for Qwen,
    ``max_image_size={"longest_edge": 128}`` and ``size={"longest_edge": 512}`` for SmolVLM).
    """
    _check_family(family)
    if backend not in ("pil", "torchvision"):
        raise ValueError(f"backend {backend!r}: 'pil' or 'torchvision'")
    processor = (
        qwen_processor(family, **image_kwargs)
        if family.startswith("qwen")
        else onevision_processor(**image_kwargs)
        if family == "llava_onevision"
        else smol_processor(family, **image_kwargs)
    )
    if backend == "torchvision":  # the same settings on the torchvision-backed class
        pil = processor.image_processor
        cls = getattr(transformers, type(pil).__name__.removesuffix("Pil"))
        processor.image_processor = cls(**pil.to_dict())
    return processor


def tiny_model(
    family: str, processor: ProcessorMixin | None = None, *, seed: int = 0
) -> PreTrainedModel:
    """A randomly initialised float32 model of the family that accepts ``processor``'s output.

    ``processor`` defaults to ``tiny_processor(family)``; the vocabulary, special token ids and
    the vision tower's patch, merge and tile sizes are read from it. Attention is SDPA, which
    (like eager) masks packed rows by their restarting position ids when no attention mask is
    given; Qwen models need their position ids as ``[4, batch, length]`` for that, the text
    positions first (otherwise transformers builds no packed mask).
    """
    _check_family(family)
    processor = tiny_processor(family) if processor is None else processor
    if family == "llava_onevision":
        config, model_cls = onevision_model_config(processor)
    else:
        model_config = qwen_model_config if family.startswith("qwen") else smol_model_config
        config, model_cls = model_config(family, processor)
    torch.manual_seed(seed)
    return compat.model_from_config(
        model_cls, config, attn_implementation="sdpa", dtype=torch.float32
    )
