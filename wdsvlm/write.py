"""The shard writer: input records in, WebDataset tar shards and ``index.json`` out.

It works in two passes. The first reads and checks every record and its images (in
``workers`` processes) without writing anything, so bad input stops the run before a partial
dataset exists. The second cuts the good samples into shards (a pure function of the sample
sizes, so any worker count gives the same shards) and writes the shards in parallel. Each
shard appears only when complete; ``index.json`` is written last.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from .errors import BadInputError, DatasetExistsError, InputError, StorageError
from .images import UnreadableImage, probe_image, stored_bytes
from .index import (
    FORMAT,
    INDEX_NAME,
    SKIPPED_NAME,
    VERSION,
    dumps_index,
    sample_key,
    shard_name,
    shard_summary,
    sidecar_entry,
)
from .inputs import FORMATS, iter_records
from .progress import progress
from .sidecar import pack_entries, sidecar_name
from .storage import (
    exists,
    join,
    list_names,
    publish_bytes,
    publish_file,
    read_bytes,
    remove,
    staging_file,
)
from .tarball import BLOCK, HashingTarWriter, member_bytes, tar_bytes

log = logging.getLogger("wdsvlm.write")


@dataclass(frozen=True)
class WriteOptions:
    """How ``write_dataset`` cuts and writes shards."""

    format: str = "auto"
    """Input format: ``llava``, ``cauldron``, or ``auto`` (told apart per file)."""
    samples_per_shard: int = 5000
    """At most this many samples per shard."""
    max_shard_bytes: int = 256 * 2**20
    """A shard closes before it would grow past this; a larger single sample gets its own."""
    prefix: str = "data"
    """Shards are named ``PREFIX-000000.tar``, ``PREFIX-000001.tar``, ..."""
    workers: int = 1
    """Processes that read inputs and write shards; the output is the same for any count."""
    skip_bad: bool = False
    """Skip bad records (counted, listed in skipped.jsonl) instead of stopping the run."""
    overwrite: bool = False
    """Replace a dataset already at the output."""
    progress: bool = True
    """Show progress bars."""

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {self.format!r}")
        if self.samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be at least 1, not {self.samples_per_shard}")
        if self.max_shard_bytes < 4 * BLOCK:
            raise ValueError(f"max_shard_bytes is too small: {self.max_shard_bytes}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_-]*", self.prefix):
            raise ValueError(
                f"prefix {self.prefix!r}: use letters, digits, '_' and '-' "
                "(no dots or slashes: the shard name is PREFIX-000000.tar)"
            )


@dataclass
class WriteSummary:
    """What a write produced."""

    output: str
    samples: int = 0
    images: int = 0
    shards: int = 0
    bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def __str__(self) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))
        line = (
            f"wrote {_count(self.samples, 'sample')} ({_count(self.images, 'image')}) "
            f"in {_count(self.shards, 'shard')}, {self.bytes / 1e6:.1f} MB, to {self.output} "
            f"in {self.seconds:.1f} s; "
        )
        if not skipped:
            return line + "skipped none"
        return line + f"skipped {_count(skipped, 'bad record')} ({reasons}), see {SKIPPED_NAME}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def write_dataset(
    inputs: str | Iterable[str],
    output: str,
    *,
    image_root: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **options: Any,
) -> WriteSummary:
    """Write the records of ``inputs`` (LLaVA or Cauldron JSON/JSONL files) as a dataset.

    ``output`` is a local folder or an fsspec URL (``s3://bucket/prefix``, ``gs://...``,
    ``memory://...``). ``image_root`` is where relative image paths start (default: each input
    file's folder). ``storage_options`` go to fsspec for the output and for inputs and images
    given as URLs. Keyword ``options`` are the fields of ``WriteOptions``.
    """
    opts = WriteOptions(**options)
    started = time.perf_counter()
    inputs = [inputs] if isinstance(inputs, str) else list(inputs)
    if not inputs:
        raise ValueError("no input files given")
    index_url = join(output, INDEX_NAME)
    replacing = exists(index_url, storage_options)
    if replacing and not opts.overwrite:
        raise DatasetExistsError(
            f"{output} already holds a dataset ({INDEX_NAME}); pass --overwrite / "
            "overwrite=True to replace it"
        )

    records = (
        r for path in inputs for r in iter_records(path, format=opts.format, image_root=image_root)
    )
    with _pool(opts.workers) as pool:
        checked = _map(pool, partial(check_record, storage_options=storage_options), records, 16)
        samples, bad = _split_bad(
            progress(checked, enabled=opts.progress, desc="checking", unit=" records")
        )
        if (bad and not opts.skip_bad) or (bad and not samples):
            raise BadInputError(bad, len(samples) + len(bad))
        if not samples:
            raise ValueError(f"no records in {', '.join(inputs)}: nothing to write")
        if replacing:  # only now that the new data is good; no reader may pair old and new
            remove(index_url, storage_options)
        plans = plan_shards(samples, opts.samples_per_shard, opts.max_shard_bytes)
        write = partial(
            write_shard, output=output, prefix=opts.prefix, storage_options=storage_options
        )
        shards, written, writing_since = [], 0, time.perf_counter()
        with progress(
            total=len(samples), enabled=opts.progress, desc="writing", unit=" samples"
        ) as bar:
            for shard in _map(pool, write, plans, 1):
                shards.append(shard)
                written += shard["bytes"]
                bar.update(shard["samples"])
                rate = written / 1e6 / max(time.perf_counter() - writing_since, 1e-6)
                bar.set_postfix_str(f"{rate:.1f} MB/s")

    skipped = Counter(e.reason for e in bad)
    skipped_url = join(output, SKIPPED_NAME)
    if bad:
        lines = (
            json.dumps({"where": e.where, "reason": e.reason, "message": e.message}) for e in bad
        )
        publish_bytes(("\n".join(lines) + "\n").encode("utf-8"), skipped_url, storage_options)
        log.warning(
            "skipped %d bad records (%s); listed in %s", len(bad), dict(skipped), skipped_url
        )
    else:
        remove(skipped_url, storage_options)
    index = build_index(shards, samples, opts.prefix, skipped)
    publish_bytes(dumps_index(index), index_url, storage_options)
    keep = {s["name"] for s in shards} | {s["sidecar"]["name"] for s in shards}
    _remove_stale_shards(output, opts.prefix, keep, storage_options)
    totals = index["totals"]
    return WriteSummary(
        output=output,
        samples=totals["samples"],
        images=totals["images"],
        shards=totals["shards"],
        bytes=totals["bytes"],
        skipped=dict(skipped),
        seconds=time.perf_counter() - started,
    )


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
    for path in record["images"]:
        try:
            data = read_bytes(path, storage_options)
        except FileNotFoundError:
            return InputError(where, "missing_image", f"image file {path} not found")
        except (OSError, StorageError) as e:
            return InputError(where, "unreadable_image", f"image file {path} cannot be read: {e}")
        try:
            info = probe_image(data)
        except UnreadableImage as e:
            return InputError(
                where, "unreadable_image", f"image file {path} is not a decodable image: {e}"
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
    samples: list[dict], samples_per_shard: int, max_shard_bytes: int
) -> list[tuple[int, int, list[dict]]]:
    """Cut samples into shards, in order: ``[(shard number, first sample number, samples)]``."""
    plans: list[tuple[int, int, list[dict]]] = []
    current: list[dict] = []
    current_bytes = 0
    first = 0
    for number, sample in enumerate(samples):
        size = sample_tar_bytes(sample)
        if current and (
            len(current) >= samples_per_shard or tar_bytes(current_bytes + size) > max_shard_bytes
        ):
            plans.append((len(plans), first, current))
            current, current_bytes, first = [], 0, number
        current.append(sample)
        current_bytes += size
    if current:
        plans.append((len(plans), first, current))
    return plans


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
    sidecar = pack_entries(entries)
    publish_bytes(sidecar, join(output, sidecar_name(name)), storage_options)
    return {
        "name": name,
        "samples": len(samples),
        "bytes": tar.offset,
        "sha256": tar.digest.hexdigest(),
        "sidecar": sidecar_entry(sidecar_name(name), sidecar),
        **shard_summary(entries),
    }


def _write_sample(tar: HashingTarWriter, key: str, sample: dict, storage_options) -> dict:
    """Append one sample's members; return its index entry."""
    start = tar.offset
    tar.member(f"{key}.json", sample["json"])
    for n, (path, info, size) in enumerate(sample["images"]):
        data = stored_bytes(read_bytes(path, storage_options), info)
        if len(data) != size:
            raise InputError(
                sample["where"], "changed_image", f"image file {path} changed while writing"
            )
        tar.member(f"{key}.{n}.{info.ext}", data)
    return {
        "key": key,
        "offset": start,
        "size": tar.offset - start,
        "images": [[info.width, info.height] for _, info, _ in sample["images"]],
        "chars": sample["chars"],
    }


def build_index(
    shards: list[dict], samples: list[dict], prefix: str, skipped: Mapping[str, int]
) -> dict:
    images = [len(s["images"]) for s in samples]
    sources = Counter(s["source"] for s in samples)
    return {
        "format": FORMAT,
        "version": VERSION,
        "prefix": prefix,
        "shards": shards,
        "totals": {
            "shards": len(shards),
            "samples": len(samples),
            "bytes": sum(s["bytes"] for s in shards),
            "images": sum(images),
            "text_only": images.count(0),
            "multi_image": sum(n > 1 for n in images),
            "turns": sum(len(s["chars"]) for s in samples),
            "chars": sum(sum(s["chars"]) for s in samples),
            "sources": dict(sorted(sources.items())),
            "skipped": dict(sorted(skipped.items())),
        },
    }


def _split_bad(checked: Iterable[dict | InputError]) -> tuple[list[dict], list[InputError]]:
    samples, bad = [], []
    for item in checked:
        (bad if isinstance(item, InputError) else samples).append(item)
    return samples, bad


def _remove_stale_shards(output: str, prefix: str, keep: set[str], storage_options) -> None:
    """Shards (and sidecars) of this prefix that the new index does not list are left-overs:
    remove them."""
    pattern = re.compile(re.escape(prefix) + r"-\d{6,}\.(tar|idx)")
    for name in list_names(output, storage_options):
        if pattern.fullmatch(name) and name not in keep:
            log.info("removing %s: left over from an earlier write, not in the new index", name)
            remove(join(output, name), storage_options)


@contextmanager
def _pool(workers: int) -> Iterator[Any]:
    """A process pool for ``workers`` > 1, else None (work runs in this process)."""
    if workers == 1:
        yield None
        return
    # spawn: safe whatever threads the caller has running (fork with threads can deadlock)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        yield pool


def _map(pool, fn, items: Iterable, chunksize: int) -> Iterator:
    """``fn`` over ``items`` in order, in the pool if there is one."""
    return map(fn, items) if pool is None else pool.imap(fn, items, chunksize)
