"""Every file and bucket access of wdsvlm goes through here, on top of fsspec.

Local paths, ``file://``, ``s3://``, ``gs://``, ``http(s)://`` and ``memory://`` all work the
same way; ``storage_options`` are passed to fsspec unchanged (endpoint URL, anonymous access,
profile, ...). Credentials come from each backend's standard chain.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.core import url_to_fs

from ..errors import StorageError
from .retry import (  # noqa: F401 - read as fs.ReadPolicy, fs.is_transient, ...
    ReadPolicy,
    RequestCounts,
    is_throttling,
    is_transient,
    retrying,
)

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

    Each request waits its turn in the node's request budget (``storage.governor``). A block
    whose request fails with a transient error (``is_transient``) is asked for again after a
    backoff with jitter (throttling: as ``retry.retrying`` says), from the first byte not yet
    received: the read goes on where
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
        data = retrying(
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
    size = retrying(url, 0, lambda: fs.size(path), policy, None, counts)
    return None if size is None else int(size)


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
