"""What the processes of one node share on its local disk: a folder for the shard table's copy
and the request budget's counter.

A copy of a remote file (``node_copy``) is fetched once per node: the first process that finds
it missing takes the copy's lock (``fcntl.flock``, dropped by the kernel if its process dies),
fetches the file into a temporary file beside it, checks its size and sha256 against what the
index names, and renames it into place; the node's other processes wait on the lock, then find
it there. Later opens check its size only (one ``stat``), so opening stays O(1) whatever the
file's size. A copy is named by its sha256: two jobs on one node that read the same file share
one copy, and jobs that read different files (another dataset, the same one rewritten) each
get their own. The folder does not grow without bound: each open touches the copy's time, and
whenever a copy is written, the files of the folder not opened for ``UNUSED_DAYS`` days are
removed (a process that still maps one keeps its pages; a later open fetches it again).

A folder of many small copies (the shards' sidecars) is bounded by bytes too (``cap``): the
bytes of its copies are kept in a tally file (``.usage``, written under the folder's lock when a
copy is renamed into place), and a copy that would take it over the cap first removes the
copies opened least recently (by their times, which each open touches) until the folder and
the new copy come to 7/8 of the cap, so a folder at its cap is listed once per eighth of the
cap written, not at every copy. A process that has just opened a copy another then removes
finds it gone when it reads it, and fetches it again (``node_copy`` once more).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..errors import StorageError

if TYPE_CHECKING:  # fs may use this module (the request budget's counter): imported when used
    from .fs import ReadPolicy, RequestCounts

LOCAL_BYTES = 4 * 2**30
"""Bytes the node's copies of sidecars may take where neither the Loader's ``local_bytes`` nor
the ``ReadPolicy``'s ``node_bytes`` says."""
SIDECARS = "sidecars"
"""The subfolder of the node folder that holds the copies of remote sidecars."""

USAGE = ".usage"
"""The tally of a capped folder's bytes: what its copies take, as the last copy written left it."""

UNUSED_DAYS = 7
"""A copy no process of the node has opened for this many days is removed when another copy
is written."""


