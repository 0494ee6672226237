"""The shard cache's file layout and locks (``cache.ShardCache``): a shard's file holds its
bytes at their own offsets, then a map of one byte per ``BLOCK`` bytes of it (1: the block is
on disk), then a flag byte (1: the whole shard was checked against its sha256); byte ranges of
the map are locked while their blocks are fetched."""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from collections.abc import Iterator

PIECE = 2**20  # bytes read at a time to check a whole shard's map or sha256
BLOCK = 512  # bytes a map byte stands for: a tar record, so a tar's spans are whole blocks

# The cache's descriptors this process has open. A child forked meanwhile (a reader thread of
# this process holds one, maybe locked, for a moment) closes its copies at once: a lock held
# by a child for its whole life would stop every process sharing the cache.
OPEN: set[int] = set()

# Locks of an open file description (Linux): held by the descriptor, not the process, so the
# threads of a process exclude one another too, and closing another descriptor of the file
# does not drop them. Elsewhere, ``flock`` on the whole file (also one a description).
_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", None)
_FLOCK = "hhqqi4x"  # struct flock: l_type, l_whence, l_start, l_len, l_pid


def blocks(size: int) -> int:
    """Blocks of a shard of ``size`` bytes (the last one may be short)."""
    return -(-size // BLOCK)


def file_bytes(size: int) -> int:
    """Bytes of the cache's file of a shard of ``size`` bytes: the shard, its map, its flag."""
    return size + blocks(size) + 1


def shard_bytes(held: int) -> int:
    """The shard's size from its file's (``file_bytes`` inverted); an older release's file of
    the shard alone counts as it is."""
    guess = max(0, (held - 1) * BLOCK // (BLOCK + 1))
    for size in range(max(0, guess - 2), guess + 3):
        if file_bytes(size) == held:
            return size
    return held


def missing_runs(marks: bytes, first: int) -> Iterator[tuple[int, int]]:
    """``(first block, block past the last)`` of each run of missing blocks in ``marks`` (the
    map's bytes from block ``first`` on)."""
    at = marks.find(b"\0")
    while at >= 0:
        end = at
        while end < len(marks) and marks[end] == 0:
            end += 1
        yield first + at, first + end
        at = marks.find(b"\0", end)


def all_there(fd: int, size: int) -> bool:
    """Whether every block of the shard is marked (the map read a piece at a time, up to its
    first missing block)."""
    for at in range(0, blocks(size), PIECE):
        if b"\0" in os.pread(fd, min(PIECE, blocks(size) - at), size + at):
            return False
    return True


def pread(fd: int, length: int, at: int) -> bytes:
    data = os.pread(fd, length, at)
    if len(data) != length:  # never: the file has the shard's full size
        raise OSError(f"short read of the cache: {len(data)} of {length} bytes at {at}")
    return data


def pwrite(fd: int, data: bytes, at: int) -> None:
    view = memoryview(data)
    while view:  # a write may be short (a nearly full disk): no hole left behind
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written


@contextlib.contextmanager
def range_locked(fd: int, start: int, length: int) -> Iterator[None]:
    """Bytes ``[start, start + length)`` of ``fd``'s file locked (exclusive, waiting) while in
    the block; the kernel drops the lock if the process dies."""
    if _OFD_SETLKW is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
        return
    fcntl.fcntl(fd, _OFD_SETLKW, struct.pack(_FLOCK, fcntl.F_WRLCK, os.SEEK_SET, start, length, 0))
    try:
        yield
    finally:
        fcntl.fcntl(
            fd, _OFD_SETLKW, struct.pack(_FLOCK, fcntl.F_UNLCK, os.SEEK_SET, start, length, 0)
        )


def _close_open_in_child() -> None:
    for fd in list(OPEN):
        try:
            os.close(fd)
        except OSError:
            pass
    OPEN.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_open_in_child)
