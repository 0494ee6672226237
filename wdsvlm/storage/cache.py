"""A local disk cache of the byte ranges of shards that readers read, bounded in bytes, that
several processes (the ranks and workers of one machine) can share, and that never fetches
more than 1.1 times what reading without it fetches.

A cached shard is named by the sha256 its index records, never by its URL: a shard rewritten
in place (tars are padded to 10 KiB records, so often at the same size) comes with a new
sha256 in its new index and so is cached anew, while readers of the old index keep the old
bytes. A shard whose index records no sha256 is not cached (its bytes could not be told from
a rewrite's): it is read from the store each time.

What it fetches. A pass visits a shard's chunks spread over the whole pass and over all the
ranks and workers of a job (plan version 3): on N nodes a node reads about 1/N of each shard's
chunks a pass. So the cache is filled by the ranges read, never by whole shards. A shard's
file (``<sha256>.tar``) holds the shard's bytes at their own offsets (a sparse file of the
shard's size), then a map of a byte per ``BLOCK`` bytes (1: the block is on disk). A read of
``[start, stop)`` whose blocks are all there is served from disk; otherwise the runs of
missing blocks in it are fetched (with the retries of ``storage.read_range``), written,
marked, and the read served from disk. A fetch is rounded out to whole blocks only where that
adds at most a tenth of the read; otherwise it fetches just the read's bytes, and the blocks
it covers in part stay unmarked. A tar's spans begin and end on its 512-byte records, whole
blocks: a pass fetches through the cache only bytes it would fetch without it (never more
than 1.1 times that for reads of other bounds), and a later pass only the blocks no pass has
brought yet (nothing, once the dataset fits and was read whole).

What it holds. A shard is taken in (its file created at its full size and map: a reservation
counted against ``max_bytes`` by every process) only while it fits beside what the cache holds;
a cached shard is never evicted to make room for another unless no reader has read it for
``idle_seconds``, and a shard that does not fit is read from the store by ranges, uncached.

Errors. The store is asked for a shard's size (one request) before it is taken in: a shard the
store does not have is one ``ObjectNotFoundError`` and evicts nothing; a size other than the
index's is a ``StorageError`` naming it. Once every block of a shard is on disk its sha256 is
checked once (by the process that wrote its last block): a mismatch removes the file and is a
``StorageError`` naming the shard; both are remembered in the process (``bad``) and raised at
once for every later read of it, so it is not fetched again for every span. A shard never
held whole is checked against its size only. Whole shards an older release kept are read.

Processes that share the folder coordinate through locks that the kernel drops when their
process dies, so none is left stale:

- Each fetch locks the map bytes of the blocks it reads (an open file description's
  ``fcntl`` byte-range lock; ``flock`` on the whole file where there are none), then looks
  at the map again: processes that need the same blocks at once fetch them once. A block is
  marked only after its bytes are written, so a reader never takes a block that is not whole;
  a process that dies mid-fetch leaves its blocks unmarked, for the next reader to fetch.
- The bound: ``.lock`` (``flock``) is held briefly while room is made (idle shards evicted)
  and a shard's file is created (in a temporary file, then renamed into place, grown to its
  full size first). So the cached shards never hold more than ``max_bytes`` together. Where no
  room can be made, or the shard is larger than ``max_bytes``, or the disk fails, the range is
  read from the store, uncached.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from ..errors import ObjectNotFoundError, StorageError
from .blocks import (
    BLOCK,
    OPEN,
    PIECE,
    all_there,
    blocks,
    file_bytes,
    missing_runs,
    pread,
    pwrite,
    range_locked,
    shard_bytes,
)
from .fs import ReadPolicy, RequestCounts, object_size, read_range

log = logging.getLogger("wdsvlm.cache")

MORE = 0.1  # a fetch is rounded out to whole blocks where that adds at most this share of the read


class ShardCache:
    """``ShardCache(folder, max_bytes)``: ``read(url, size, start, stop, sha256=...)`` gives
    bytes ``[start, stop)`` of the shard at ``url`` (``size`` bytes long, of that sha256), from
    disk, fetching and keeping first the blocks of it not there yet, while the shard fits;
    ``idle_seconds``: how long a cached shard must have gone unread before it may make room
    for another; ``bad``: the shards found not to match their index in this process (sha256
    -> the error naming the URL)."""

    def __init__(self, folder: str, max_bytes: int = 64 * 2**30, idle_seconds: float = 86400.0):
        if max_bytes < 1:
            raise ValueError(f"the cache's max_bytes must be positive, not {max_bytes}")
        if idle_seconds < 0:
            raise ValueError(f"the cache's idle_seconds must be >= 0, not {idle_seconds}")
        self.folder = folder
        self.max_bytes = max_bytes
        self.idle_seconds = idle_seconds
        self.bad: dict[str, StorageError] = {}
        self._full_until = 0.0  # until then (time.monotonic()), taken as full without a look
        self._gone: dict[str, tuple[float, ObjectNotFoundError]] = {}  # found missing, when
        os.makedirs(folder, exist_ok=True)

    def path(self, sha256: str) -> str:
        """Where the shard of this sha256 (64 hex digits) is kept."""
        if not _SHA256.fullmatch(sha256):
            raise ValueError(f"not a sha256: {sha256!r}")
        return os.path.join(self.folder, f"{sha256.lower()}.tar")

    def read(
        self,
        url: str,
        size: int,
        start: int,
        stop: int,
        storage_options: Mapping[str, Any] | None = None,
        policy: ReadPolicy | None = None,
        *,
        sha256: str | None,
        counts: RequestCounts | None = None,
    ) -> bytes:
        """Bytes ``[start, stop)`` of the shard; ``size`` and ``sha256`` are the index's. With
        no sha256 (or not one of 64 hex digits) the range is read from the store, uncached.
        ``counts``: gets the requests to the store (a size asked, missing blocks) and the
        ranges served with none (``cache_hits``)."""
        if file_bytes(size) > self.max_bytes or not _SHA256.fullmatch(str(sha256)):
            return read_range(url, start, stop, storage_options, policy, None, counts)
        sha256 = sha256.lower()
        if sha256 in self.bad:  # found not to match its index: no second download
            raise StorageError(str(self.bad[sha256]))
        stop = max(start, min(stop, size))
        store = (storage_options, policy, counts)  # how the store is asked
        for _ in range(5):  # another process may evict the file, or rename it into place, under us
            try:
                fd = self._open(url, size, sha256, store)
                if fd is None:  # no room: read as without a cache
                    break
                try:
                    return self._serve(fd, url, size, sha256, start, stop, store)
                finally:
                    _close(fd)
            except ObjectNotFoundError:
                raise  # the store's answer, not a race over the cache's own files
            except FileNotFoundError:
                continue
            except OSError as e:  # a full or broken disk: the cache steps aside
                log.warning("shard cache %s: %s; reading %s from the store", self.folder, e, url)
                break
        return read_range(url, start, stop, storage_options, policy, None, counts)

    def _open(self, url, size, sha256, store) -> int | None:
        """A descriptor of the shard's file, taken in first if it fits; None: no room."""
        path = self.path(sha256)
        fd = _open_file(path, size)
        if fd is not None:
            return fd
        if not self._fits(file_bytes(size)):  # a look without the lock (most reads of a full
            return None  # cache)
        asked = time.monotonic()
        with _admitting[0]:  # one thread of the process asks the store for its size at a time
            gone = self._gone.get(sha256)
            if gone is not None and gone[0] >= asked:  # found missing while we waited
                raise ObjectNotFoundError(str(gone[1]))
            fd = _open_file(path, size)
            if fd is not None:
                return fd
            try:
                self._check_size(url, size, sha256, *store)  # before any room
            except ObjectNotFoundError as e:
                self._gone[sha256] = (time.monotonic(), e)
                raise
            return self._take_in(url, size, sha256)

    def _take_in(self, url, size, sha256) -> int | None:
        """A descriptor of the shard's file, created at its full size if it fits; None."""
        path = self.path(sha256)
        with self._locked():
            fd = _open_file(path, size)  # taken in by another meanwhile
            if fd is not None:
                return fd
            if not self._make_room(file_bytes(size)):
                self._full_until = time.monotonic() + _FULL_FOR
                return None
            tmp = os.path.join(self.folder, f".{sha256}.new")
            fd = _opened(os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644))
            try:
                os.ftruncate(fd, file_bytes(size))  # a sparse file: no block there yet
                os.replace(tmp, path)
            except BaseException:
                _close(fd)
                _unlink(tmp)
                raise
        log.debug("taking in %s (%d bytes) as %s", url, size, path)
        return fd

    def _serve(self, fd, url, size, sha256, start, stop, store) -> bytes:
        """Bytes ``[start, stop)`` from the shard's file, its missing blocks fetched first
        (``store``: with these storage options, read policy and request counts)."""
        first, last = start // BLOCK, -(-stop // BLOCK)
        whole = os.fstat(fd).st_size == size  # an older release's whole, checked shard
        if whole or first >= last or b"\0" not in os.pread(fd, last - first, size + first):
            if store[2] is not None:  # every block there: served with no request
                store[2].add(cache_hits=1)
            return pread(fd, stop - start, start)
        lo, hi = first * BLOCK, min(size, last * BLOCK)
        rounded = (hi - lo) - (stop - start) <= MORE * (stop - start)
        wrote = False
        with range_locked(fd, size + first, last - first):  # one fetch of these blocks at once
            marks = os.pread(fd, last - first, size + first)  # as they are now
            for run_first, run_last in missing_runs(marks, first):
                a, z = run_first * BLOCK, min(size, run_last * BLOCK)
                if not rounded:
                    a, z = max(a, start), min(z, stop)
                data = read_range(url, a, z, store[0], store[1], None, store[2])
                if len(data) != z - a:
                    self._drop(fd, sha256)
                    self._bad(
                        sha256,
                        f"{url}: ends at byte {a + len(data)}; the index says {size} bytes: "
                        "the shard changed since its index was written, not cached",
                    )
                pwrite(fd, data, a)
                whole = (-(-a // BLOCK), blocks(size) if z == size else z // BLOCK)
                if whole[1] > whole[0]:  # marked only once their bytes are written
                    os.pwrite(fd, b"\1" * (whole[1] - whole[0]), size + whole[0])
                    wrote = True
            data = pread(fd, stop - start, start)
        os.utime(fd)  # recently read: evicted last
        if wrote:
            self._check_whole(fd, url, size, sha256)
        return data

    def _check_whole(self, fd, url, size, sha256) -> None:
        """Once every block of the shard is on disk: its sha256 checked, once (a flag byte
        after the map), by one process; a mismatch removes it and raises."""
        flag = size + blocks(size)
        if os.pread(fd, 1, flag) == b"\1" or not all_there(fd, size):
            return
        with range_locked(fd, flag, 1):
            if os.pread(fd, 1, flag) == b"\1":
                return
            digest = hashlib.sha256()
            for at in range(0, size, PIECE):
                digest.update(pread(fd, min(PIECE, size - at), at))
            if digest.hexdigest() != sha256:
                self._drop(fd, sha256)
                self._bad(
                    sha256,
                    f"{url}: sha256 {digest.hexdigest()[:12]}...; the index says {size} bytes, "
                    f"sha256 {sha256[:12]}...: the shard changed since its index was written, "
                    "not cached",
                )
            os.pwrite(fd, b"\1", flag)

    def _check_size(self, url, size, sha256, storage_options, policy, counts) -> None:
        """The object is there at the size its index gives (one request), or that is an error:
        ``ObjectNotFoundError``, or a ``StorageError`` remembered in ``bad``; a size the store
        does not state is the index's (the sha256 check of the whole still holds)."""
        found = object_size(url, storage_options, policy, counts)
        if found is not None and found != size:
            self._bad(
                sha256,
                f"{url}: {found} bytes; the index says {size} bytes, sha256 {sha256[:12]}...: "
                "the shard changed since its index was written, not cached",
            )

    def _bad(self, sha256: str, message: str):
        error = self.bad[sha256] = StorageError(message)
        log.warning(
            "shard cache %s: %s (%d such shards so far)", self.folder, message, len(self.bad)
        )
        raise error

    def _drop(self, fd: int, sha256: str) -> None:
        """The shard's file removed, if it is still the one ``fd`` holds."""
        with self._locked():
            path = self.path(sha256)
            if os.fstat(fd).st_ino == _inode(path):
                _unlink(path)

    @contextlib.contextmanager
    def _locked(self):
        """The folder's lock, held while room is made and a shard's file created."""
        fd = _opened(os.open(os.path.join(self.folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o644))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _close(fd)

    def _scan(self, clean: bool) -> list[tuple[float, int, str]]:
        """Cached shards as ``(last read, bytes held, path)``; ``clean`` (under the folder's
        lock): files left by processes that died while creating one are removed."""
        files = []
        for entry in os.scandir(self.folder):
            if entry.name.startswith("."):
                if clean and entry.name.endswith(".new"):  # created and renamed under the lock
                    _unlink(entry.path)
                elif clean and (entry.name.endswith(".fetch") or entry.name.endswith(".tmp")):
                    _remove_if_stale(entry)  # an older release's partial fetch
                continue
            if not _NAME.fullmatch(entry.name):
                continue
            try:
                stat = entry.stat()
            except FileNotFoundError:  # evicted just now
                continue
            files.append((stat.st_mtime, stat.st_size, entry.path))
        return files

    def _fits(self, incoming: int) -> bool:
        """Whether ``incoming`` more bytes may fit, counting idle shards as room (a look
        without the folder's lock; ``_make_room`` decides under it). A full cache says so for
        a second without looking again: most of its reads then go to the store."""
        if time.monotonic() < self._full_until:
            return False
        idle = time.time() - self.idle_seconds
        held = sum(size for used, size, _ in self._scan(clean=False) if used >= idle)
        if held + incoming <= self.max_bytes:
            return True
        self._full_until = time.monotonic() + _FULL_FOR
        return False

    def _make_room(self, incoming: int) -> bool:
        """Under the folder's lock: whether ``incoming`` more bytes fit beside the cached
        shards, after evicting (least recently read first) shards no reader has read for
        ``idle_seconds``; a shard read more recently stays."""
        files = self._scan(clean=True)
        total = sum(size for _, size, _ in files)
        idle = time.time() - self.idle_seconds
        for used, size, victim in sorted(files):
            if total + incoming <= self.max_bytes or used >= idle:
                break
            _unlink(victim)
            total -= size
        return total + incoming <= self.max_bytes

    def size(self) -> int:
        """Bytes of the shards taken in now (each at its full size; their maps, a
        ``BLOCK``-th of that, count against ``max_bytes`` beside)."""
        return sum(shard_bytes(size) for _, size, _ in self._scan(clean=False))


_FULL_FOR = 1.0  # seconds a cache found full is taken as full without looking again
_STALE = 3600  # seconds without a write: an older release's partial fetch whose process is gone
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_NAME = re.compile(r"[0-9a-f]{64}\.tar")
_admitting = [threading.Lock()]  # anew in a child forked while a thread of its parent held it
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _admitting.__setitem__(0, threading.Lock()))


def _opened(fd: int) -> int:
    OPEN.add(fd)  # closed in a child forked meanwhile (see blocks.OPEN)
    return fd


def _close(fd: int) -> None:
    OPEN.discard(fd)
    os.close(fd)


def _open_file(path: str, size: int) -> int | None:
    """A descriptor of the shard's file at ``path`` if it is there, else None."""
    try:
        fd = _opened(os.open(path, os.O_RDWR))
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size in (file_bytes(size), size):  # size: an older release's
            return fd
    except BaseException:
        _close(fd)
        raise
    _close(fd)
    return None


def _remove_if_stale(entry: os.DirEntry) -> None:
    with contextlib.suppress(FileNotFoundError):
        if time.time() - entry.stat().st_mtime > _STALE:
            _unlink(entry.path)


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
