"""A local disk cache of whole shards, bounded in bytes, that several processes (the ranks
and workers of one machine) can share.

A cached shard is named by the sha256 its index records, never by its URL: a shard rewritten
in place (tars are padded to 10 KiB records, so often at the same size) comes with a new
sha256 in its new index and so is fetched anew, while readers of the old index keep the old
bytes. A shard is fetched whole the first time a reader needs it (one ranged read at a time,
with the retries of ``storage.read_range``) into a temporary file, checked against the size
and sha256 the index gives, and renamed into place: a cached file is always complete and
holds the bytes its name says. A shard whose index records no sha256 is not cached (its
bytes could not be told from a rewrite's): it is read from the store each time.

Processes that share the folder coordinate through ``flock`` locks, which the kernel drops
when their process dies, so none is left stale:

- One fetch at a time per shard: the temporary file ``.<sha256>.fetch`` is locked by the
  process (or thread) that fills it. Others that need that shard meanwhile wait until it is
  renamed into place and read it from disk (should the fetch fail, the next of them fetches):
  the ranks and workers of a machine that read a shard together pull it from the store once.
  A temporary file found unlocked was left by a process that died mid-fetch: it is removed.
- The bound: ``.lock`` is held briefly while the least recently used shards are evicted and
  the temporary file is grown to the shard's full size (a reservation that every other
  process counts), and while a fetched file is renamed into place. So the cached shards and
  the fetches under way never hold more than ``max_bytes`` together. Where no room can be
  made (the rest is reserved by fetches under way), or the shard is larger than
  ``max_bytes``, or the disk fails, the range is read from the store, uncached.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import time
from collections.abc import Mapping
from typing import Any

from ..errors import StorageError
from .fs import ReadPolicy, read_range

log = logging.getLogger("wdsvlm.cache")


class ShardCache:
    """``ShardCache(folder, max_bytes)``: ``read(url, size, start, stop, sha256=...)`` gives
    bytes ``[start, stop)`` of the shard at ``url`` (``size`` bytes long, of that sha256), from
    disk, fetching the whole shard first when it is not there yet."""

    def __init__(self, folder: str, max_bytes: int = 64 * 2**30):
        if max_bytes < 1:
            raise ValueError(f"the cache's max_bytes must be positive, not {max_bytes}")
        self.folder = folder
        self.max_bytes = max_bytes
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
    ) -> bytes:
        """Bytes ``[start, stop)`` of the shard; ``size`` and ``sha256`` are the index's. With
        no sha256 (or not one of 64 hex digits) the range is read from the store, uncached."""
        if size > self.max_bytes or not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
            return read_range(url, start, stop, storage_options, policy)
        for _ in range(5):  # another process may evict the file, or rename it into place, under us
            try:
                fd = self._open(url, size, sha256.lower(), storage_options, policy)
                if fd is None:  # no room: the rest of the bound is being fetched
                    break
                try:
                    return os.pread(fd, stop - start, start)
                finally:
                    os.close(fd)
            except FileNotFoundError:
                continue
            except OSError as e:  # a full or broken disk: the cache steps aside
                log.warning("shard cache %s: %s; reading %s from the store", self.folder, e, url)
                break
        return read_range(url, start, stop, storage_options, policy)

    def _open(self, url, size, sha256, storage_options, policy) -> int | None:
        """A descriptor of the complete shard, fetched first if needed; None: no room."""
        path = self.path(sha256)
        fd = _open_complete(path, size)
        if fd is not None:
            return fd
        tmp = os.path.join(self.folder, f".{sha256}.fetch")
        lock = _lock(tmp, wait=True)  # another process may be fetching it: wait for it
        if lock is None:
            raise FileNotFoundError(tmp)  # renamed into place, or removed, while we waited
        try:
            fd = _open_complete(path, size)
            if fd is not None:  # fetched by another while we waited
                _unlink(tmp)
                return fd
            os.ftruncate(lock, 0)  # what a process that died mid-fetch left
            try:
                with self._locked():
                    if not self._evict(size):
                        _unlink(tmp)
                        return None
                    os.ftruncate(lock, size)  # reserved: other processes count it
                self._fill(lock, url, size, sha256, storage_options, policy)
            except BaseException:
                _unlink(tmp)  # still ours: we hold its lock
                raise
            with self._locked():
                os.replace(tmp, path)
            log.debug("cached %s (%d bytes) as %s", url, size, path)
            fd, lock = lock, None
            return fd
        finally:
            if lock is not None:
                os.close(lock)

    def _fill(self, fd, url, size, sha256, storage_options, policy) -> None:
        digest, at = hashlib.sha256(), 0
        block = (policy or ReadPolicy()).block_bytes
        while at < size:
            data = read_range(url, at, min(size, at + block), storage_options, policy)
            if not data:
                break
            digest.update(data)
            view = memoryview(data)
            while view:  # a write may be short (a nearly full disk): no hole left behind
                written = os.pwrite(fd, view, at)
                view, at = view[written:], at + written
        if at != size or digest.hexdigest() != sha256:
            raise StorageError(
                f"{url}: {at} bytes, sha256 {digest.hexdigest()[:12]}...; the index says "
                f"{size} bytes, sha256 {sha256[:12]}...: the shard changed since its index "
                "was written, not cached"
            )

    @contextlib.contextmanager
    def _locked(self):
        """The folder's lock, held while room is made and reserved, and while a fetched shard
        is renamed into place (so that a scan counts its bytes under one name or the other)."""
        fd = os.open(os.path.join(self.folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        _HELD.add(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            _HELD.discard(fd)
            os.close(fd)

    def _evict(self, incoming: int) -> bool:
        """Under the folder's lock: evicts the least recently used shards until ``incoming``
        more bytes fit; False if they cannot."""
        files, fetching = [], 0
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".fetch"):
                stale = _lock(entry.path, wait=False)
                if stale is not None:  # its process died mid-fetch
                    _unlink(entry.path)
                    os.close(stale)
                    continue
            elif entry.name.startswith(".fetch-") and entry.name.endswith(".tmp"):
                _remove_if_stale(entry)  # an older release's partial fetch
                continue
            elif not entry.name.endswith(".tar"):
                continue
            try:
                stat = entry.stat()
            except FileNotFoundError:  # a failed fetch's, removed just now
                continue
            if entry.name.endswith(".tar"):
                files.append((stat.st_mtime, stat.st_size, entry.path))
            else:
                fetching += stat.st_size
        if fetching + incoming > self.max_bytes:
            return False  # evicting every shard would not make room
        total = fetching + sum(size for _, size, _ in files)
        for _, size, victim in sorted(files):
            if total + incoming <= self.max_bytes:
                break
            _unlink(victim)
            total -= size
        return total + incoming <= self.max_bytes

    def size(self) -> int:
        """Bytes of cached shards now."""
        return sum(e.stat().st_size for e in os.scandir(self.folder) if e.name.endswith(".tar"))


_POLL = 0.02  # seconds between looks at a lock another process holds
_STALE = 3600  # seconds without a write: an older release's partial fetch whose process is gone

# The folder locks this process holds now. A child forked meanwhile (a thread of this process
# holds one for a moment) closes its copies at once: held by a child for its whole life, the
# folder's lock would stop every process sharing the cache.
_HELD: set[int] = set()


def _close_held_in_child() -> None:
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


def _remove_if_stale(entry: os.DirEntry) -> None:
    try:
        if time.time() - entry.stat().st_mtime > _STALE:
            _unlink(entry.path)
    except FileNotFoundError:
        pass


_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def _lock(path: str, wait: bool) -> int | None:
    """A descriptor of ``path`` (created if ``wait``) holding its exclusive ``flock``, or None:
    another process holds it (and not ``wait``), or the file was renamed or removed first.
    A waiter polls, so that it stops waiting once the file is renamed into place even if a
    process forked meanwhile still holds the lock."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if wait else 0), 0o644)
    except FileNotFoundError:
        return None
    locked = False
    try:
        while os.fstat(fd).st_ino == _inode(path):  # still the file that path names
            if locked:
                return fd
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
            except BlockingIOError:  # another process is fetching it
                if not wait:
                    break
                time.sleep(_POLL)
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _open_complete(path: str, size: int) -> int | None:
    """A descriptor of the cached shard at ``path`` if it is there whole (and now recently
    used: evicted last), else None."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        if os.fstat(fd).st_size == size:
            os.utime(fd)
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
