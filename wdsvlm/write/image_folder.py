"""Images by URL, found in a folder that img2dataset wrote.

img2dataset downloads a list of URLs into shards numbered ``00000``, ``00001``, ...: per
shard a Parquet file of every URL it tried (``url``, ``key``, ``status``, ``error_message``)
and the images it got, as files ``00000/KEY.jpg`` (``--output_format files``), as members
``KEY.jpg`` of ``00000.tar`` (``webdataset``), or in the ``jpg`` column of ``00000.parquet``
itself (``parquet``); the extension is its ``--encode_format`` (``jpg``, ``png``, ``webp``).

``image_folder`` reads those Parquet files once per process (the URLs only, no image) into a
map from URL to where its image lies; a tar's members are found by reading its headers once.
A URL img2dataset failed on, or never tried, is ``Unavailable`` with the reason: the writer
drops that image from its document and counts it. The map holds every URL of the folder in
memory (some 200 bytes each): give one folder per part of a large dataset.
"""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import fsspec

from ..storage.fs import join, list_names, read_range
from .parquet import Embedded, open_parquet

EXTENSIONS = ("jpg", "png", "webp", "jpeg")
"""The extensions img2dataset gives images (its ``encode_format``)."""


@dataclass(frozen=True)
class Unavailable:
    """An image that cannot be had, and why: ``reason`` (counted) and ``message``."""

    reason: str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class TarMember:
    """An image stored as member ``name`` of the tar at ``url``: ``size`` bytes at
    ``offset``."""

    url: str
    name: str
    offset: int
    size: int

    def __str__(self) -> str:
        return f"{self.url} member {self.name}"

    def read(self, storage_options: Mapping[str, Any] | None = None) -> bytes:
        return read_range(self.url, self.offset, self.offset + self.size, storage_options)


class ImageFolder:
    """The images of an img2dataset output folder, by URL (see the module)."""

    def __init__(self, folder: str, storage_options: Mapping[str, Any] | None = None):
        self.folder = folder
        self.storage_options = storage_options
        names = list_names(folder, storage_options)
        tables = [n for n in names if n.endswith(".parquet")]
        if not tables:
            raise FileNotFoundError(
                f"image folder {folder}: no Parquet file of img2dataset's (00000.parquet, ...) "
                "there: give the folder img2dataset wrote (its --output_folder)"
            )
        self.urls: dict[str, Any] = {}
        for table in tables:
            self._read_shard(table[: -len(".parquet")], set(names))

    def find(self, url: str) -> Any:
        """Where the image of ``url`` lies (a file's path, ``TarMember`` or ``Embedded``), or
        ``Unavailable``."""
        found = self.urls.get(url)
        if found is None:
            return Unavailable("not_downloaded", f"{url} is not in the image folder {self.folder}")
        return found

    def _read_shard(self, shard: str, names: set[str]) -> None:
        table = join(self.folder, shard + ".parquet")
        rows = []
        with open_parquet(table, self.storage_options) as parquet:
            columns = ("url", "key", "status", "error_message", "jpg")
            present = [c for c in columns if c in parquet.schema_arrow.names]
            if "url" not in present or "key" not in present:
                return  # not one of img2dataset's shard tables
            read = [c for c in present if c != "jpg"]  # the URLs, not the images
            for group in range(parquet.num_row_groups):
                batch = parquet.read_row_group(group, columns=read).to_pylist()
                rows += [(group, i, row) for i, row in enumerate(batch)]
        if shard + ".tar" in names:
            stored = self._tar_members(join(self.folder, shard + ".tar"))
        elif shard in names:
            files = set(list_names(join(self.folder, shard), self.storage_options))
            stored = {n: join(join(self.folder, shard), n) for n in files}
        else:
            stored = None  # the images are in the table itself (output_format parquet)
        for group, i, row in rows:
            url = row.get("url")
            known = self.urls.get(url)
            if not isinstance(url, str) or known is not None and not isinstance(known, Unavailable):
                continue  # a URL tried twice: the first image got
            if row.get("status", "success") != "success":
                error = row.get("error_message") or row.get("status")
                message = f"{url}: img2dataset could not download it ({error})"
                self.urls[url] = Unavailable("download_failed", message)
                continue
            self.urls[url] = self._stored(
                str(row["key"]), stored, table, group, i, "jpg" in present
            )

    def _stored(self, key: str, stored, table: str, group: int, row: int, in_table: bool) -> Any:
        if stored is None:
            if in_table:
                return Embedded(table, group, row, "jpg", None)
        else:
            for ext in EXTENSIONS:
                if f"{key}.{ext}" in stored:
                    return stored[f"{key}.{ext}"]
        return Unavailable(
            "not_downloaded", f"image folder {self.folder}: key {key} is listed but not stored"
        )

    def _tar_members(self, url: str) -> dict[str, TarMember]:
        members = {}
        with fsspec.open(url, "rb", **(self.storage_options or {})) as f:
            with tarfile.open(fileobj=f, mode="r:") as tar:
                for info in tar:
                    if info.isfile():
                        member = TarMember(url, info.name, info.offset_data, info.size)
                        members[os.path.basename(info.name)] = member
        return members


_folders: dict[tuple, ImageFolder] = {}  # per process: read once


def image_folder(folder: str, storage_options: Mapping[str, Any] | None = None) -> ImageFolder:
    """The ``ImageFolder`` of ``folder``, read once per process."""
    key = (folder, json.dumps(storage_options or {}, sort_keys=True, default=str))
    if key not in _folders:
        _folders[key] = ImageFolder(folder, storage_options)
    return _folders[key]
