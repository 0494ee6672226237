"""Progress bars for long work in the main process: tqdm, off when asked and always off inside
DataLoader workers (where several bars would fight over one terminal)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


def in_worker() -> bool:
    """Whether this runs inside a torch DataLoader worker process."""
    data = sys.modules.get("torch.utils.data")  # not imported: not a worker (and no import)
    return data is not None and data.get_worker_info() is not None


def progress(iterable: Iterable | None = None, *, enabled: bool = True, **kwargs: Any):
    """``tqdm(iterable, **kwargs)``, disabled unless ``enabled`` and outside DataLoader
    workers. Also a context manager for manual ``update()``."""
    from tqdm.auto import tqdm

    return tqdm(iterable, disable=not enabled or in_worker(), **kwargs)
