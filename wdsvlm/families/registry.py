"""Which Hugging Face processors wdsvlm supports, and the family object that serves each.

Pass ``processor=`` to the Loader and its family's conventions replace the default tiling:
Qwen2-VL, Qwen2.5-VL and Qwen3-VL (``qwen.py``: dynamic resolution, flattened patches, mRoPE
positions), SmolVLM / Idefics3 (``smolvlm.py``: tiles and a global image) and LLaVA-OneVision
(``llava_onevision.py``: anyres crops, unpadded features and a newline per row).
"""

from __future__ import annotations

import os
from functools import cache
from importlib import import_module
from typing import Any

# processor class -> (module, family class); checked along the processor's class hierarchy
SUPPORTED = {
    "Qwen2VLProcessor": ("qwen", "QwenFamily"),
    "Qwen2_5_VLProcessor": ("qwen", "QwenFamily"),
    "Qwen3VLProcessor": ("qwen", "QwenFamily"),
    "SmolVLMProcessor": ("smolvlm", "SmolVLMFamily"),
    "Idefics3Processor": ("smolvlm", "SmolVLMFamily"),
    "LlavaOnevisionProcessor": ("llava_onevision", "LlavaOnevisionFamily"),
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
    classes = {_family_class(*where) for where in SUPPORTED.values()}
    return {name: cls for cls in classes for name in cls.names}


def family_class(name: Any) -> type | None:
    """The family class of a batch's ``family`` name (each class lists the names it gives);
    None for another name, or none."""
    return _by_name().get(name)


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
