"""The shard table of index version 3: the root index's per-shard entries as binary columns.

Version 2 lists every shard in ``index.json`` (0.36 kB a shard, parsed into a dict per shard by
every process: gigabytes at a million shards). Version 3 keeps ``index.json`` small and puts
the shards in ``index.shards``, a file of fixed-width columns that a local reader maps
read-only: the processes of a node share its pages in the page cache, and a process touches
only the columns it reads (a sample count per shard to plan, 8 bytes a shard).

Layout: ``WDSVLMT1``, the header's length (8 bytes, little-endian), a JSON header (``rows``,
and each column's ``dtype``, ``shape`` and ``offset``), then the columns, each at a multiple of
64 bytes. Columns: ``samples``, ``bytes``, ``sidecar_bytes`` and the sums (``images``,
``text_only``, ``turns``, ``chars``, ``videos``), int64; ``sha256`` and ``sidecar_sha256``, 32
raw bytes; the shards' names and first and last keys, UTF-8 bytes back to back with their ends.
A row reads as the shard's entry of version 2 (``ShardTable[i]``); a shard's sidecar is named
after it (``sidecar_name``).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ShardFormatError
from ..storage.fs import filesystem, is_local, join, publish_file, read_bytes, staging_file
from .sidecar import LazyEntries, sidecar_name

TABLE_NAME = "index.shards"
MAGIC = b"WDSVLMT1"
SUMS = ("images", "text_only", "turns", "chars", "videos")
_INTS = ("samples", "bytes", "sidecar_bytes", *SUMS)
_NONE = bytes(32)
"""A shard's sha256 where the index has none (never the digest of real data)."""


class TableBuilder:
    """Builds ``index.shards`` from shard entries given one at a time, in memory bounded by a
    constant: each column goes to a temporary file of its own as rows come, and ``finish``
    lays them out after the header. Shard entries are those of version 2 (``name``,
    ``samples``, ``bytes``, ``sha256``, ``sidecar``, ``sums``, ``keys``)."""

    _FIXED = {**dict.fromkeys(_INTS, "<i8"), "sha256": "|u1", "sidecar_sha256": "|u1"}

    def __init__(self):
        self._folder = tempfile.TemporaryDirectory(prefix="wdsvlm-table-")
        names = (*self._FIXED, "name_bytes", "name_end", "key_bytes", "key_end")
        self._files = {n: open(os.path.join(self._folder.name, n), "wb") for n in names}
        self._ends = {"name": 0, "key": 0}
        self.rows = 0

    def add(self, shard: Mapping[str, Any]) -> None:
        where = f"shard {shard.get('name', '?')}"
        if shard["sidecar"]["name"] != sidecar_name(shard["name"]):
            raise ShardFormatError(
                f"{where}: its sidecar {shard['sidecar']['name']} is not named "
                f"{sidecar_name(shard['name'])}, as index version 3 names it"
            )
        sums = shard.get("sums", {})
        ints = [shard["samples"], shard["bytes"], shard["sidecar"]["bytes"]]
        ints += [sums.get(name, 0) for name in SUMS]
        for name, value in zip(_INTS, ints, strict=True):
            self._files[name].write(int(value).to_bytes(8, "little", signed=True))
        self._files["sha256"].write(bytes.fromhex(shard["sha256"]) if shard["sha256"] else _NONE)
        self._files["sidecar_sha256"].write(bytes.fromhex(shard["sidecar"]["sha256"]))
        keys = list(shard.get("keys") or ["", ""])
        for column, texts in (("name", [shard["name"]]), ("key", keys)):
            for text in texts:
                data = text.encode("utf-8")
                self._files[f"{column}_bytes"].write(data)
                self._ends[column] += len(data)
                self._files[f"{column}_end"].write(self._ends[column].to_bytes(8, "little"))
        self.rows += 1

    def finish(self, path: str) -> None:
        """Write the table to the local file ``path``."""
        for f in self._files.values():
            f.close()
        shapes = {n: [self.rows] for n in _INTS}
        shapes.update(sha256=[self.rows, 32], sidecar_sha256=[self.rows, 32])
        shapes.update(name_end=[self.rows], key_end=[2 * self.rows])
        shapes.update(name_bytes=[self._ends["name"]], key_bytes=[self._ends["key"]])
        dtypes = {**self._FIXED, "name_end": "<i8", "key_end": "<i8"}
        dtypes.update(name_bytes="|u1", key_bytes="|u1")
        header: dict[str, Any] = {"rows": self.rows, "columns": {}}
        offset, sizes = 0, {}
        for name in self._files:
            sizes[name] = os.path.getsize(os.path.join(self._folder.name, name))
            header["columns"][name] = {
                "dtype": dtypes[name],
                "shape": shapes[name],
                "offset": offset,
            }
            offset += -(-sizes[name] // 64) * 64
        text = json.dumps(header, separators=(",", ":")).encode()
        start = -(-(len(MAGIC) + 8 + len(text)) // 64) * 64
        with open(path, "wb") as out:
            out.write(MAGIC + len(text).to_bytes(8, "little") + text)
            for name in self._files:
                out.write(bytes(start + header["columns"][name]["offset"] - out.tell()))
                with open(os.path.join(self._folder.name, name), "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        self._folder.cleanup()


class ShardTable(Sequence):
    """The shards of a version-3 index: ``table[i]`` is shard ``i``'s entry as version 2 gives
    it (its ``entries`` from its sidecar when first asked for), made when asked for; columns as
    numpy arrays (``samples``, ``bytes``, ...) over a read-only map of a local file, or over the
    file's bytes for a remote one. A pickled table carries its address, not its data."""

    def __init__(self, source: str, url: str, storage_options=None, policy=None, sha256=None):
        self.source, self.url, self.sha256 = source, url, sha256
        self.storage_options, self.policy = dict(storage_options or {}), policy
        self._open()

    def _open(self) -> None:
        fs, path = filesystem(self.url, self.storage_options)
        try:
            if is_local(fs):
                with open(path, "rb") as f:
                    data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            else:
                data = read_bytes(self.url, self.storage_options, self.policy)
        except FileNotFoundError:
            raise ShardFormatError(
                f"{self.url}: the shard table is missing (index version 3 lists the shards there)"
            ) from None
        except ValueError as e:  # mmap of an empty file
            raise ShardFormatError(f"{self.url}: not a shard table ({e})") from None
        self._data = data
        self.columns = _columns(data, self.url)
        self.rows = len(self.columns["samples"])
        for name in _INTS:
            setattr(self, name, self.columns[name])

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in ("_data", "columns", *_INTS)}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return self.rows

    def name(self, i: int) -> str:
        return _text(self.columns["name_bytes"], self.columns["name_end"], i)

    def names(self, a: int, b: int) -> list[str]:
        """The names of shards ``a`` to ``b`` (a few bytes a shard, without a row each)."""
        ends = self.columns["name_end"]
        first = int(ends[a - 1]) if a else 0
        stops = ends[a:b].tolist()
        blob = self.columns["name_bytes"][first : stops[-1] if stops else first].tobytes()
        out, start = [], 0
        for stop in stops:
            out.append(blob[start : stop - first].decode("utf-8"))
            start = stop - first
        return out

    def sha256s(self, a: int, b: int) -> list[str | None]:
        """The sha256 (hex) of shards ``a`` to ``b``, None where the index has none."""
        rows = self.columns["sha256"][a:b]
        text = rows.tobytes().hex()
        none = (~rows.any(axis=1)).tolist()
        return [None if n else text[64 * i : 64 * i + 64] for i, n in enumerate(none)]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"shard {i} of {len(self)}")
        c = self.columns
        name = self.name(i)
        sidecar = {
            "name": sidecar_name(name),
            "bytes": int(c["sidecar_bytes"][i]),
            "sha256": c["sidecar_sha256"][i].tobytes().hex(),
        }
        sums = {s: int(c[s][i]) for s in SUMS if s != "videos" or c[s][i]}
        first, last = (_text(c["key_bytes"], c["key_end"], k) for k in (2 * i, 2 * i + 1))
        digest = c["sha256"][i].tobytes()
        return {
            "name": name,
            "samples": int(c["samples"][i]),
            "bytes": int(c["bytes"][i]),
            "sha256": None if digest == _NONE else digest.hex(),
            "sidecar": sidecar,
            "sums": sums,
            "keys": [first, last] if first or last else [],
            "entries": LazyEntries(
                join(self.source, sidecar["name"]),
                int(c["samples"][i]),
                self.storage_options,
                self.policy,
                sidecar["sha256"],
            ),
        }

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))


