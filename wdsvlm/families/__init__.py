"""Model families: the default tiling, Qwen2/2.5/3-VL, SmolVLM/Idefics3, model_inputs."""

from ..lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(globals(), {"family_of": ".processors"})

__all__ = ["family_of"]
