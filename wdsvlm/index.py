"""The shard format's table of contents: ``index.json``, and the names it gives things.

See README.md ("Shard format") for the layout. The index is what makes exact splitting,
``len()``, resume and planning possible without reading the data.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from collections.abc import Mapping
from typing import Any

from .errors import ShardFormatError
from .storage import filesystem, join, read_bytes
from .tarball import padded

FORMAT = "wdsvlm"
VERSION = 1
INDEX_NAME = "index.json"
SKIPPED_NAME = "skipped.jsonl"


def shard_name(prefix: str, number: int) -> str:
    return f"{prefix}-{number:06d}.tar"


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
    return index


def check_index(index: Any, where: str) -> None:
    """Raise ``ShardFormatError`` naming ``where`` unless ``index`` has the version-1 layout."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ShardFormatError(f'{where}: not a wdsvlm index (no "format": "{FORMAT}")')
    if index.get("version") != VERSION:
        raise ShardFormatError(
            f"{where}: index version {index.get('version')!r}; this wdsvlm reads version "
            f"{VERSION} (upgrade wdsvlm, or rewrite the dataset with this version)"
        )
    shards = index.get("shards")
    if not isinstance(shards, list):
        raise ShardFormatError(f"{where}: 'shards' must be a list")
    for shard in shards:
        missing = {"name", "samples", "bytes", "sha256", "entries"} - set(shard)
        if missing:
            raise ShardFormatError(
                f"{where}: shard {shard.get('name', '?')} lacks {', '.join(sorted(missing))}"
            )
        if len(shard["entries"]) != shard["samples"]:
            raise ShardFormatError(
                f"{where}: shard {shard['name']} lists {len(shard['entries'])} entries "
                f"but says it holds {shard['samples']} samples"
            )


def verify_dataset(source: str, storage_options: Mapping[str, Any] | None = None) -> dict:
    """Check every shard's size and sha256 against the index; return the index.

    Raises ``ShardFormatError`` naming the first shard that is missing or differs.
    """
    index = load_index(source, storage_options)
    for shard in index["shards"]:
        url = join(source, shard["name"])
        fs, path = filesystem(url, storage_options)
        digest = hashlib.sha256()
        size = 0
        try:
            with fs.open(path, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    size += len(block)
        except FileNotFoundError:
            raise ShardFormatError(f"{url}: shard listed in the index is missing") from None
        if size != shard["bytes"] or digest.hexdigest() != shard["sha256"]:
            raise ShardFormatError(
                f"{url}: {size} bytes, sha256 {digest.hexdigest()[:12]}...; the index says "
                f"{shard['bytes']} bytes, sha256 {shard['sha256'][:12]}... (changed or truncated)"
            )
    return index


def scan_index(urls: list[str], storage_options: Mapping[str, Any] | None = None) -> dict:
    """Build the index of wdsvlm-format shards that have none, by reading them once.

    Every shard is read in full (image sizes come from the image headers), so prefer the
    ``index.json`` that ``wdsvlm write`` leaves beside the shards; this is for shards copied
    without it. ``sha256`` is left out (None) of a scanned index.
    """
    from .images import IMAGE_MEMBER, UnreadableImage, image_size

    shards = []
    for url in urls:
        fs, path = filesystem(url, storage_options)
        entries: list[dict] = []
        images: dict[int, list[int]] = {}
        try:
            with fs.open(path, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tar:
                for info in tar:
                    if not info.isfile():
                        continue
                    key, _, suffix = info.name.partition(".")
                    if not entries or entries[-1]["key"] != key:
                        images = {}
                        entries.append(
                            {
                                "key": key,
                                "offset": info.offset,
                                "size": 0,
                                "images": [],
                                "chars": [],
                            }
                        )
                    entry = entries[-1]
                    entry["size"] = info.offset_data + padded(info.size) - entry["offset"]
                    data = tar.extractfile(info).read()
                    if suffix == "json":
                        messages = json.loads(data).get("messages", [])
                        entry["chars"] = [len(m.get("content", "")) for m in messages]
                    elif match := IMAGE_MEMBER.fullmatch(suffix):
                        images[int(match.group(1))] = list(image_size(data))
                        entry["images"] = [images[n] for n in sorted(images)]
        except FileNotFoundError:
            raise ShardFormatError(f"{url}: shard not found") from None
        except (tarfile.TarError, json.JSONDecodeError, UnreadableImage) as e:
            raise ShardFormatError(
                f"{url}: cannot scan it for an index ({e}); write the dataset with "
                "`wdsvlm write`, which leaves index.json beside the shards"
            ) from None
        name = url.rsplit("/", 1)[-1]
        shards.append(
            {
                "name": name,
                "samples": len(entries),
                "bytes": fs.size(path),
                "sha256": None,
                "entries": entries,
            }
        )
    samples = sum(s["samples"] for s in shards)
    return {
        "format": FORMAT,
        "version": VERSION,
        "shards": shards,
        "totals": {"shards": len(shards), "samples": samples},
    }