def _text(data: np.ndarray, ends: np.ndarray, i: int) -> str:
    start = int(ends[i - 1]) if i else 0
    return data[start : int(ends[i])].tobytes().decode("utf-8")


def _columns(data, where: str) -> dict[str, np.ndarray]:
    if len(data) < len(MAGIC) + 8 or bytes(data[: len(MAGIC)]) != MAGIC:
        raise ShardFormatError(f"{where}: not a wdsvlm shard table (no {MAGIC.decode()})")
    size = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
    try:
        header = json.loads(bytes(data[len(MAGIC) + 8 : len(MAGIC) + 8 + size]))
    except ValueError as e:
        raise ShardFormatError(f"{where}: its header is not JSON ({e})") from None
    start = -(-(len(MAGIC) + 8 + size) // 64) * 64
    columns = {}
    for name, spec in header["columns"].items():
        dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
        count = int(np.prod(shape)) if shape else 1
        at = start + spec["offset"]
        if at + count * dtype.itemsize > len(data):
            raise ShardFormatError(f"{where}: its column {name} ends past the file (truncated)")
        columns[name] = np.frombuffer(data, dtype, count, at).reshape(shape)
    missing = {*_INTS, "sha256", "sidecar_sha256", "name_bytes", "name_end"} - set(columns)
    if missing or any(len(columns[n]) != header["rows"] for n in _INTS):
        raise ShardFormatError(f"{where}: a shard table lacks or cuts short {sorted(missing)}")
    return columns


def write_table(folder: str, shards: Iterable[Mapping[str, Any]], storage_options=None) -> dict:
    """Publish ``index.shards`` of ``shards`` (taken one at a time) in ``folder``; return what
    ``index.json`` says of it (``name``, ``bytes``, ``sha256``)."""
    builder = TableBuilder()
    for shard in shards:
        builder.add(shard)
    url = join(folder, TABLE_NAME)
    tmp = staging_file(url, storage_options)
    builder.finish(tmp)
    digest, size = hashlib.sha256(), 0
    with open(tmp, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    publish_file(tmp, url, storage_options)
    return {"name": TABLE_NAME, "bytes": size, "sha256": digest.hexdigest()}


__all__ = ["TABLE_NAME", "ShardTable", "TableBuilder", "write_table"]
