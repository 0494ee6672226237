"""Memory for a batch's tiles, its pages mapped before the tiles are written.

A batch's tiles (tens to hundreds of MB) go into memory made afresh for every batch: none of it
can be reused, since the training process holds a batch as long as it likes. Every page is then
touched for the first time while the tiles are written, and the tiles' three planes are written
side by side, three pages faulting in turn, one fault per 4 KiB: in the Loader with 0 workers
that cost more than a tenth of its time. Mapping the pages in one call first
(``MADV_POPULATE_WRITE``, Linux 5.14 and later) does the same work in the kernel in one sweep:
writing 128 tiles of 512 px took 45-47 ms instead of 67-71 in private memory, 75-82 instead of
94-102 in shared memory (docs/performance.md, "Fresh memory for the tiles"). Where the kernel
cannot, the pages fault in as they are written, as before.

- ``private_uint8``: in the process that trains (0 workers) and in Ray actors.
- ``shared_uint8``: in a DataLoader worker, so that the batch crosses to the training process
  without a copy.

Huge pages (``MADV_HUGEPAGE``) were tried for the private memory too: faster in a loop that only
writes tiles, slower in the Loader (the kernel assembling 2 MiB pages amid the decoder's
allocations), so not made.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
from typing import Any

from .. import compat

log = logging.getLogger("wdsvlm.memory")

MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14

_refused: list[int] = []  # the errno of the first refusal, logged once


def private_uint8(shape: tuple[int, ...]) -> Any:
    """An uninitialised uint8 tensor of ``shape``, its pages mapped."""
    import torch

    tensor = torch.empty(shape, dtype=torch.uint8)
    if tensor.numel():
        populate(tensor.data_ptr(), tensor.numel())
    return tensor


def shared_uint8(shape: tuple[int, ...]) -> Any:
    """An uninitialised uint8 tensor of ``shape`` in shared memory, its pages mapped."""
    import torch

    nbytes = math.prod(shape)
    storage = compat.new_shared_storage(nbytes)
    tensor = torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)
    if nbytes:
        populate(tensor.data_ptr(), nbytes)
    return tensor


def populate(address: int, nbytes: int) -> bool:
    """Map the pages of ``[address, address + nbytes)`` for writing in one call; whether the
    kernel did (it cannot before Linux 5.14, nor off Linux: the pages then fault in as
    written; the first refusal is logged, once)."""
    c = compat.libc()
    if c is None:
        return False
    start = address - address % mmap.PAGESIZE
    if c.madvise(start, address + nbytes - start, MADV_POPULATE_WRITE) == 0:
        return True
    if not _refused:
        _refused.append(ctypes.get_errno())
        log.info(
            "the kernel did not map pages ahead (madvise MADV_POPULATE_WRITE: %s); "
            "they fault in as written",
            os.strerror(_refused[0]),
        )
    return False
