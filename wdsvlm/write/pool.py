"""The process pool the writer and ``wdsvlm index`` spread their work over."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def process_pool(workers: int) -> Iterator[Any]:
    """A process pool for ``workers`` > 1, else None (work runs in this process)."""
    if workers == 1:
        yield None
        return
    # spawn: safe whatever threads the caller has running (fork with threads can deadlock)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        yield pool
