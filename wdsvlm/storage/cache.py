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

Processes that need the same shard at the same time each fetch it, and the last rename wins
(the bytes are the same); so no lock can be left stale by a crashed process (a partial fetch
it left behind is removed after an hour without writes). Before a shard is added, the least
recently used files are evicted until it fits in ``max_bytes``; a shard larger than that, or
a disk that fails, is read from the store instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
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
        path = self.path(sha256)
        for _ in range(3):  # another process may evict the file between the check and open
            try:
                if not _complete(path, size):
                    self._fetch(url, size, sha256.lower(), path, storage_options, policy)
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

    def _fetch(self, url, size, sha256, path, storage_options, policy) -> None:
        self._evict(size)
        fd, tmp = tempfile.mkstemp(prefix=".fetch-", suffix=".tmp", dir=self.folder)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as f:
                block = (policy or ReadPolicy()).block_bytes
                for at in range(0, size, block):
                    data = read_range(url, at, min(size, at + block), storage_options, policy)
                    digest.update(data)
                    f.write(data)
            got = os.path.getsize(tmp)
            if got != size or digest.hexdigest() != sha256:
                raise StorageError(
                    f"{url}: {got} bytes, sha256 {digest.hexdigest()[:12]}...; the index says "
                    f"{size} bytes, sha256 {sha256[:12]}...: the shard changed since its index "
                    "was written, not cached"
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
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


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
