"""Names a package exports without importing the modules that define them until first use
(PEP 562): ``import wdsvlm`` and ``import wdsvlm.pipeline`` stay cheap and torch-free, and a
subpackage's ``__init__`` imports nothing that could import it back."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def lazy_exports(
    namespace: dict[str, Any], homes: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for ``homes``: each exported name and the
    module (relative to the package) that defines it. ``namespace`` is the package's
    ``globals()``; a name, once imported, is kept there."""
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(import_module(homes[name], package), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *homes})

    return __getattr__, __dir__
