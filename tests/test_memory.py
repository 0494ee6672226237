"""The memory a batch's tiles are made in, its pages mapped before the tiles are written
(wdsvlm/pipeline/memory.py)."""

import ctypes
import mmap
import os
import re
import sys

import pytest
import torch

from wdsvlm.pipeline.memory import populate, private_uint8, shared_uint8

TILE = 64


def resident_pages(address: int, nbytes: int) -> tuple[int, int]:
    """(resident, all) pages of ``[address, address + nbytes)``, by ``mincore``: exactly that
    range, whatever mapping (or mappings) it lies in."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    start = address - address % mmap.PAGESIZE
    pages = -(-(address + nbytes - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, pages * mmap.PAGESIZE, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), pages


def kernel_populates() -> bool:
    """MADV_POPULATE_WRITE came in Linux 5.14."""
    if sys.platform != "linux":
        return False
    major, minor = (int(p) for p in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    return (major, minor) >= (5, 14)


@pytest.mark.parametrize(
    "make, tiles, tile",
    # private: large enough for a mapping of its own when the allocator has no free memory of
    # that size (glibc maps 32 MiB and more apart); or else already resident
    [(shared_uint8, 40, TILE), (private_uint8, 50, 512)],
    ids=["shared (a worker)", "private (the training process)"],
)
def test_a_tile_tensor_has_its_pages_mapped_before_a_byte_is_written(make, tiles, tile):
    """The pages are mapped in one call, not faulted in one at a time as the tiles' planes
    are written (where the kernel can: Linux 5.14 and later)."""
    out = make((tiles, 3, tile, tile))
    nbytes = tiles * 3 * tile * tile
    assert out.is_shared() == (make is shared_uint8)
    assert out.is_contiguous() and out.dtype == torch.uint8 and out.shape == (tiles, 3, tile, tile)
    resident, pages = resident_pages(out.data_ptr(), nbytes)
    if kernel_populates():
        assert resident == pages
    elif make is shared_uint8:  # a fresh segment: nothing mapped until written
        assert resident == 0
    out.view(-1).copy_(torch.arange(nbytes, dtype=torch.int64) % 251)
    assert int(out.view(-1)[-1]) == (nbytes - 1) % 251


def test_a_fresh_private_mapping_is_populated_and_says_so():
    """populate() maps the range it is given, page-aligned or not, and reports it."""
    area = mmap.mmap(-1, 64 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(area)
    address = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    assert resident_pages(address, 64 * mmap.PAGESIZE) == (0, 64)
    assert populate(address + 100, 32 * mmap.PAGESIZE) == kernel_populates()
    if kernel_populates():  # the pages the range touches: 33, from the one it starts in
        assert resident_pages(address, 64 * mmap.PAGESIZE) == (33, 64)
        assert resident_pages(address + 100, 32 * mmap.PAGESIZE) == (33, 33)
    del view
    area.close()


@pytest.mark.parametrize("make", [shared_uint8, private_uint8])
def test_an_empty_tile_tensor(make):
    tiles = make((0, 3, TILE, TILE))
    assert tiles.shape == (0, 3, TILE, TILE) and tiles.numel() == 0
