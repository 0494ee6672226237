"""The shard writer: input records in, WebDataset tar shards and ``index.json`` out.

It works in two passes. The first reads and checks every record and its images (in
``workers`` processes) without writing anything, so bad input stops the run before a partial
dataset exists. The second cuts the good samples into shards (a pure function of the sample
sizes, so any worker count gives the same shards) and writes the shards in parallel. Each
shard appears only when complete; ``index.json`` is written last.
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from ..errors import BadInputError, DatasetExistsError, InputError, StorageError
from ..format.images import UnreadableImage, probe_image, stored_bytes
from ..format.index import (
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
from ..format.sidecar import pack_entries, sidecar_name
from ..format.tarball import BLOCK, HashingTarWriter, member_bytes, tar_bytes
from ..progress import progress
from ..storage.fs import (
    exists,
    join,
    list_names,
    publish_bytes,
    publish_file,
    read_bytes,
    remove,
    staging_file,
)
from ..write.inputs import FORMATS, Embedded, iter_records

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
    formats: dict[str, str] = field(default_factory=dict)
    """Each input file's format (detected where ``auto``)."""

    def __str__(self) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))
        line = (
            f"wrote {_count(self.samples, 'sample')} ({_count(self.images, 'image')}) "
            f"in {_count(self.shards, 'shard')}, {self.bytes / 1e6:.1f} MB, to {self.output} "
            f"in {self.seconds:.1f} s; "
        )
        kinds = sorted(set(self.formats.values()))
        if kinds:
            line += f"input format {', '.join(kinds)}; "
        if not skipped:
            return line + "skipped none"
        return line + f"skipped {_count(skipped, 'bad record')} ({reasons}), see {SKIPPED_NAME}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def write_dataset(
    inputs: str | Iterable[str] | Any,
    output: str,
    *,
    image_root: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    engine: str = "local",
    ray_address: str | None = None,
    **options: Any,
) -> WriteSummary:
    """Write the records of ``inputs`` (JSON/JSONL files of LLaVA, Cauldron or ``messages``
    records, or Parquet files with embedded images; globs expanded) as a dataset.

    ``output`` is a local folder or an fsspec URL (``s3://bucket/prefix``, ``gs://...``,
    ``memory://...``). ``image_root`` is where relative image paths start (default: each input
    file's folder). ``storage_options`` go to fsspec for the output and for inputs and images
    given as URLs. ``engine="ray"`` runs the checks and shard writes as Ray tasks (see
    ``wdsvlm.ray``; ``inputs`` may then be a ``ray.data.Dataset`` of records), joining the
    cluster at ``ray_address`` or starting a local Ray of ``workers`` CPUs; the output is
    the same. Keyword ``options`` are the fields of ``WriteOptions``.
    """
    opts = WriteOptions(**options)
    started = time.perf_counter()
    if engine not in ("local", "ray"):
        raise ValueError(f"engine must be 'local' or 'ray', not {engine!r}")
    if ray_address and engine != "ray":
        raise ValueError("a Ray address is for the Ray engine: add --engine ray / engine='ray'")
    dataset = None if isinstance(inputs, str) or _is_iterable(inputs) else inputs
    if dataset is not None and engine != "ray":
        raise TypeError(f"inputs must be file paths, not {type(inputs).__name__} (or engine='ray')")
    if dataset is None:
        inputs = [inputs] if isinstance(inputs, str) else list(inputs)
        if not inputs:
            raise ValueError("no input files given")
        inputs = expand_inputs(inputs, storage_options)
    index_url = join(output, INDEX_NAME)
    replacing = exists(index_url, storage_options)
    if replacing and not opts.overwrite:
        raise DatasetExistsError(
            f"{output} already holds a dataset ({INDEX_NAME}); pass --overwrite / "
            "overwrite=True to replace it"
        )
    formats: dict[str, str] = {}
    named = ["the Ray dataset"] if dataset is not None else inputs
    if engine == "ray":
        from ..write.ray_engine import RayEngine, absolute

        output = absolute(output)  # the tasks write there, wherever they run
        runner = RayEngine(
            dataset if dataset is not None else inputs,
            opts,
            image_root,
            storage_options,
            formats,
            ray_address,
        )
    else:
        runner = _LocalEngine(inputs, opts, image_root, storage_options, formats)
    with runner as run:
        opts = replace(opts, workers=run.workers)
        if replacing:
            # a check alone first: bad new input must leave the old dataset whole, and the
            # new shards take the old ones' names
            good, bad = _check_only(run.checked(), opts.progress)
            _refuse_bad(bad, good, opts.skip_bad, named)
            remove(index_url, storage_options)  # no reader may pair old and new from here
        written = _write_shards(run, run.checked(), output, opts, storage_options)
        shards, totals, bad, n_good = written
        if (bad and not opts.skip_bad) or not totals.samples:
            if replacing:  # bad only now (an image gone or unreadable since the check)
                log.error(
                    "%s: records found bad while writing, after they were checked; the "
                    "dataset being replaced has no index any more: write it again",
                    output,
                )
            for shard in shards:  # the input turned out bad: nothing of it stays
                remove(join(output, shard["name"]), storage_options)
                remove(join(output, shard["sidecar"]["name"]), storage_options)
            _refuse_bad(bad, n_good, opts.skip_bad, named)

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
    index = build_index(shards, totals, opts.prefix, skipped)
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
        formats=formats,
    )


