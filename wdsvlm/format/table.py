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

The table is named by its digest (``index-<16 hex digits of its sha256>.shards``; datasets
written before that use ``index.shards``), written before ``index.json`` and the table an
earlier ``index.json`` named removed after it: a dataset rewritten in place never shows the
new table under the old ``index.json``. Every open (each DataLoader worker and Ray actor opens
it again by its path) checks the file's size and row count against what ``index.json`` says
of it: two numbers, so opening stays O(1) whatever the table's size (``wdsvlm verify`` checks
its sha256 too, reading it whole). A process that opened the table before a rewrite keeps the
old map; each row it gives makes its shard's ``LazyEntries`` anew, which checks the shard's
sidecar against the row's ``sidecar_bytes`` and ``sidecar_sha256`` (``sidecar.LazyEntries``):
the new shards are not read with the old rows.

A table on a store (S3, GCS, HTTP, the Hub) is fetched once per node, not once per process:
into the node-local folder (``ReadPolicy.node_dir``, the Loader's ``local_dir``; else
``storage.folders.node_folder``'s default) as ``tables/<its sha256>.shards``, under a lock, checked
against the sha256 ``index.json`` names before it is renamed into place
(``storage.node.node_copy``); every process of the node then maps that file. A copy found
damaged (not a table at its right size) is fetched anew once. A table whose ``index.json``
records no sha256 is read whole by each process, as is any table of a hand-made index.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ShardFormatError
from ..storage.folders import node_folder
from ..storage.fs import filesystem, is_local, join, publish_file, read_bytes, staging_file
from ..storage.node import node_copy
from .sidecar import LazyEntries, sidecar_name

log = logging.getLogger("wdsvlm.table")

TABLES = "tables"
"""The subfolder of the node-local folder that holds the copies of remote tables."""
TABLE_NAME = "index.shards"
"""The table's name in datasets written before tables were named by their digest."""
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
    numpy arrays (``samples``, ``bytes``, ...) over a read-only map of a local file, or of the
    node's copy of a remote one. ``described``: what ``index.json`` (at the URL ``index``)
    says of the table (``name``, ``bytes``, ``sha256``, ``rows``), checked on every open
    (``rows`` of an index that does not record it: its shard total). A pickled table carries
    its address, not its data, and opens again (checked) when first used where it is
    unpickled."""

    def __init__(
        self, source: str, url: str, storage_options=None, policy=None, described=None, index=None
    ):
        self.source, self.url, self.index_url = source, url, index
        self.described = dict(described or {})
        self.storage_options, self.policy = dict(storage_options or {}), policy
        self._open()

    @property
    def table_sha256(self) -> str | None:
        """The table file's own sha256, as ``index.json`` records it (``shard_sha256s``: the
        shards' digests)."""
        return self.described.get("sha256")

    def _open(self) -> None:
        fs, path = filesystem(self.url, self.storage_options)
        try:
            if is_local(fs):
                data, columns = self._read(_map(path), self.url)
            elif self.table_sha256 and self.described.get("bytes") is not None:
                data, columns = self._node_copy()
            else:  # no digest to name a node's copy by: each process reads it whole
                data = read_bytes(self.url, self.storage_options, self.policy)
                data, columns = self._read(data, self.url)
        except FileNotFoundError:
            raise ShardFormatError(
                f"{self.url}: the shard table is missing (index version 3 lists the shards "
                f"there){_rewritten(self.index_url, self.url, self.storage_options, self.policy)}"
            ) from None
        except ValueError as e:  # mmap of an empty file
            raise ShardFormatError(f"{self.url}: not a shard table ({e})") from None
        self.__dict__.update(_data=data, columns=columns, rows=len(columns["samples"]))
        for name in _INTS:
            self.__dict__[name] = columns[name]

    def _read(self, data, where: str) -> tuple[Any, dict[str, np.ndarray]]:
        columns = _columns(data, where)
        self._check(len(data), len(columns["samples"]))
        return data, columns

    def _node_copy(self) -> tuple[Any, dict[str, np.ndarray]]:
        """The table mapped from this node's copy, fetched by the first process of the node
        that opens it (``storage.node.node_copy``); a copy that is not a table at its right
        size (damaged on disk) is fetched anew once."""
        folder = os.path.join(
            node_folder(getattr(self.policy, "node_dir", None), make=False), TABLES
        )
        where = (self.url, self.table_sha256, self.described["bytes"], folder, ".shards")
        options = {"storage_options": self.storage_options, "policy": self.policy}
        path = node_copy(*where, **options)
        inode = os.stat(path).st_ino
        try:
            return self._read(_map(path), path)
        except ShardFormatError as e:
            log.warning("%s: this node's copy is damaged (%s); fetching it anew", path, e)
        path = node_copy(*where, **options, wrong=inode)
        try:
            return self._read(_map(path), path)
        except ShardFormatError as e:
            raise ShardFormatError(
                f"{self.url}: its copy in {folder} is damaged even fetched anew ({e}): check "
                "the node's disk, or give the Loader another local_dir"
            ) from None

    def _check(self, size: int, rows: int) -> None:
        """The file is the one ``index.json`` names: its size and row count as recorded."""
        said = {"bytes": self.described.get("bytes"), "rows": self.described.get("rows")}
        found = {"bytes": size, "rows": rows}
        wrong = [k for k, v in said.items() if v is not None and v != found[k]]
        if wrong:
            raise ShardFormatError(
                f"{self.url}: {size} bytes and {rows} shards, but the index.json that names it "
                f"says {said['bytes']} bytes and {said['rows']} shards: the dataset was "
                "rewritten in place after that index.json was read (build a new Loader to "
                "read the dataset as it is now), or the table was damaged (`wdsvlm verify`)"
            )

    def __getattr__(self, name):
        # only for names not set yet: the columns of a table unpickled and not opened yet
        if name in _OPENED:
            self._open()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k not in _OPENED}

    def __setstate__(self, state):
        self.__dict__.update(state)  # opened (and checked) when first used, where it is used

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

    def shard_sha256s(self, a: int, b: int) -> list[str | None]:
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
                sidecar["bytes"],
                name,
            ),
        }

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))


