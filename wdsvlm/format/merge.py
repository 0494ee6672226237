"""One index over several datasets written apart: ``wdsvlm index OUT --merge PART ...``.

Several writers (processes, machines, or Ray jobs) each write a dataset into a folder of its
own inside ``OUT`` (``OUT/part-000``, ``OUT/part-001``, ...). Merging writes one root index at
``OUT`` whose shards are theirs, in the order the parts are given, named by their path under
``OUT`` (``part-000/data-000000.tar``): no shard or sidecar is copied or rewritten. The shards
stream through a ``TableBuilder``, so memory does not grow with their number; the shard table
is published first and ``index.json`` last, so a reader sees the merged index whole or not at
all. The parts' own indexes stay, and each part still loads alone. An index already at ``OUT``
(a dataset written there, or an earlier merge) is replaced only with ``overwrite=True``: the
shards it lists that no part holds would be left on the store, listed by no index.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..errors import DatasetExistsError, ShardFormatError
from ..storage.fs import exists, join
from .builder import publish_root
from .index import FORMAT, INDEX_NAME, load_index

_SUMMED = (
    "samples",
    "bytes",
    "images",
    "videos",
    "text_only",
    "multi_image",
    "turns",
    "chars",
    "documents",
    "captions",
    "left_out_captions",
)


def merge_indexes(
    output: str,
    parts: Sequence[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    index_version: int = 3,
    overwrite: bool = False,
) -> dict:
    """Write one index at ``output`` over the datasets ``parts`` (folders or URLs inside
    ``output``, or paths relative to it); return it as ``load_index`` reads it. An index at
    ``output`` already is refused (``DatasetExistsError``) unless ``overwrite``; the parts are
    checked first, so a merge that is refused for any reason leaves it as it was."""
    if not parts:
        raise ValueError("nothing to merge: name the datasets (folders inside the output)")
    names = [_relative(output, part) for part in parts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{output}: a dataset to merge is named twice: {twice}")
    indexes = [load_index(join(output, name), storage_options) for name in names]
    for name, index in zip(names, indexes, strict=True):
        where = join(output, name)
        if index["version"] < 2:
            raise ShardFormatError(
                f"{where}: index version 1; upgrade it first (wdsvlm index {where} --upgrade)"
            )
        if index.get("shard_root") is not None:
            raise ShardFormatError(
                f"{where}: its index lists tars that lie elsewhere ({index['shard_root']}); "
                "merge datasets whose shards lie beside their index"
            )
    layouts = {repr(index.get("layout")) for index in indexes}
    if len(layouts) > 1:
        raise ShardFormatError(
            f"{output}: the datasets to merge have other sample layouts ({sorted(layouts)}); "
            "one index reads one layout"
        )
    if not overwrite and exists(join(output, INDEX_NAME), storage_options):
        raise DatasetExistsError(
            f"{output} already holds a dataset ({INDEX_NAME}); merging would replace its index "
            "and leave the shards it lists that no part holds on the store, listed by no "
            "index. Pass --overwrite / overwrite=True to replace it (an earlier merge, say), "
            "or merge into another folder"
        )
    root: dict[str, Any] = {"format": FORMAT, "version": index_version}
    if indexes[0].get("layout") is not None:
        root["layout"] = indexes[0]["layout"]
    root["shards"] = _shards(names, indexes)
    root["totals"] = _totals(indexes)
    publish_root(output, root, storage_options, index_version)
    return load_index(output, storage_options)


def _shards(names: Sequence[str], indexes: Sequence[dict]) -> Iterator[dict]:
    for name, index in zip(names, indexes, strict=True):
        for shard in index["shards"]:
            out = {k: v for k, v in shard.items() if k != "entries"}
            out["name"] = f"{name}/{shard['name']}"
            out["sidecar"] = {**shard["sidecar"], "name": f"{name}/{shard['sidecar']['name']}"}
            yield out


def _totals(indexes: Sequence[dict]) -> dict:
    totals: dict[str, Any] = {"shards": sum(len(index["shards"]) for index in indexes)}
    for key in _SUMMED:
        found = [index["totals"].get(key) for index in indexes]
        if any(v is not None for v in found):
            totals[key] = sum(v or 0 for v in found)
    for key in ("sources", "skipped", "dropped_images"):
        counts: Counter = Counter()
        for index in indexes:
            counts.update(index["totals"].get(key, {}))
        if counts or key != "dropped_images":  # (as the writer: only where there are)
            totals[key] = dict(sorted(counts.items()))
    return totals


def _relative(output: str, part: str) -> str:
    """``part``'s path under ``output``, refused if it lies elsewhere."""
    base = output.rstrip("/")
    if "://" in base or "://" in part:
        if "://" in part:
            if not part.startswith(base + "/"):
                raise ValueError(f"{part} does not lie inside {output}")
            part = part[len(base) + 1 :]
        name = part.strip("/")
    else:
        if os.path.isabs(part) or os.path.exists(part) and not os.path.exists(join(base, part)):
            part = os.path.relpath(os.path.abspath(part), os.path.abspath(base))
        name = os.path.normpath(part)
    if not name or name == "." or name.startswith("..") or os.path.isabs(name):
        raise ValueError(f"{part} does not lie inside {output}: merge datasets inside it")
    return name.replace(os.sep, "/")