def expand_inputs(inputs: list[str], storage_options=None) -> list[str]:
    """Input files with their globs expanded (sorted), local or any fsspec URL."""
    import fsspec

    out = []
    for pattern in inputs:
        if not any(c in pattern for c in "*?["):
            out.append(pattern)
            continue
        fs, path = fsspec.core.url_to_fs(pattern, **(storage_options or {}))
        found = sorted(fs.glob(path))
        if not found:
            raise FileNotFoundError(f"no input files match {pattern}")
        protocol = pattern.split("://", 1)[0] + "://" if "://" in pattern else ""
        out += [protocol + p if protocol and "://" not in p else p for p in found]
    return out


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


@dataclass
class Totals:
    """The dataset's totals, added up sample by sample as they are written."""

    samples: int = 0
    images: int = 0
    text_only: int = 0
    multi_image: int = 0
    turns: int = 0
    chars: int = 0
    sources: Counter = field(default_factory=Counter)

    def add(self, sample: dict) -> None:
        n = len(sample["images"])
        self.samples += 1
        self.images += n
        self.text_only += n == 0
        self.multi_image += n > 1
        self.turns += len(sample["chars"])
        self.chars += sum(sample["chars"])
        self.sources[sample["source"]] += 1


def _write_shards(run, checked: Iterator, output: str, opts: WriteOptions, storage_options):
    """Write the good samples of ``checked`` into shards as they fill, at most two per
    worker in flight, so memory holds the open shard and those in flight, never the dataset.
    ``run`` is the engine the writes go to. Returns the shards' root entries, the totals, the
    bad records and the number of good
    ones (written or only checked). Once a bad record is
    seen without ``skip_bad`` nothing more is written (the rest is only checked, so that
    every bad record is reported)."""
    totals, bad, shards = Totals(), [], []
    n_good = 0  # good records, written or (after a bad one, without skip_bad) only checked
    write = partial(write_shard, output=output, prefix=opts.prefix, storage_options=storage_options)

    def good():
        nonlocal n_good
        for item in progress(checked, enabled=opts.progress, desc="writing", unit=" records"):
            if isinstance(item, InputError):
                bad.append(item)
                continue
            n_good += 1
            if bad and not opts.skip_bad:
                continue  # refused at the end; checked only
            totals.add(item)
            yield item

    in_flight: list = []
    for plan in plan_shards(good(), opts.samples_per_shard, opts.max_shard_bytes):
        in_flight.append(run.apply_async(write, (plan,)))
        while len(in_flight) >= 2 * opts.workers:
            shards.append(in_flight.pop(0).get())
    shards += [job.get() for job in in_flight]
    return shards, totals, bad, n_good


