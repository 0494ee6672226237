"""The writer's shards: a record checked into a sample, samples cut into shards, a shard
written.

Checking reads a record's images and keeps only what planning needs (the JSON bytes, and per
image its reference, format and stored size), never the image bytes. The cut is a pure
function of the samples' sizes, so any number of workers gives the same shards; a shard's
images are read again when it is written, and a tar member's bytes are known before it is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..errors import InputError, StorageError
from ..format.builder import publish_sidecar, sample_entry
from ..format.images import UnreadableImage, probe_image, stored_bytes
from ..format.index import sample_key, shard_name
from ..format.tarball import HashingTarWriter, member_bytes, tar_bytes
from ..storage.fs import join, publish_file, read_bytes, staging_file
from .parquet import Embedded


def check_record(
    record: dict | InputError, storage_options: Mapping[str, Any] | None = None
) -> dict | InputError:
    """Read and check a record's images; return the sample to write, or the InputError.

    The sample holds no image bytes, only what shard planning needs: the JSON bytes and,
    per image, its path, extension, stored size and displayed size.
    """
    if isinstance(record, InputError):
        return record
    where = record["where"]
    images = []
    embedded = record.get("data") or [None] * len(record["images"])
    for path, data in zip(record["images"], embedded, strict=True):
        try:
            if data is None:
                data = read_bytes(path, storage_options)
        except FileNotFoundError:
            return InputError(where, "missing_image", f"{_image_name(path)} not found")
        except (OSError, StorageError) as e:
            return InputError(where, "unreadable_image", f"{_image_name(path)} cannot be read: {e}")
        try:
            info = probe_image(data)
        except UnreadableImage as e:
            return InputError(
                where, "unreadable_image", f"{_image_name(path)} is not a decodable image: {e}"
            )
        size = len(stored_bytes(data, info)) if info.reencoded else len(data)
        images.append((path, info, size))
    doc = {"id": record["id"], "source": record["source"], "messages": record["messages"]}
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return {
        "where": where,
        "json": text,
        "source": record["source"],
        "images": images,
        "chars": [len(m["content"]) for m in record["messages"]],
    }


def sample_tar_bytes(sample: dict) -> int:
    """Bytes a sample takes in a tar: a header and the padded data per member."""
    return member_bytes(len(sample["json"])) + sum(
        member_bytes(size) for _, _, size in sample["images"]
    )


def plan_shards(
    samples: Iterable[dict], samples_per_shard: int, max_shard_bytes: int
) -> Iterator[tuple[int, int, list[dict]]]:
    """Cut samples into shards, in order, as they come: ``(shard number, first sample
    number, samples)`` for each shard once it is full (only the open shard is held)."""
    current: list[dict] = []
    current_bytes = 0
    first = shards = 0
    for number, sample in enumerate(samples):
        size = sample_tar_bytes(sample)
        if current and (
            len(current) >= samples_per_shard or tar_bytes(current_bytes + size) > max_shard_bytes
        ):
            yield shards, first, current
            shards += 1
            current, current_bytes, first = [], 0, number
        current.append(sample)
        current_bytes += size
    if current:
        yield shards, first, current


def write_shard(
    plan: tuple[int, int, list[dict]],
    output: str,
    prefix: str,
    storage_options: Mapping[str, Any] | None = None,
) -> dict:
    """Write one planned shard and its sidecar (the samples' entries); return its entry in
    the root index."""
    number, first, samples = plan
    name = shard_name(prefix, number)
    url = join(output, name)
    tmp = staging_file(url, storage_options)
    try:
        with open(tmp, "wb") as f:
            tar = HashingTarWriter(f)
            entries = [
                _write_sample(tar, sample_key(first + i), s, storage_options)
                for i, s in enumerate(samples)
            ]
            tar.close()
    except BaseException:
        os.unlink(tmp)
        raise
    publish_file(tmp, url, storage_options)
    digest = tar.digest.hexdigest()
    return publish_sidecar(output, name, entries, tar.offset, digest, storage_options)


def _write_sample(tar: HashingTarWriter, key: str, sample: dict, storage_options) -> dict:
    """Append one sample's members; return its index entry."""
    start = tar.offset
    tar.member(f"{key}.json", sample["json"])
    for n, (path, info, size) in enumerate(sample["images"]):
        data = stored_bytes(image_bytes(path, storage_options), info)
        if len(data) != size:
            raise InputError(
                sample["where"], "changed_image", f"{_image_name(path)} changed while writing"
            )
        tar.member(f"{key}.{n}.{info.ext}", data)
    sizes = [(info.width, info.height) for _, info, _ in sample["images"]]
    return sample_entry(key, start, tar.offset - start, sizes, sample["chars"])


def _image_name(image: str | Embedded) -> str:
    return f"image {image}" if isinstance(image, Embedded) else f"image file {image}"


def image_bytes(image: str | Embedded, storage_options=None) -> bytes:
    """An image's bytes: from its file or URL, or from the Parquet row that embeds it."""
    if isinstance(image, Embedded):
        return image.read(storage_options)
    return read_bytes(image, storage_options)
