"""Every file and bucket access of wdsvlm goes through here, on top of fsspec.

Local paths, ``file://``, ``s3://``, ``gs://``, ``http(s)://`` and ``memory://`` all work the
same way; ``storage_options`` are passed to fsspec unchanged (endpoint URL, anonymous access,
profile, ...). Credentials come from each backend's standard chain.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from .errors import StorageError


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None):
    """Return ``(fs, path)`` for ``url``: the fsspec filesystem and the path inside it."""
    try:
        return url_to_fs(url, **dict(storage_options or {}))
    except (ImportError, ValueError) as e:
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


def read_bytes(url: str, storage_options: Mapping[str, Any] | None = None) -> bytes:
    """The whole content of one file or object."""
    if "://" not in url:
        with open(url, "rb") as f:
            return f.read()
    fs, path = filesystem(url, storage_options)
    return fs.cat_file(path)


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