def node_copy(
    url: str,
    sha256: str,
    size: int,
    folder: str,
    suffix: str = "",
    storage_options: Mapping[str, Any] | None = None,
    policy: ReadPolicy | None = None,
    wrong: int | None = None,
    cap: int | None = None,
    counts: RequestCounts | None = None,
) -> str:
    """The path of this node's copy of the file at ``url`` (``size`` bytes of this ``sha256``)
    in ``folder``, named ``<sha256><suffix>``: fetched by one process of the node, the others
    waiting for it (see the module's docstring). ``wrong``: the inode of a copy the caller
    found damaged (its content unreadable at the right size): it is fetched anew, unless
    another process replaced it meanwhile. ``cap``: the bytes the folder's copies may take
    (see the module's docstring; at most ``cap`` for a file smaller than it). ``counts``: where
    the fetch's requests and bytes are counted. A copy fetched twice without the size and
    sha256 asked for raises ``WrongCopyError`` naming the URL and the folder."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, sha256 + suffix)
    if wrong is None and _opened_copy(path, size):
        return path
    with _locked(path + ".lock"):
        stat = _stat(path)
        if stat is not None and stat.st_size == size and stat.st_ino != wrong:
            return path  # fetched by another process while this one waited
        found = []
        for _ in range(2):  # a wrong copy is fetched again once
            tmp, got = _fetch(url, size, folder, storage_options, policy, counts)
            if got == (size, sha256):
                os.chmod(tmp, 0o644)
                if cap is None:
                    os.replace(tmp, path)
                    _remove_unused(folder, keep=path)
                else:
                    _place_within(tmp, path, size, cap)
                return path
            os.unlink(tmp)
            found.append(got)
    raise WrongCopyError(
        f"{url}: fetched twice into {folder}, it came as "
        + " then ".join(f"{n} bytes, sha256 {d[:12]}..." for n, d in found)
        + f", not the {size} bytes, sha256 {sha256[:12]}... its index names: the file on the "
        "store is damaged or being replaced (`wdsvlm verify` the dataset; build a new Loader "
        "once it is written)",
        found,
    )


class WrongCopyError(StorageError):
    """A file fetched for a node's copy came twice without the size and sha256 its index names;
    ``found``: the size and sha256 of what came, each time."""

    def __init__(self, message: str, found: list[tuple[int, str]] | None = None):
        super().__init__(message)
        self.found = found or []


def _opened_copy(path: str, size: int) -> bool:
    """Whether the copy at ``path`` is there at ``size`` bytes (then marked as opened now)."""
    stat = _stat(path)
    if stat is None or stat.st_size != size:
        return False
    with contextlib.suppress(OSError):  # a folder of another user's: only the mark is lost
        os.utime(path)
    return True


FETCH_BYTES = 64 * 2**20
"""Bytes of a copy asked for a request (or the read policy's ``block_bytes``, if larger): few
round trips for a large table, and a request that breaks is asked again from its first byte."""


def _fetch(url, size, folder, storage_options, policy, counts) -> tuple[str, tuple[int, str]]:
    """``url`` fetched into a new temporary file of ``folder``, ``FETCH_BYTES`` a request; its
    path, and the size and sha256 of what came."""
    from dataclasses import replace

    from .fs import ReadPolicy, read_range

    policy = policy or ReadPolicy()
    policy = replace(policy, block_bytes=max(policy.block_bytes, FETCH_BYTES))
    fd, tmp = tempfile.mkstemp(prefix=".fetch-", suffix=".tmp", dir=folder)
    digest, got = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as out:
            while got < size:
                stop = min(size, got + policy.block_bytes)
                data = read_range(url, got, stop, storage_options, policy, None, counts)
                if not data:
                    break  # the object ends early
                digest.update(data)
                out.write(data)
                got += len(data)
    except BaseException:
        os.unlink(tmp)
        raise
    return tmp, (got, digest.hexdigest())


def _remove_unused(folder: str, keep: str) -> None:
    """Remove the files of ``folder`` (copies, their locks, temporary files left by a process
    that died) not opened or written for ``UNUSED_DAYS`` days."""
    before = time.time() - UNUSED_DAYS * 86400
    for entry in os.scandir(folder):
        with contextlib.suppress(OSError):  # gone meanwhile, or another user's
            if entry.path != keep and entry.is_file() and entry.stat().st_mtime < before:
                os.unlink(entry.path)


def _place_within(tmp: str, path: str, size: int, cap: int) -> None:
    """Rename ``tmp`` (``size`` bytes) to ``path`` in a folder whose copies may take ``cap``
    bytes: under the folder's lock, the tally raised by its size (less that of a copy it
    replaces), the least recently opened copies removed first where that goes over ``cap``."""
    folder = os.path.dirname(path)
    with _locked(os.path.join(folder, USAGE + ".lock")):
        usage = _read_usage(folder)
        old = _stat(path)
        usage = None if usage is None else usage + size - (old.st_size if old else 0)
        if usage is None or usage > cap:
            usage = _evict(folder, keep=path, room=size, goal=cap - cap // 8) + size
        os.replace(tmp, path)
        _write_usage(folder, usage)


def _evict(folder: str, keep: str, room: int, goal: int) -> int:
    """The copies of ``folder`` listed, those not opened for ``UNUSED_DAYS`` days removed, then
    the least recently opened until they take ``goal - room`` bytes or less (never ``keep``);
    the bytes of those left, less ``keep``'s."""
    before = time.time() - UNUSED_DAYS * 86400
    copies = []
    for entry in os.scandir(folder):
        with contextlib.suppress(OSError):  # gone meanwhile
            if entry.path == keep or entry.name in (USAGE, USAGE + ".lock"):
                continue
            if not entry.is_file():
                continue
            stat = entry.stat()
            if entry.name.startswith(".") or entry.name.endswith(".lock"):
                if stat.st_mtime < before:  # a copy's lock, a fetch its process left
                    os.unlink(entry.path)
                continue
            copies.append((stat.st_mtime, stat.st_size, entry.path))
    copies.sort()
    total = sum(size for _, size, _ in copies)
    for opened, size, path in copies:
        if total + room <= goal and opened >= before:
            break
        with contextlib.suppress(OSError):
            os.unlink(path)
            total -= size
        with contextlib.suppress(OSError):
            os.unlink(path + ".lock")
    return total


def _read_usage(folder: str) -> int | None:
    try:
        with open(os.path.join(folder, USAGE)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None  # none yet, or cut short: the folder is listed


def _write_usage(folder: str, usage: int) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".usage-", dir=folder)
    with os.fdopen(fd, "w") as f:
        f.write(str(usage))
    os.replace(tmp, os.path.join(folder, USAGE))


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(OSError):
            os.utime(fd)  # the lock is in use: not removed as unused
        yield
    finally:
        os.close(fd)


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
