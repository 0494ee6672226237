"""Shards spread over prefix folders (``wdsvlm write --prefixes N``), and finding them again.

An object store serves a bounded request rate per key prefix: S3 about 5,500 GET (3,500 PUT)
requests a second per partitioned prefix, answering ``503 SlowDown`` past it, and it
partitions a bucket by key ranges as their load grows. A dataset whose shards all lie in one
folder is one prefix; spread over N folders, the store can give it N times the rate.

The rule, a function of the shard number and N alone (stable across runs, engines and
worker counts): shard ``n`` lies in folder number ``n mod N``, so any N consecutive shards
use every folder once and the shards are spread evenly. Folder ``b`` is named by its place in
the hex key space, ``b * 16**w // N`` written in ``w`` hex digits (the fewest with
``16**w >= N``): the folders' names are spread evenly over the keys that follow the dataset's
own, where the store cuts its partitions. With N = 4: ``0/``, ``4/``, ``8/``, ``c/``
(``ds/4/data-000001.tar``); with N = 256: ``00/`` to ``ff/``. A shard's sidecar lies beside it.

The index names each shard by its path under the dataset (``4/data-000001.tar``), so a
reader joins the dataset's URL and the name, as for any shard, and needs nothing else.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from ..storage.fs import filesystem, is_local, join, remove

log = logging.getLogger("wdsvlm.format")

MAX_PREFIXES = 4096
"""The most prefix folders a dataset is spread over (three hex digits)."""

_FOLDER = re.compile(r"[0-9a-f]{1,3}")


def check_prefixes(prefixes: int | None) -> None:
    """Raise ``ValueError`` unless ``prefixes`` is None (no prefix folders) or a whole number
    from 1 to ``MAX_PREFIXES``."""
    if prefixes is None:
        return
    if isinstance(prefixes, bool) or not isinstance(prefixes, int):
        raise ValueError(f"prefixes must be a whole number, not {prefixes!r}")
    if not 1 <= prefixes <= MAX_PREFIXES:
        raise ValueError(
            f"prefixes must be from 1 to {MAX_PREFIXES} (the prefix folders shards are spread "
            f"over), not {prefixes}"
        )


def _width(prefixes: int) -> int:
    width = 1
    while 16**width < prefixes:
        width += 1
    return width


def prefix_folder(number: int, prefixes: int) -> str:
    """The folder of shard ``number`` in a dataset spread over ``prefixes`` folders."""
    width = _width(prefixes)
    return format((number % prefixes) * 16**width // prefixes, f"0{width}x")


def prefix_folders(prefixes: int) -> list[str]:
    """Every folder of a dataset spread over ``prefixes`` folders, in key order."""
    return [prefix_folder(b, prefixes) for b in range(prefixes)]


def placed(name: str, number: int, prefixes: int | None) -> str:
    """The file ``name`` of shard ``number`` as the index names it: in its prefix folder, or
    as it is without prefixes."""
    return name if prefixes is None else f"{prefix_folder(number, prefixes)}/{name}"


def shard_files(
    output: str, storage_options: Mapping[str, Any] | None = None
) -> list[tuple[str, str]]:
    """``(folder, name)`` of the files at ``output`` and in the prefix folders there
    (``folder`` is ``""`` for those at ``output`` itself)."""
    found = []
    for entry, is_dir in _listing(output, storage_options):
        if not is_dir:
            found.append(("", entry))
        elif _FOLDER.fullmatch(entry):
            inside = _listing(join(output, entry), storage_options)
            found += [(entry, name) for name, sub in inside if not sub]
    return found


def remove_stale_shards(
    output: str,
    prefix: str,
    count: int,
    prefixes: int | None,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Remove the shards (and sidecars) of this ``prefix`` at ``output`` and in its prefix
    folders that the new index of ``count`` shards (numbered from 0, spread over
    ``prefixes`` folders or none) does not list: left over from an earlier write there (more
    shards, or another number of prefix folders)."""
    pattern = re.compile(re.escape(prefix) + r"-(\d{6,})\.(tar|idx)")
    for folder, name in shard_files(output, storage_options):
        found = pattern.fullmatch(name)
        if not found:
            continue
        number = int(found.group(1))
        where = f"{folder}/{name}" if folder else name
        if number < count and where == placed(name, number, prefixes):
            continue
        log.info("removing %s: left over from an earlier write, not in the new index", where)
        remove(join(output, where), storage_options)
    remove_empty_folders(output, storage_options)


def remove_empty_folders(output: str, storage_options: Mapping[str, Any] | None = None) -> None:
    """Remove the prefix folders left empty at a local ``output`` (an object store has no
    folders to remove)."""
    fs, path = filesystem(output, storage_options)
    if not is_local(fs):
        return
    for entry, is_dir in _listing(output, storage_options):
        if is_dir and _FOLDER.fullmatch(entry):
            try:
                os.rmdir(os.path.join(path, entry))
            except OSError:  # not empty (or gone meanwhile)
                pass


def _listing(url: str, storage_options) -> list[tuple[str, bool]]:
    """``(name, is a folder)`` of what lies directly inside ``url``, sorted (none if there is
    nothing)."""
    fs, path = filesystem(url, storage_options)
    fs.invalidate_cache(path)
    try:
        entries = fs.ls(path, detail=True)
    except FileNotFoundError:
        return []
    return sorted(
        (os.path.basename(e["name"].rstrip("/")), e.get("type") == "directory") for e in entries
    )


def find_tars(folder: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The ``.tar`` files under ``folder`` at any depth, as paths relative to it: sorted by
    file name, then by folder, so shards written with ``--prefixes`` come in the writer's
    order (``4/data-000001.tar`` after ``0/data-000000.tar``)."""
    fs, path = filesystem(folder, storage_options)
    fs.invalidate_cache(path)
    base = path.rstrip("/")
    try:
        paths = fs.find(base)
    except FileNotFoundError:
        return []
    names = [p[len(base) + 1 :] for p in paths if p.endswith(".tar") and p.startswith(base + "/")]
    return sorted(names, key=lambda n: (n.rsplit("/", 1)[-1], n))