def _is_iterable(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (
        hasattr(value, "__iter__") and not hasattr(value, "iter_batches")
    )


class _LocalEngine:
    """The writer's work on this machine: checks and shard writes in ``workers`` processes
    (none: in this one). ``checked()`` gives the checked records in input order; writes go
    through ``apply_async`` (in this process when there is no pool)."""

    def __init__(self, inputs, opts: WriteOptions, image_root, storage_options, formats):
        self.inputs, self.opts, self.image_root = inputs, opts, image_root
        self.storage_options, self.formats = storage_options, formats
        self.workers = opts.workers
        self.pool = None

    def __enter__(self):
        self._context = _pool(self.workers)
        self.pool = self._context.__enter__()
        return self

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)

    def records(self) -> Iterator:
        for path in self.inputs:
            yield from iter_records(
                path,
                format=self.opts.format,
                image_root=self.image_root,
                storage_options=self.storage_options,
                found=self.formats,
            )

    def checked(self) -> Iterator:
        check = partial(check_record, storage_options=self.storage_options)
        return _checked_in_batches(self.pool, check, self.records(), self.workers)

    def apply_async(self, fn, args):
        if self.pool is None:  # no processes: run it here, now
            return _Done(fn(*args))
        return self.pool.apply_async(fn, args)


@dataclass
class _Done:
    """A result already there, with ``get`` as a pool's pending result has."""

    value: Any

    def get(self) -> Any:
        return self.value


def _checked_in_batches(pool, check, records: Iterator, workers: int) -> Iterator:
    """``check`` over ``records``, in order, a batch at a time: the pool takes its tasks in
    order, so shard writes handed to it between two batches run before the next batch's
    checks (one ``imap`` over every record would queue them all first, and the writes would
    wait for the last check, with every result held)."""
    if pool is None:
        yield from map(check, records)
        return
    while chunk := list(itertools.islice(records, 64 * workers)):
        yield from pool.map(check, chunk, chunksize=16)


def _check_only(checked: Iterator, show: bool) -> tuple[int, list[InputError]]:
    good, bad = 0, []
    for item in progress(checked, enabled=show, desc="checking", unit=" records"):
        if isinstance(item, InputError):
            bad.append(item)
        else:
            good += 1
    return good, bad


def _refuse_bad(bad: list[InputError], good: int, skip_bad: bool, inputs: list) -> None:
    if (bad and not skip_bad) or (bad and not good):
        raise BadInputError(bad, good + len(bad))
    if not good:
        raise ValueError(f"no records in {', '.join(inputs)}: nothing to write")


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
        data = stored_bytes(image_bytes(path, storage_options), info)
        if len(data) != size:
            raise InputError(
                sample["where"], "changed_image", f"{_image_name(path)} changed while writing"
            )
        tar.member(f"{key}.{n}.{info.ext}", data)
    return {
        "key": key,
        "offset": start,
        "size": tar.offset - start,
        "images": [[info.width, info.height] for _, info, _ in sample["images"]],
        "chars": sample["chars"],
    }


def _image_name(image: str | Embedded) -> str:
    return f"image {image}" if isinstance(image, Embedded) else f"image file {image}"


def image_bytes(image: str | Embedded, storage_options=None) -> bytes:
    """An image's bytes: from its file or URL, or from the Parquet row that embeds it."""
    if isinstance(image, Embedded):
        return image.read(storage_options)
    return read_bytes(image, storage_options)


def build_index(
    shards: list[dict], totals: Totals, prefix: str, skipped: Mapping[str, int]
) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "prefix": prefix,
        "shards": shards,
        "totals": {
            "shards": len(shards),
            "samples": totals.samples,
            "bytes": sum(s["bytes"] for s in shards),
            "images": totals.images,
            "text_only": totals.text_only,
            "multi_image": totals.multi_image,
            "turns": totals.turns,
            "chars": totals.chars,
            "sources": dict(sorted(totals.sources.items())),
            "skipped": dict(sorted(skipped.items())),
        },
    }


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
