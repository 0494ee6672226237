"""Building an index: the one place both ``wdsvlm write`` and ``wdsvlm index`` make theirs.

A sample's entry (its byte range, images' displayed sizes, characters per turn), a shard's
sidecar and its entry in the root index, the dataset's totals, the root ``index.json``, the
list of skipped records or samples, and the refusal of bad input. Version-1 indexes are
upgraded here too: their shards get the sidecars a version-2 index names.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import BadInputError, InputError
from ..storage.fs import join, list_names, publish_bytes, remove
from .documents import KINDS
from .index import (
    FORMAT,
    INDEX_NAME,
    NEWEST,
    VERSION,
    dumps_index,
    load_index,
    shard_summary,
    sidecar_entry,
)
from .sidecar import pack_entries, sidecar_name
from .table import TABLE_NAME, write_table


def sample_entry(
    key: str,
    offset: int,
    size: int,
    images: Sequence[Sequence[int]],
    chars: Sequence[int],
    videos: Sequence[Mapping[str, Any]] = (),
    kind: str = "conversation",
    elements: Sequence[int] = (),
) -> dict:
    """A sample's entry: its key, where its members lie in the tar (``offset``, ``size``
    bytes), its images' displayed ``[width, height]``, its turns' characters (a document's or
    caption's: its texts') and, if it has any, what the index records of its videos
    (``format.videos.VideoInfo.as_dict``). A document or caption (``kind``) has its ``kind``
    as a number (``KINDS.index``) and its ``elements`` (``documents.element_numbers``)."""
    entry = {
        "key": key,
        "offset": offset,
        "size": size,
        "images": [list(wh) for wh in images],
        "chars": list(chars),
    }
    if videos:
        entry["videos"] = [dict(v) for v in videos]
    if kind != "conversation":
        entry["kind"] = KINDS.index(kind)
        entry["elements"] = list(elements)
    return entry


def publish_sidecar(
    output: str,
    shard: str,
    entries: Sequence[Mapping[str, Any]],
    size: int,
    sha256: str,
    storage_options: Mapping[str, Any] | None = None,
) -> dict:
    """Publish the sidecar of the shard named ``shard`` (its samples' ``entries``) under
    ``output``; return the shard's entry in the root index (the shard is ``size`` bytes with
    that ``sha256``)."""
    data = pack_entries(entries)
    name = sidecar_name(shard)
    publish_bytes(data, join(output, name), storage_options)
    return {
        "name": shard,
        "samples": len(entries),
        "bytes": size,
        "sha256": sha256,
        "sidecar": sidecar_entry(name, data),
        **shard_summary(entries),
    }


@dataclass
class Totals:
    """The dataset's totals, added up sample by sample."""

    samples: int = 0
    images: int = 0
    text_only: int = 0
    multi_image: int = 0
    turns: int = 0
    chars: int = 0
    videos: int = 0
    sources: Counter = field(default_factory=Counter)
    documents: int = 0
    captions: int = 0
    dropped_images: Counter = field(default_factory=Counter)
    """Images dropped from documents and captions, by reason (the rest of each kept)."""
    left_out: int = 0
    """Captions not written: their image was dropped."""

    def add(
        self,
        images: int,
        chars: Sequence[int],
        source: str,
        videos: int = 0,
        kind: str = "conversation",
    ) -> None:
        """One sample of ``images`` images, ``videos`` videos, ``chars`` characters per turn
        (a document's or caption's, per text), from ``source``; its ``kind``."""
        self.documents += kind == "document"
        self.captions += kind == "caption"
        self.samples += 1
        self.images += images
        self.videos += videos
        self.text_only += images == 0 and videos == 0
        self.multi_image += images > 1
        self.turns += len(chars)
        self.chars += sum(chars)
        self.sources[source] += 1

    def drop(self, dropped: Mapping[str, int], left_out: bool = False) -> None:
        """Count a document's or caption's ``dropped`` images (by reason) and, if it is a
        caption ``left_out`` for want of its image, that."""
        self.dropped_images.update(dropped)
        self.left_out += left_out

    def update(self, other: Totals) -> None:
        """Add ``other``'s samples (another shard's, counted elsewhere)."""
        counts = ("samples", "images", "videos", "text_only", "multi_image", "turns", "chars")
        for name in (*counts, "documents", "captions", "left_out"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.sources.update(other.sources)
        self.dropped_images.update(other.dropped_images)


class SpilledShards:
    """Shards' root entries as they are written, kept in a temporary file rather than in
    memory (a million shards would be a gigabyte of dicts), read back in order as often as
    asked. ``len()`` and ``bytes`` are counted as they come."""

    def __init__(self):
        self._file = tempfile.TemporaryFile()
        self.count = self.bytes = 0

    def append(self, shard: Mapping[str, Any]) -> None:
        self._file.seek(0, os.SEEK_END)
        self._file.write(json.dumps(shard, separators=(",", ":")).encode() + b"\n")
        self.count += 1
        self.bytes += shard["bytes"]

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        self._file.flush()
        self._file.seek(0)
        for line in self._file:
            yield json.loads(line)

    def close(self) -> None:
        self._file.close()


def root_index(
    shards: list[dict] | SpilledShards,
    totals: Totals,
    skipped: Mapping[str, int],
    *,
    prefix: str | None = None,
    layout: Mapping[str, Any] | None = None,
    shard_root: str | None = None,
    prefixes: int | None = None,
) -> dict:
    """The root ``index.json`` of ``shards`` (their root entries): the writer's names its
    shards' ``prefix`` and, where it spread them over prefix folders, their number
    (``prefixes``: for the record; the shards' names say where each is); one of tars made
    elsewhere names their sample ``layout`` and, when it lies apart from them, where they are
    (``shard_root``)."""
    index: dict[str, Any] = {"format": FORMAT, "version": VERSION}
    if prefix is not None:
        index["prefix"] = prefix
    if prefixes is not None:
        index["prefixes"] = prefixes
    if layout is not None:
        index["layout"] = dict(layout)
    index["shards"] = shards
    index["totals"] = {
        "shards": len(shards),
        "samples": totals.samples,
        "bytes": shards.bytes
        if isinstance(shards, SpilledShards)
        else sum(s["bytes"] for s in shards),
        "images": totals.images,
        "text_only": totals.text_only,
        "multi_image": totals.multi_image,
        "turns": totals.turns,
        "chars": totals.chars,
        "sources": dict(sorted(totals.sources.items())),
        "skipped": dict(sorted(skipped.items())),
    }
    if totals.videos:  # a dataset of images only says as before
        index["totals"]["videos"] = totals.videos
    for name in ("documents", "captions"):  # and one of conversations only
        if getattr(totals, name):
            index["totals"][name] = getattr(totals, name)
    if totals.dropped_images:
        index["totals"]["dropped_images"] = dict(sorted(totals.dropped_images.items()))
    if totals.left_out:
        index["totals"]["left_out_captions"] = totals.left_out
    if shard_root is not None:
        index["shard_root"] = shard_root
    return index


def publish_root(
    output: str,
    index: Mapping[str, Any],
    storage_options: Mapping[str, Any] | None = None,
    version: int = NEWEST,
) -> None:
    """Publish the root index ``index`` (its ``shards`` any iterable) at ``output`` as ``version``
    lays it out: 3, the shard table first (named by its digest), then a small ``index.json``;
    2, every shard's entry in ``index.json``. ``index.json`` comes last, so a reader sees a whole
    index or none, and the tables of earlier indexes there are removed after it: a reader of an
    old ``index.json`` is told, when it opens its table again, that the dataset changed."""
    if version not in (2, NEWEST):
        raise ValueError(f"index_version must be 2 or {NEWEST}, not {version!r}")
    root = dict(index)
    if version >= 3:
        table = write_table(output, root.pop("shards"), storage_options)
        root.update(version=version, table=table)
    else:
        root.update(version=version, shards=list(root["shards"]))
    publish_bytes(dumps_index(root), join(output, INDEX_NAME), storage_options)
    remove_tables(output, storage_options, keep=root.get("table", {}).get("name"))


def remove_tables(
    output: str, storage_options: Mapping[str, Any] | None = None, keep: str | None = None
) -> None:
    """Remove the shard tables at ``output`` but ``keep``: those of earlier indexes there
    (named by their digest, or ``index.shards``). A writer that replaces a dataset calls it
    with its old ``index.json``, so that no reader of that index pairs its table with new
    shards; ``publish_root`` after the new ``index.json``."""
    for name in list_names(output, storage_options):
        if name != keep and (name == TABLE_NAME or _DIGEST_NAMED.fullmatch(name)):
            remove(join(output, name), storage_options)


_DIGEST_NAMED = re.compile(r"index-[0-9a-f]{16}\.shards")
"""The name of a table of an earlier index there (``table.table_name``)."""


def publish_skipped(
    bad: Sequence[InputError], url: str, storage_options: Mapping[str, Any] | None = None
) -> Counter:
    """List the ``bad`` records or samples at ``url``, one JSON object a line (see
    ``InputError.listed``), or remove the list an earlier run left there when there are
    none. Returns their number per reason."""
    if bad:
        lines = (json.dumps(e.listed()) for e in bad)
        publish_bytes(("\n".join(lines) + "\n").encode("utf-8"), url, storage_options)
    else:
        remove(url, storage_options)
    return Counter(e.reason for e in bad)


def stops(bad: Sequence[InputError], good: int, skip_bad: bool) -> bool:
    """Whether a run over ``good`` good and ``bad`` bad records or samples must stop without
    an index: bad ones found without ``skip_bad``, or nothing good."""
    return bool(bad) and not skip_bad or not good


def refuse_bad(
    bad: list[InputError], good: int, skip_bad: bool, *, items: str, outcome: str, empty: str
) -> None:
    """Stop a run that ``stops``: ``BadInputError`` (``items``, ``outcome``: see there) when
    there are bad records or samples, else ``ValueError(empty)`` (there was nothing)."""
    if not stops(bad, good, skip_bad):
        return
    if bad:
        raise BadInputError(bad, good + len(bad), items=items, outcome=outcome)
    raise ValueError(empty)


def upgrade_dataset(
    source: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[int, dict]:
    """Turn the version-1 or 2 index of ``source`` into version 3 without touching its tars:
    a version-1 shard's sidecar is written beside it, then the shard table, then
    ``index.json`` is replaced (last, so a reader sees the old index or the new one). Returns
    the version found and the index now."""
    index = load_index(source, storage_options)
    before = index["version"]
    if before == NEWEST:
        return before, index
    shards = []
    for shard in index["shards"]:
        shard = dict(shard)
        entries = shard.pop("entries")
        if before == 1:
            args = (shard["name"], entries, shard["bytes"], shard["sha256"], storage_options)
            shard.update(publish_sidecar(source, *args))
        shards.append(shard)
    publish_root(source, {**index, "shards": shards}, storage_options)
    return before, load_index(source, storage_options)
