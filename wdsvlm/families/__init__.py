"""Model families behind one interface (``base.Family``): the default tiling, Qwen2/2.5/3-VL,
SmolVLM/Idefics3; the processor registry and ``model_inputs``."""

from ..lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(globals(), {"family_of": ".registry"})

__all__ = ["family_of"]
