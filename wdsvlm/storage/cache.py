"""A local disk cache of whole shards, bounded in bytes, that several processes (the ranks
and workers of one machine) can share, and that never fetches more than reading without it.

A cached shard is named by the sha256 its index records, never by its URL: a shard rewritten
in place (tars are padded to 10 KiB records, so often at the same size) comes with a new
sha256 in its new index and so is fetched anew, while readers of the old index keep the old
bytes. A shard is fetched whole the first time a reader needs it (one ranged read at a time,
with the retries of ``storage.read_range``) into a temporary file, checked against the size
and sha256 the index gives, and renamed into place: a cached file is always complete and
holds the bytes its name says. A shard whose index records no sha256 is not cached (its
bytes could not be told from a rewrite's): it is read from the store each time.

What it fetches. A pass visits a shard's chunks spread over the whole pass (plan version 3),
so a cache of whole shards that evicts the least recently used to take in the next one
fetches each shard again and again within one pass (4.7 times the bytes of ranged reads with
a cache half the dataset's size, 7.6 times with a tenth). So a shard is taken in only while it
fits beside what the cache holds: a cached shard is never evicted to make room for another
unless no reader has read it for ``idle_seconds`` (a shard of a dataset no longer read, say),
and a shard that does not fit is read from the store by ranges, as without a cache. A pass
then fetches at most the bytes it would fetch without the cache (each shard taken in is read
whole in that pass anyway), and while the dataset fits, a later pass fetches nothing.

A shard the store does not have is one ``ObjectNotFoundError`` (one request: its size is asked
for before any room is made, so a missing shard evicts nothing); a shard whose bytes do not
match its index's sha256 is a ``StorageError`` naming it, remembered in the process
(``bad``): it is not fetched again for every span that needs it.

Processes that share the folder coordinate through ``flock`` locks, which the kernel drops
when their process dies, so none is left stale:

- One fetch at a time per shard: the temporary file ``.<sha256>.fetch`` is locked by the
  process (or thread) that fills it. Others that need that shard meanwhile wait until it is
  renamed into place and read it from disk (should the fetch fail, the next of them fetches):
  the ranks and workers of a machine that read a shard together pull it from the store once.
  A temporary file found unlocked was left by a process that died mid-fetch: it is removed.
- The bound: ``.lock`` is held briefly while room is made (idle shards evicted) and the
  temporary file is grown to the shard's full size (a reservation that every other process
  counts), and while a fetched file is renamed into place. So the cached shards and the
  fetches under way never hold more than ``max_bytes`` together. Where no room can be made,
  or the shard is larger than ``max_bytes``, or the disk fails, the range is read from the
  store, uncached.
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

from ..errors import ObjectNotFoundError, StorageError
from .fs import ReadPolicy, object_size, read_range

log = logging.getLogger("wdsvlm.cache")


class ShardCache:
    """``ShardCache(folder, max_bytes)``: ``read(url, size, start, stop, sha256=...)`` gives
    bytes ``[start, stop)`` of the shard at ``url`` (``size`` bytes long, of that sha256), from
    disk, fetching the whole shard first when it is not there yet and fits; ``idle_seconds``:
    how long a cached shard must have gone unread before it may make room for another;
    ``bad``: the shards found not to match their index in this process (sha256 -> the error
    naming the URL)."""

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
        sha256 = sha256.lower()
        if sha256 in self.bad:  # found not to match its index: no second download
            raise StorageError(str(self.bad[sha256]))
        for _ in range(5):  # another process may evict the file, or rename it into place, under us
            try:
                fd = self._open(url, size, sha256, storage_options, policy)
                if fd is None:  # no room: read as without a cache
                    break
                try:
                    return os.pread(fd, stop - start, start)
                finally:
                    os.close(fd)
            except ObjectNotFoundError:
                raise  # the store's answer, not a race over the cache's own files
            except FileNotFoundError:
                continue
            except OSError as e:  # a full or broken disk: the cache steps aside
                log.warning("shard cache %s: %s; reading %s from the store", self.folder, e, url)
                break
        return read_range(url, start, stop, storage_options, policy)

    def _open(self, url, size, sha256, storage_options, policy) -> int | None:
        """A descriptor of the complete shard, fetched first if it fits; None: no room."""
        path = self.path(sha256)
        fd = _open_complete(path, size)
        if fd is not None:
            return fd
        tmp = os.path.join(self.folder, f".{sha256}.fetch")
        if not os.path.exists(tmp) and not self._fits(size):  # a look without the locks
            return None  # (most reads of a full cache), unless another is fetching it
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
                self._check_size(url, size, sha256, storage_options, policy)  # before any room
                with self._locked():
                    if not self._make_room(size):
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

    def _check_size(self, url, size, sha256, storage_options, policy) -> None:
        """The object is there at the size its index gives (one request), or that is an error:
        ``ObjectNotFoundError``, or a ``StorageError`` remembered in ``bad``."""
        found = object_size(url, storage_options, policy)
        if found != size:
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
            self._bad(
                sha256,
                f"{url}: {at} bytes, sha256 {digest.hexdigest()[:12]}...; the index says "
                f"{size} bytes, sha256 {sha256[:12]}...: the shard changed since its index "
                "was written, not cached",
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

    def _scan(self, clean: bool) -> tuple[list[tuple[float, int, str]], int]:
        """``(cached shards as (last read, bytes, path), bytes reserved by fetches under
        way)``; ``clean``: the temporary files of processes that died mid-fetch are removed."""
        files, fetching = [], 0
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".fetch"):  # a fetch under way: its reservation counts
                stale = _lock(entry.path, wait=False) if clean else None
                if stale is not None:  # its process died mid-fetch
                    _unlink(entry.path)
                    os.close(stale)
                    continue
            elif entry.name.startswith(".fetch-") and entry.name.endswith(".tmp"):
                if clean:
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
        return files, fetching

    def _fits(self, incoming: int) -> bool:
        """Whether ``incoming`` more bytes may fit, counting idle shards as room (a look
        without the folder's lock; ``_make_room`` decides under it). A full cache says so for
        a second without looking again: most of its reads then go to the store."""
        if time.monotonic() < self._full_until:
            return False
        files, fetching = self._scan(clean=False)
        idle = time.time() - self.idle_seconds
        held = fetching + sum(size for used, size, _ in files if used >= idle)
        if held + incoming <= self.max_bytes:
            return True
        self._full_until = time.monotonic() + _FULL_FOR
        return False

    def _make_room(self, incoming: int) -> bool:
        """Under the folder's lock: whether ``incoming`` more bytes fit beside the cached
        shards and the fetches under way, after evicting (least recently read first) shards
        no reader has read for ``idle_seconds``; a shard read more recently stays."""
        files, fetching = self._scan(clean=True)
        total = fetching + sum(size for _, size, _ in files)
        idle = time.time() - self.idle_seconds
        for used, size, victim in sorted(files):
            if total + incoming <= self.max_bytes or used >= idle:
                break
            _unlink(victim)
            total -= size
        return total + incoming <= self.max_bytes

    def size(self) -> int:
        """Bytes of cached shards now."""
        return sum(e.stat().st_size for e in os.scandir(self.folder) if e.name.endswith(".tar"))


_FULL_FOR = 1.0  # seconds a cache found full is taken as full without looking again
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
