"""The shard format's table of contents: ``index.json``, and the names it gives things.

See docs/format.md for the layout. The index is what makes exact splitting,
``len()``, resume and planning possible without reading the data. This module reads and
checks an index; ``builder`` makes one.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ShardFormatError
from ..storage.fs import filesystem, join, read_bytes
from .prefixes import placed

FORMAT = "wdsvlm"
VERSION = 3
"""Written: the shards in a binary table beside index.json (``table.py``). Version 2 (every
shard's entry in index.json, its samples in its sidecar) is written on request, and read, as
is version 1 (every sample's entry in index.json); ``wdsvlm index --upgrade`` makes 3 of them."""
NEWEST = VERSION
READABLE = (1, 2, 3)
INDEX_NAME = "index.json"
SKIPPED_NAME = "skipped.jsonl"
"""The writer's list of the bad records it skipped."""
INDEX_SKIPPED_NAME = "index-skipped.jsonl"
"""``wdsvlm index``'s list of the bad samples it skipped: a name apart, so that indexing the
tars of a written dataset again leaves the writer's list as it was."""


def shard_name(prefix: str, number: int, prefixes: int | None = None) -> str:
    """The writer's name of shard ``number``: ``PREFIX-000123.tar``, in its prefix folder
    when the shards are spread over ``prefixes`` folders (``prefixes.placed``)."""
    return placed(f"{prefix}-{number:06d}.tar", number, prefixes)


def sample_key(number: int) -> str:
    """The tar key of the dataset's ``number``-th sample: digits only, so never a dot in it."""
    return f"{number:09d}"


def dumps_index(index: Mapping[str, Any]) -> bytes:
    """Canonical bytes of an index: the same index always gives the same bytes."""
    return (json.dumps(index, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


def load_index(source: str, storage_options: Mapping[str, Any] | None = None, policy=None) -> dict:
    """Read and check ``index.json`` of the dataset folder or URL prefix ``source``
    (``policy``: the ``storage.ReadPolicy`` of the read)."""
    url = join(source, INDEX_NAME)
    try:
        data = read_bytes(url, storage_options, policy)
    except FileNotFoundError:
        raise ShardFormatError(
            f"{url} not found: {source} is not a wdsvlm dataset (write one with `wdsvlm write`)"
        ) from None
    try:
        index = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ShardFormatError(f"{url} is not valid JSON: {e}") from None
    check_index(index, url)
    if index["version"] >= 3:  # the shards from their table, mapped
        from .table import ShardTable

        table = dict(index["table"])  # checked at every open: a size and a row count
        table.setdefault("rows", index.get("totals", {}).get("shards"))
        index["shards"] = ShardTable(
            source, join(source, table["name"]), storage_options, policy, table, url
        )
    elif index["version"] >= 2:  # each shard's entries from its sidecar, when first needed
        from .sidecar import LazyEntries

        for shard in index["shards"]:
            sidecar = join(source, shard["sidecar"]["name"])
            shard["entries"] = LazyEntries(
                sidecar,
                shard["samples"],
                storage_options,
                policy,
                shard["sidecar"].get("sha256"),
                shard["sidecar"].get("bytes"),
                shard["name"],
            )
    return index


def shard_url(source: str, index: Mapping[str, Any], shard: Mapping[str, Any]) -> str:
    """Where a shard of the index of ``source`` lies: beside the index, or under the index's
    ``shard_root`` (an index made by ``wdsvlm index --output`` for tars elsewhere). Its name
    is its path there, a folder in it where it has one (``4/data-000001.tar``: written with
    ``--prefixes``; ``part-000/data-000000.tar``: merged)."""
    root = index.get("shard_root")
    if root is None:
        return join(source, shard["name"])
    if "://" not in root and not os.path.isabs(root):
        root = join(source, root)
    return join(root, shard["name"])


def shard_urls(source: str, index: Mapping[str, Any]) -> Sequence[str]:
    """The URL of each shard of the index of ``source`` (``shard_url``): a list, or for a
    shard table a sequence that makes each when asked for (no million strings held)."""
    shards = index["shards"]
    if not hasattr(shards, "name"):
        return [shard_url(source, index, s) for s in shards]
    return _TableURLs(source, index)


class _TableURLs(Sequence):
    def __init__(self, source: str, index: Mapping[str, Any]):
        self.source, self.shard_root, self.table = source, index.get("shard_root"), index["shards"]

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        index = {"shard_root": self.shard_root}
        return shard_url(self.source, index, {"name": self.table.name(range(len(self))[i])})


def check_index(index: Any, where: str) -> None:
    """Raise ``ShardFormatError`` naming ``where`` unless ``index`` has the layout of a
    version this wdsvlm reads (1: entries in the index; 2: entries in sidecars)."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ShardFormatError(f'{where}: not a wdsvlm index (no "format": "{FORMAT}")')
    version = index.get("version")
    if version not in READABLE:
        raise ShardFormatError(
            f"{where}: index version {version!r}; this wdsvlm reads versions "
            f"{', '.join(map(str, READABLE))} (upgrade wdsvlm, or rewrite the dataset)"
        )
    if version >= 3:
        table = index.get("table")
        if not isinstance(table, dict) or not isinstance(table.get("name"), str):
            raise ShardFormatError(f"{where}: index version 3 names its shard table ('table')")
        return
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise ShardFormatError(f"{where}: 'shards' must be a list")
    needed = {"name", "samples", "bytes", "sha256", "entries" if version == 1 else "sidecar"}
    for shard in shards:
        missing = needed - set(shard)
        if missing:
            raise ShardFormatError(
                f"{where}: shard {shard.get('name', '?')} lacks {', '.join(sorted(missing))}"
            )
        if version == 1 and len(shard["entries"]) != shard["samples"]:
            raise ShardFormatError(
                f"{where}: shard {shard['name']} lists {len(shard['entries'])} entries "
                f"but says it holds {shard['samples']} samples"
            )


def shard_summary(entries: Sequence[Mapping[str, Any]]) -> dict:
    """What the root index of version 2 says of a shard's samples besides their number:
    sums for sizing (images, videos where there are any, turns, characters, text-only
    samples) and the first and last key (so that a key is looked up in the sidecars of the
    shards that can hold it)."""
    sums = {
        "images": sum(len(e.get("images", [])) for e in entries),
        "text_only": sum(not e.get("images") and not e.get("videos") for e in entries),
        "turns": sum(len(e.get("chars", [])) for e in entries),
        "chars": sum(sum(e.get("chars", [])) for e in entries),
    }
    if videos := sum(len(e.get("videos", [])) for e in entries):
        sums["videos"] = videos
    return {"sums": sums, "keys": [entries[0]["key"], entries[-1]["key"]] if len(entries) else []}


def sidecar_entry(name: str, data: bytes) -> dict:
    return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def verify_dataset(
    source: str, storage_options: Mapping[str, Any] | None = None, sample: int | None = None
) -> dict:
    """Check every shard's size and sha256 against the index (and its sidecar's, and the
    shard table's); return the index. ``sample=N``: N shards drawn at random (the table and
    the root index are checked whole), for a dataset too large to read through.

    Raises ``ShardFormatError`` naming the first shard that is missing or differs.
    """
    index = load_index(source, storage_options)
    if index["version"] >= 3:
        table = index["table"]
        _check_file(join(source, table["name"]), table, storage_options, "shard table")
    shards = index["shards"]
    numbers: Sequence[int] = range(len(shards))
    if sample is not None:
        if sample < 1:
            raise ValueError(f"sample must be at least 1 shard, not {sample}")
        numbers = sorted(random.Random().sample(numbers, min(sample, len(shards))))
    index["checked"] = len(numbers)
    for number in numbers:
        shard = shards[number]
        _check_file(shard_url(source, index, shard), shard, storage_options, "shard")
        if index["version"] >= 2:
            _verify_sidecar(source, shard, storage_options)
    return index


def _check_file(url: str, expected: Mapping[str, Any], storage_options, what: str) -> None:
    """The file at ``url`` has the ``bytes`` and ``sha256`` the index says, or that is a
    ``ShardFormatError`` naming it."""
    size, digest = _digest(url, storage_options, what)
    if size != expected["bytes"] or digest != expected["sha256"]:
        raise ShardFormatError(
            f"{url}: {size} bytes, sha256 {digest[:12]}...; the index says "
            f"{expected['bytes']} bytes, sha256 {expected['sha256'][:12]}... "
            "(changed or truncated)"
        )


def _digest(url: str, storage_options, what: str) -> tuple[int, str]:
    fs, path = filesystem(url, storage_options)
    digest = hashlib.sha256()
    size = 0
    try:
        with fs.open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
                size += len(block)
    except FileNotFoundError:
        raise ShardFormatError(f"{url}: {what} listed in the index is missing") from None
    return size, digest.hexdigest()


def _verify_sidecar(source: str, shard: dict, storage_options) -> None:
    """A version-2 shard's sidecar: its bytes and sha256 as the root index says, its
    samples as many as the shard's, each inside the shard."""
    url = join(source, shard["sidecar"]["name"])
    _check_file(url, shard["sidecar"], storage_options, "sidecar")
    entries = shard["entries"].loaded()
    ends = entries.offset + entries.size
    if len(entries) and (entries.offset.min() < 0 or ends.max() > shard["bytes"]):
        raise ShardFormatError(f"{url}: a sample lies outside its shard's {shard['bytes']} bytes")
