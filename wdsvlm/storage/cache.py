"""A local disk cache of whole shards, bounded in bytes, that several processes (the ranks
and workers of one machine) can share.

A shard is fetched whole the first time a reader needs it (one ranged read at a time, with
the retries of ``storage.read_range``) into a temporary file, checked against the size the
index gives, and renamed into place: a cached file is always complete. Processes that need
the same shard at the same time each fetch it, and the last rename wins (the bytes are the
same); so no lock can be left stale by a crashed process (a partial fetch it left behind is
removed after an hour without writes). Before a shard is added, the least recently used files
are evicted until it fits in ``max_bytes``; a shard larger than that, or a disk that fails, is
read from the store instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from ..errors import StorageError
from ..storage.fs import ReadPolicy, read_range

log = logging.getLogger("wdsvlm.cache")


class ShardCache:
    """``ShardCache(folder, max_bytes)``: ``read(url, size, start, stop)`` gives bytes
    ``[start, stop)`` of the shard at ``url`` (``size`` bytes long), from disk, fetching the
    whole shard first when it is not there yet."""

    def __init__(self, folder: str, max_bytes: int = 64 * 2**30):
        if max_bytes < 1:
            raise ValueError(f"the cache's max_bytes must be positive, not {max_bytes}")
        self.folder = folder
        self.max_bytes = max_bytes
        os.makedirs(folder, exist_ok=True)

    def path(self, url: str) -> str:
        name = hashlib.sha256(url.encode()).hexdigest()[:32]
        return os.path.join(self.folder, f"{name}.tar")

    def read(
        self,
        url: str,
        size: int,
        start: int,
        stop: int,
        storage_options: Mapping[str, Any] | None = None,
        policy: ReadPolicy | None = None,
    ) -> bytes:
        if size > self.max_bytes:  # cannot be kept: read it from the store as it is
            return read_range(url, start, stop, storage_options, policy)
        path = self.path(url)
        for _ in range(3):  # another process may evict the file between the check and open
            try:
                if not _complete(path, size):
                    self._fetch(url, size, path, storage_options, policy)
                with open(path, "rb") as f:
                    os.utime(f.fileno())  # recently used: evicted last
                    f.seek(start)
                    return f.read(stop - start)
            except FileNotFoundError:
                continue
            except OSError as e:  # a full or broken disk: the cache steps aside
                log.warning("shard cache %s: %s; reading %s from the store", self.folder, e, url)
                break
        return read_range(url, start, stop, storage_options, policy)

    def _fetch(self, url, size, path, storage_options, policy) -> None:
        self._evict(size)
        fd, tmp = tempfile.mkstemp(prefix=".fetch-", suffix=".tmp", dir=self.folder)
        try:
            with os.fdopen(fd, "wb") as f:
                block = (policy or ReadPolicy()).block_bytes
                for at in range(0, size, block):
                    f.write(read_range(url, at, min(size, at + block), storage_options, policy))
            if os.path.getsize(tmp) != size:
                raise StorageError(
                    f"{url}: {os.path.getsize(tmp)} bytes, the index says {size}: not cached"
                )
            os.replace(tmp, path)
            log.debug("cached %s (%d bytes) as %s", url, size, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _evict(self, incoming: int) -> None:
        files, fetching = [], 0
        for entry in os.scandir(self.folder):
            try:
                stat = entry.stat()
            except FileNotFoundError:  # another process evicted or renamed it just now
                continue
            if entry.name.endswith(".tar"):
                files.append((stat.st_mtime, stat.st_size, entry.path))
            elif entry.name.startswith(".fetch-"):
                if time.time() - stat.st_mtime > _STALE_FETCH:  # its process died mid-fetch
                    _unlink(entry.path)
                else:
                    fetching += stat.st_size
        total = sum(size for _, size, _ in files) + fetching
        for _, size, victim in sorted(files):
            if total + incoming <= self.max_bytes:
                break
            _unlink(victim)
            total -= size

    def size(self) -> int:
        """Bytes of cached shards now."""
        return sum(e.stat().st_size for e in os.scandir(self.folder) if e.name.endswith(".tar"))


_STALE_FETCH = 3600  # seconds without a write: a fetch whose process is gone


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _complete(path: str, size: int) -> bool:
    try:
        return os.path.getsize(path) == size
    except FileNotFoundError:
        return False
