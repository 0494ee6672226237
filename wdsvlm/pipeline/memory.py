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

- ``private_uint8``: in the process that trains (0 workers, the first batch made while workers
  start, Ray actors).
- ``shared_uint8``: in a DataLoader worker, so that the batch crosses to the training process
  without a copy.

Huge pages (``MADV_HUGEPAGE``) were tried for the private memory too: faster in a loop that only
writes tiles, slower in the Loader (the kernel assembling 2 MiB pages amid the decoder's
allocations), so not made.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from typing import Any

MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14

_libc: list = []  # loaded once, where there is one


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
    # made in shared memory at once: share_memory_() on a private tensor would fault in and
    # copy a private buffer first
    storage = torch.UntypedStorage._new_shared(nbytes)
    tensor = torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)
    if nbytes:
        populate(tensor.data_ptr(), nbytes)
    return tensor


def populate(address: int, nbytes: int) -> bool:
    """Map the pages of ``[address, address + nbytes)`` for writing in one call; whether the
    kernel did (it cannot before Linux 5.14, nor off Linux: the pages then fault in as
    written)."""
    c = libc()
    if c is None:
        return False
    start = address - address % mmap.PAGESIZE
    return c.madvise(start, address + nbytes - start, MADV_POPULATE_WRITE) == 0


def libc() -> Any:
    """The C library, loaded once (Linux; ``madvise`` typed for ``populate``), or None where
    there is none to call."""
    if not _libc:
        found = None
        if sys.platform == "linux":
            try:
                found = ctypes.CDLL(None, use_errno=True)
                found.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                found.madvise.restype = ctypes.c_int
            except (OSError, AttributeError):  # no C library to call: pages fault in as written
                found = None
        _libc.append(found)
    return _libc[0]
