"""Every file and bucket access of wdsvlm goes through here, on top of fsspec.

Local paths, ``file://``, ``s3://``, ``gs://``, ``http(s)://`` and ``memory://`` all work the
same way; ``storage_options`` are passed to fsspec unchanged (endpoint URL, anonymous access,
profile, ...). Credentials come from each backend's standard chain.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import re
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.core import url_to_fs

from ..errors import ObjectNotFoundError, StorageError

log = logging.getLogger("wdsvlm.storage")


# Bucket backends are optional extras of wdsvlm: the scheme, the extra that brings it.
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None):
    """Return ``(fs, path)`` for ``url``: the fsspec filesystem and the path inside it."""
    try:
        return url_to_fs(url, **dict(storage_options or {}))
    except ImportError as e:
        extra = _EXTRAS.get(url.split("://", 1)[0].lower()) if "://" in url else None
        if extra is not None:
            raise StorageError(
                f"cannot open {url!r}: its backend is not installed: pip install 'wdsvlm[{extra}]'"
            ) from e
        raise StorageError(f"cannot open {url!r}: {e}") from e
    except ValueError as e:
        raise StorageError(f"cannot open {url!r}: {e}") from e


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    return "file" in protocols or "local" in protocols


def join(base: str, name: str) -> str:
    """``base/name`` for paths and URLs alike."""
    if "://" in base:
        return base.rstrip("/") + "/" + name
    return os.path.join(base, name)


def read_bytes(
    url: str, storage_options: Mapping[str, Any] | None = None, policy: ReadPolicy | None = None
) -> bytes:
    """The whole content of one file or object (a small one: ``index.json``), asked for again
    on transient errors as ``read_range`` does."""
    if "://" not in url:
        with open(url, "rb") as f:
            return f.read()
    return read_range(url, 0, None, storage_options, policy)


def exists(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    fs, path = filesystem(url, storage_options)
    return fs.exists(path)


def publish_file(local_tmp: str, url: str, storage_options: Mapping[str, Any] | None = None):
    """Make the finished local file ``local_tmp`` appear at ``url`` in one step.

    Locally that is a rename; on object stores the object only appears once its upload
    (multipart for large files) has completed. ``local_tmp`` is gone afterwards.
    """
    fs, path = filesystem(url, storage_options)
    try:
        if is_local(fs):
            os.chmod(local_tmp, 0o644)  # mkstemp makes 0600; a dataset is meant to be shared
            os.replace(local_tmp, path)
            return
        fs.put_file(local_tmp, path)
    except OSError as e:
        raise StorageError(f"cannot write {url}: {e}") from e
    finally:
        if os.path.exists(local_tmp):
            os.unlink(local_tmp)


def publish_bytes(data: bytes, url: str, storage_options: Mapping[str, Any] | None = None):
    """Write ``data`` to ``url`` so that readers see the whole of it or nothing."""
    tmp = staging_file(url, storage_options)
    with open(tmp, "wb") as f:
        f.write(data)
    publish_file(tmp, url, storage_options)


def staging_file(url: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """A new local temporary file to build the content of ``url`` in before publishing it.

    For a local destination it lies in the same folder, so that publishing is a rename.
    """
    fs, path = filesystem(url, storage_options)
    tmp_dir = None
    if is_local(fs):
        tmp_dir = os.path.dirname(path) or "."
        os.makedirs(tmp_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".wdsvlm-", suffix=".tmp", dir=tmp_dir)
    os.close(fd)
    return tmp


def remove(url: str, storage_options: Mapping[str, Any] | None = None) -> None:
    fs, path = filesystem(url, storage_options)
    if fs.exists(path):
        fs.rm_file(path)


def list_names(url: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """Names of the files directly inside the folder or prefix ``url`` (empty if none)."""
    fs, path = filesystem(url, storage_options)
    fs.invalidate_cache(path)
    try:
        return sorted(os.path.basename(p.rstrip("/")) for p in fs.ls(path, detail=False))
    except FileNotFoundError:
        return []


@dataclass(frozen=True)
class ReadPolicy:
    """How ranged reads fetch bytes and live through network faults."""

    block_bytes: int = 4 * 2**20
    """Bytes fetched per request; a request that breaks is tried again from its first byte."""
    attempts: int = 6
    """Tries of one block before giving up on a transient error (permanent ones: at once)."""
    backoff: float = 0.1
    """Seconds before the first retry; doubled each time, with jitter, up to ``max_backoff``."""
    max_backoff: float = 5.0
    timeout: float = 60.0
    """Seconds one request may take (a stalled one then counts as a transient failure)."""
    requests_per_second: float | None = None
    """The most requests a second the processes of one node send together (None: no cap);
    shared through a file in ``node_dir``."""
    node_dir: str | None = None
    """A node-local folder for what the node's processes share (the shard table's copy, the
    request budget); None: the Loader's ``local_dir``, else the cache folder, else a
    temporary folder (``storage.node.node_folder``)."""

    def __post_init__(self):
        if self.block_bytes < 1 or self.attempts < 1 or self.timeout <= 0:
            raise ValueError(f"invalid read policy: {self}")


class RequestCounts:
    """What reads asked of a store, added up (thread-safe; pickles as its figures):
    ``requests`` sent (every try), ``bytes`` received, ``throttled`` answers (503 SlowDown,
    429, ...) and ``retries`` after faults."""

    FIELDS = ("requests", "bytes", "throttled", "retries")

    def __init__(self, **counts: int):
        self._lock = threading.Lock()
        self.requests = self.bytes = self.throttled = self.retries = 0
        self.add(**counts)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                if name not in self.FIELDS:
                    raise ValueError(f"{name} is not one of {self.FIELDS}")
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {name: getattr(self, name) for name in self.FIELDS}

    def __getstate__(self):
        return self.as_dict()

    def __setstate__(self, state):
        self.__init__(**state)

    def __repr__(self) -> str:
        return f"RequestCounts({self.as_dict()})"


# Error codes of answers that will not change by asking again (matched as whole words in the
# message, never in a URL: a shard may well be called data-000404.tar).
_PERMANENT = re.compile(
    r"\b(NoSuchBucket|NoSuchKey|AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|"
    r"AllAccessDisabled|AccountProblem|InvalidBucketName)\b"
)

# errno values of an OSError that asking again will not change: s3fs turns a 400, an invalid
# range or argument into EINVAL, a 501 into ENOSYS and a redirect to another region into EREMCHG.
_PERMANENT_ERRNO = {
    errno.EINVAL,
    errno.ENOSYS,
    errno.EPERM,
    errno.EACCES,
    errno.ENOENT,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ENAMETOOLONG,
    getattr(errno, "EREMCHG", errno.ENOENT),
}

# Network faults of the HTTP clients under fsspec's backends that are not OSErrors, by module
# and class name: a cut or stalled connection, a body cut short. Looked up only among modules
# already imported (an error cannot come from one that is not), so no backend is imported here.
_NETWORK_ERRORS = {
    "aiohttp": ("ClientConnectionError", "ClientPayloadError"),
    "botocore.exceptions": ("HTTPClientError", "ResponseParserError"),
    "urllib3.exceptions": ("ProtocolError", "TimeoutError"),
    "http.client": ("IncompleteRead", "BadStatusLine"),
}


def _network_error(error: BaseException) -> bool:
    for module, names in _NETWORK_ERRORS.items():
        found = sys.modules.get(module)
        kinds = tuple(k for k in (getattr(found, n, None) for n in names) if isinstance(k, type))
        if kinds and isinstance(error, kinds):
            return True
    return False


def _http_status(error: BaseException) -> int | None:
    """The HTTP status of an error that carries one: ``status`` (aiohttp, fsspec's HTTP), an
    int ``code`` (gcsfs), or a botocore ``response``."""
    status = getattr(error, "status", None)
    if isinstance(status, int):
        return status
    code = getattr(error, "code", None)
    if isinstance(code, int) and 100 <= code < 600:
        return code
    response = getattr(error, "response", None)
    if isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def is_transient(error: BaseException) -> bool:
    """Whether asking again may succeed: connection resets and refusals, timeouts, throttling
    and 5xx answers yes; missing objects or buckets, refused access, bad requests no.

    Only what is known to be a fault of the network or the store is transient: any other
    exception (a ``TypeError``, ``KeyError``, ... of a bug) is not, so it surfaces at once
    instead of after every retry."""
    if isinstance(
        error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
    ):
        return False
    status = _http_status(error)
    if status is not None:  # an HTTP answer: its status decides
        return status in (408, 429) or status >= 500
    if isinstance(error, (ConnectionError, TimeoutError)) or _network_error(error):
        return True
    if not isinstance(error, OSError):  # not a fault of I/O: a bug, surfaced at once
        return False
    if error.errno in _PERMANENT_ERRNO:
        return False
    # the other OSErrors: what the backends make of the store's answers (s3fs: a 503 or
    # SlowDown as EBUSY, a 500 as EREMOTEIO, an unknown code as EIO), unless a code says no
    text = " ".join(str(a) for a in getattr(error, "args", ()) if not str(a).startswith("http"))
    return not _PERMANENT.search(text)


def read_range(
    url: str,
    start: int,
    stop: int | None,
    storage_options: Mapping[str, Any] | None = None,
    policy: ReadPolicy | None = None,
    cancel: threading.Event | None = None,
    counts: RequestCounts | None = None,
) -> bytes:
    """Bytes ``[start, stop)`` of ``url``, fetched ``policy.block_bytes`` at a time.

    A block whose request fails with a transient error (``is_transient``) is asked for again
    after a backoff with jitter, from the first byte not yet received: the read goes on where
    it broke, never from the start of the object, and returns whole or raises. A permanent
    error of the store, or a block that fails ``policy.attempts`` times, raises ``StorageError``
    naming the URL, the byte offset and the cause; any other exception (a bug) is raised as
    it is, at once. Fewer bytes than asked mean the object ends early.
    ``stop=None``: to the end of the object, in one request. Setting ``cancel`` ends the read
    (``StorageError``) before its next request or retry. ``counts``: where its requests,
    bytes, throttled answers and retries are added.
    """
    policy = policy or ReadPolicy()
    fs, path = filesystem(url, storage_options)
    parts: list = []  # what each request gave, joined at the end (one request: no copy)
    at = start
    while stop is None or at < stop:
        end = None if stop is None else min(stop, at + policy.block_bytes)
        data = _retrying(
            url,
            at,
            lambda a=at, e=end: _fetch(fs, path, a, e, policy.timeout),
            policy,
            cancel,
            counts,
        )
        if counts is not None:
            counts.add(bytes=len(data))
        if not data:
            break  # the object ends before stop
        parts.append(data)
        at += len(data)
        if stop is None:
            break
    if len(parts) == 1 and type(parts[0]) is bytes:
        return parts[0]
    return b"".join(parts)


def object_size(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    policy: ReadPolicy | None = None,
    counts: RequestCounts | None = None,
) -> int | None:
    """The size of the file or object at ``url`` (one request to a store: a HEAD), asked for
    again on transient errors as ``read_range`` does; ``None`` where the store does not say
    (an HTTP server that sends no ``Content-Length``); ``ObjectNotFoundError`` if it is not
    there."""
    policy = policy or ReadPolicy()
    fs, path = filesystem(url, storage_options)
    size = _retrying(url, 0, lambda: fs.size(path), policy, None, counts)
    return None if size is None else int(size)


def _retrying(
    url: str,
    at: int,
    request,
    policy: ReadPolicy,
    cancel: threading.Event | None,
    counts: RequestCounts | None = None,
):
    """``request()``, asked again after a backoff with jitter while it fails with a transient
    error, ``policy.attempts`` tries in all. A permanent error of the store raises
    ``StorageError`` (``ObjectNotFoundError`` for a missing object) naming ``url`` and the byte
    ``at``; any other exception (a bug) is raised as it is, at once."""
    failures = 0
    while True:
        if cancel is not None and cancel.is_set():
            raise StorageError(f"{url}: read cancelled at byte {at}")
        if counts is not None:
            counts.add(requests=1)
        try:
            return request()
        except Exception as e:  # noqa: BLE001 - classified below; every path re-raises or retries
            cause = f"{type(e).__name__}: {e}".strip()
            if not is_transient(e):
                if not (isinstance(e, OSError) or _http_status(e) is not None):
                    # not the store's answer but a bug (or a fault of no known kind): as it
                    # is, so that on_shard_error="skip" cannot count it as an unreadable shard
                    if hasattr(e, "add_note"):  # Python 3.11+
                        e.add_note(f"while reading {url} from byte {at}")
                    raise
                kind = ObjectNotFoundError if isinstance(e, FileNotFoundError) else StorageError
                raise kind(f"{url}: cannot read from byte {at}: {cause}") from e
            failures += 1
            if failures >= policy.attempts:
                raise StorageError(
                    f"{url}: gave up at byte {at} after {failures} attempts; last: {cause}"
                ) from e
            if counts is not None:
                counts.add(retries=1)
            log.info("%s: retrying from byte %d (%s)", url, at, cause)
            wait = min(policy.max_backoff, policy.backoff * 2 ** (failures - 1))
            if cancel is not None:
                cancel.wait(wait * (0.5 + random.random()))
            else:
                time.sleep(wait * (0.5 + random.random()))


def _ignore_outcome(task) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so that asyncio does not log it as never retrieved


def _fetch(fs, path: str, start: int, end: int | None, timeout: float) -> bytes:
    if isinstance(fs, AsyncFileSystem) and getattr(fs, "loop", None) is not None:
        # On fsspec's own event loop, with a deadline that cancels the request: a stalled
        # one fails (and lets go of its connection) instead of hanging the worker and the
        # training job behind it.
        async def within_deadline():
            task = asyncio.ensure_future(fs._cat_file(path, start=start, end=end))
            done, _ = await asyncio.wait({task}, timeout=timeout)
            if not done:  # cancelled, not awaited: a stalled connection may take long to let go
                task.cancel()
                task.add_done_callback(_ignore_outcome)
                raise TimeoutError(f"no answer in {timeout} s")
            return task.result()

        return sync(fs.loop, within_deadline)
    return fs.cat_file(path, start=start, end=end)
