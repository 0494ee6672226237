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
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import ShardFormatError
from ..storage.fs import filesystem, is_local, join, publish_bytes, read_bytes
from .sidecar import LazyEntries, sidecar_name

TABLE_NAME = "index.shards"
MAGIC = b"WDSVLMT1"
SUMS = ("images", "text_only", "turns", "chars", "videos")
_INTS = ("samples", "bytes", "sidecar_bytes", *SUMS)


def table_bytes(shards: Iterable[Mapping[str, Any]]) -> bytes:
    """The ``index.shards`` bytes of version-2 shard entries (``name``, ``samples``, ``bytes``,
    ``sha256``, ``sidecar``, ``sums``, ``keys``)."""
    ints: dict[str, list[int]] = {name: [] for name in _INTS}
    digests, sidecar_digests, names, keys = [], [], [], []
    for shard in shards:
        if shard["sidecar"]["name"] != sidecar_name(shard["name"]):
            raise ShardFormatError(
                f"shard {shard['name']}: its sidecar {shard['sidecar']['name']} is not named "
                f"{sidecar_name(shard['name'])}, as index version 3 names it"
            )
        sums = shard.get("sums", {})
        for name in SUMS:
            ints[name].append(int(sums.get(name, 0)))
        ints["samples"].append(int(shard["samples"]))
        ints["bytes"].append(int(shard["bytes"]))
        ints["sidecar_bytes"].append(int(shard["sidecar"]["bytes"]))
        digests.append(bytes.fromhex(shard["sha256"]))
        sidecar_digests.append(bytes.fromhex(shard["sidecar"]["sha256"]))
        names.append(shard["name"].encode("utf-8"))
        first_last = list(shard.get("keys") or ["", ""])
        keys += [k.encode("utf-8") for k in first_last]
    columns: dict[str, np.ndarray] = {n: np.asarray(v, dtype="<i8") for n, v in ints.items()}
    columns["sha256"] = np.frombuffer(b"".join(digests), np.uint8).reshape(-1, 32)
    columns["sidecar_sha256"] = np.frombuffer(b"".join(sidecar_digests), np.uint8).reshape(-1, 32)
    for name, parts in (("name", names), ("key", keys)):
        columns[f"{name}_bytes"] = np.frombuffer(b"".join(parts), np.uint8)
        columns[f"{name}_end"] = np.cumsum([len(p) for p in parts], dtype="<i8")
    return _layout(columns, len(names))


def _layout(columns: Mapping[str, np.ndarray], rows: int) -> bytes:
    header: dict[str, Any] = {"rows": rows, "columns": {}}
    offset = 0
    for name, array in columns.items():
        header["columns"][name] = {
            "dtype": array.dtype.str,
            "shape": list(array.shape),
            "offset": offset,
        }
        offset += -(-array.nbytes // 64) * 64
    text = json.dumps(header, separators=(",", ":")).encode()
    start = -(-(len(MAGIC) + 8 + len(text)) // 64) * 64
    out = bytearray(start + offset)
    out[: len(MAGIC)] = MAGIC
    out[len(MAGIC) : len(MAGIC) + 8] = len(text).to_bytes(8, "little")
    out[len(MAGIC) + 8 : len(MAGIC) + 8 + len(text)] = text
    for name, array in columns.items():
        at = start + header["columns"][name]["offset"]
        out[at : at + array.nbytes] = np.ascontiguousarray(array).tobytes()
    return bytes(out)


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
        return {
            "name": name,
            "samples": int(c["samples"][i]),
            "bytes": int(c["bytes"][i]),
            "sha256": c["sha256"][i].tobytes().hex(),
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


def write_table(folder: str, shards: Sequence[Mapping[str, Any]], storage_options=None) -> dict:
    """Publish ``index.shards`` of ``shards`` in ``folder``; return what ``index.json`` says
    of it (``name``, ``bytes``, ``sha256``)."""
    data = table_bytes(shards)
    publish_bytes(data, join(folder, TABLE_NAME), storage_options)
    return {"name": TABLE_NAME, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


__all__ = ["TABLE_NAME", "ShardTable", "table_bytes", "write_table"]