_OPENED = ("_data", "columns", "rows", *_INTS)
"""What a table holds once its file is opened: not pickled, made again where it is unpickled."""


def _rewritten(index: str | None, url: str, storage_options, policy) -> str:
    """Why a table named by the ``index.json`` at ``index`` is gone: it names another now, or
    it is gone too."""
    if index is None:
        return ""
    try:
        now = json.loads(read_bytes(index, storage_options, policy))
        name = now["table"]["name"]
    except FileNotFoundError:
        return (
            f"; {index} is gone too: the dataset is being rewritten in place (build a new "
            "Loader once it is written)"
        )
    except Exception:  # noqa: BLE001 - only an explanation; the error is raised either way
        return ""
    if name == url.rsplit("/", 1)[-1].rsplit(os.sep, 1)[-1]:
        return ""
    return (
        f"; {index} now names {name}: the dataset was rewritten in place after it was read "
        "(build a new Loader to read the dataset as it is now)"
    )


def _map(path: str) -> mmap.mmap:
    """The local file ``path`` mapped read-only: its pages shared by every process that maps
    it."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def table_name(sha256: str) -> str:
    """The name of the table of this sha256: ``index-<its first 16 hex digits>.shards``."""
    return f"index-{sha256[:16]}.shards"


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
    """Publish the table of ``shards`` (taken one at a time) in ``folder``, named by its digest
    (``table_name``); return what ``index.json`` says of it (``name``, ``bytes``, ``sha256``,
    ``rows``)."""
    builder = TableBuilder()
    for shard in shards:
        builder.add(shard)
    tmp = staging_file(join(folder, TABLE_NAME), storage_options)
    builder.finish(tmp)
    digest, size = hashlib.sha256(), 0
    with open(tmp, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    name = table_name(digest.hexdigest())
    publish_file(tmp, join(folder, name), storage_options)
    return {"name": name, "bytes": size, "sha256": digest.hexdigest(), "rows": builder.rows}


__all__ = ["TABLE_NAME", "ShardTable", "TableBuilder", "table_name", "write_table"]
