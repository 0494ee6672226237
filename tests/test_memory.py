"""The shared memory a DataLoader worker makes a batch's tiles in (wdsvlm/pipeline/memory.py)."""

import os
import re
import sys

import torch

from wdsvlm.pipeline.memory import populate, shared_uint8

TILE = 64


def resident_kib(address: int) -> int:
    """Kilobytes of the mapping that holds ``address`` that this process has mapped in."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span[1], 16) <= address < int(span[2], 16)
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def kernel_populates() -> bool:
    """MADV_POPULATE_WRITE came in Linux 5.14."""
    if sys.platform != "linux":
        return False
    major, minor = (int(p) for p in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    return (major, minor) >= (5, 14)


def test_a_shared_tile_tensor_has_its_pages_mapped_before_a_byte_is_written():
    """The pages are mapped in one call, not faulted in one at a time as the tiles' planes
    are written (where the kernel can: Linux 5.14 and later)."""
    tiles = shared_uint8((40, 3, TILE, TILE))
    nbytes = 40 * 3 * TILE * TILE
    assert tiles.is_shared() and tiles.is_contiguous() and tiles.dtype == torch.uint8
    assert tiles.shape == (40, 3, TILE, TILE)
    mapped = resident_kib(tiles.data_ptr())
    if kernel_populates():
        assert mapped * 1024 >= nbytes
    else:
        assert mapped * 1024 < nbytes
    tiles.copy_(torch.arange(tiles.numel(), dtype=torch.int64).view(tiles.shape) % 251)
    assert int(tiles.view(-1)[-1]) == (tiles.numel() - 1) % 251


def test_a_fresh_private_mapping_is_populated_and_says_so():
    """populate() maps the range it is given, page-aligned or not, and reports it."""
    import mmap

    area = mmap.mmap(-1, 64 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(area)
    address = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    assert resident_kib(address) == 0
    assert populate(address + 100, 32 * mmap.PAGESIZE) == kernel_populates()
    if kernel_populates():  # the pages the range touches: 33, from the one it starts in
        assert resident_kib(address) * 1024 == 33 * mmap.PAGESIZE
    del view
    area.close()


def test_an_empty_shared_tile_tensor():
    tiles = shared_uint8((0, 3, TILE, TILE))
    assert tiles.shape == (0, 3, TILE, TILE) and tiles.numel() == 0
