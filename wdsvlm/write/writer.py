"""The shard writer: input records in, WebDataset tar shards and ``index.json`` out.

Records are read and checked (their images read and probed) and written in one stream: the
good samples are cut into shards as they come (a pure function of the sample sizes, so any
worker count gives the same shards) and each shard is written as soon as it is full, on the
engine's workers (``engines``: this machine's processes, or Ray). A bad record without
``skip_bad`` stops the writes, the rest is only checked so that every bad record is named,
and what was written is removed. Replacing a dataset checks the new input first, so bad input
leaves the old one whole. Each shard appears only when complete, beside the index or, with
``prefixes``, in its prefix folder (``format.prefixes``); ``index.json`` is written last
(``format.builder`` makes it).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from importlib import import_module
from typing import TYPE_CHECKING, Any

from ..errors import DatasetExistsError, InputError
from ..format.builder import (
    SpilledShards,
    Totals,
    publish_root,
    publish_skipped,
    refuse_bad,
    remove_tables,
    root_index,
    stops,
)
from ..format.containers import MAX_VIDEO_PIXELS
from ..format.index import INDEX_NAME, SKIPPED_NAME
from ..format.prefixes import check_prefixes, remove_empty_folders, remove_stale_shards
from ..format.tarball import BLOCK
from ..progress import progress
from ..storage.fs import exists, join, remove
from .documents import MIN_SIM, DocumentOptions
from .inputs import FORMATS, expand_inputs
from .shards import plan_shards, write_shard

if TYPE_CHECKING:
    from .engines import Engine

log = logging.getLogger("wdsvlm.write")

ENGINES = {"local": ".engines:LocalEngine", "ray": ".ray_engine:RayEngine"}
"""The engines the writer's work can run on (see ``engines``), imported when chosen."""


@dataclass(frozen=True)
class WriteOptions:
    """How ``write_dataset`` cuts and writes shards."""

    format: str = "auto"
    """Input format: ``llava``, ``cauldron``, ``messages`` (conversations), ``obelics``,
    ``mmc4`` (documents), ``llava-pretrain`` (captions), or ``auto`` (told apart per file;
    ``llava-pretrain`` is only chosen by name: its rows look like LLaVA's)."""
    image_folder: str | None = None
    """Documents and captions: a folder img2dataset wrote, where images given as URLs are
    found (``image_folder``)."""
    min_sim: float = MIN_SIM
    """MMC4: an image whose ``matched_sim`` is under this is left out (OpenFlamingo's 0.24)."""
    samples_per_shard: int = 5000
    """At most this many samples per shard."""
    max_shard_bytes: int = 256 * 2**20
    """A shard closes before it would grow past this; a larger single sample gets its own."""
    prefix: str = "data"
    """Shards are named ``PREFIX-000000.tar``, ``PREFIX-000001.tar``, ..."""
    prefixes: int | None = None
    """Spread the shards (and their sidecars) over this many prefix folders
    (``4/data-000001.tar``), so that an object store such as S3 serves their requests from
    as many partitions (``format.prefixes``); None: every shard beside the index."""
    workers: int = 1
    """Processes that read inputs and write shards; the output is the same for any count."""
    skip_bad: bool = False
    """Skip bad records (counted, listed in skipped.jsonl) instead of stopping the run."""
    overwrite: bool = False
    """Replace a dataset already at the output."""
    progress: bool = True
    """Show progress bars."""
    max_video_pixels: int = MAX_VIDEO_PIXELS
    """Frames x width x height a video may have, as its headers state them (over it, or a frame
    over Pillow's bound for one image, the record is refused as ``unreadable_video``)."""
    index_version: int = 3
    """The layout of the root index: 3 (the shards in a binary table,
    ``index-<digest>.shards``), or 2 (every shard in ``index.json``, for readers of a wdsvlm
    before version 3)."""

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {self.format!r}")
        if self.samples_per_shard < 1:
            raise ValueError(f"samples_per_shard must be at least 1, not {self.samples_per_shard}")
        if self.max_shard_bytes < 4 * BLOCK:
            raise ValueError(f"max_shard_bytes is too small: {self.max_shard_bytes}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")
        if self.max_video_pixels < 1:
            raise ValueError(f"max_video_pixels must be at least 1, not {self.max_video_pixels}")
        DocumentOptions(self.image_folder, self.min_sim)  # checks them
        check_prefixes(self.prefixes)
        if self.index_version not in (2, 3):
            raise ValueError(f"index_version must be 2 or 3, not {self.index_version!r}")
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
    documents: int = 0
    captions: int = 0
    dropped_images: dict[str, int] = field(default_factory=dict)
    """Images dropped from documents and captions, by reason (the rest of each written)."""
    left_out_captions: int = 0
    """Captions not written because their image was dropped."""

    def __str__(self) -> str:
        skipped = sum(self.skipped.values())
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))
        kinds = [
            _count(n, k) for n, k in ((self.documents, "document"), (self.captions, "caption"))
        ]
        images = ", ".join(
            [k for k in kinds if not k.startswith("0 ")] + [_count(self.images, "image")]
        )
        line = (
            f"wrote {_count(self.samples, 'sample')} ({images}) "
            f"in {_count(self.shards, 'shard')}, {self.bytes / 1e6:.1f} MB, to {self.output} "
            f"in {self.seconds:.1f} s; "
        )
        kinds = sorted(set(self.formats.values()))
        if kinds:
            line += f"input format {', '.join(kinds)}; "
        if self.dropped_images:
            why = ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped_images.items()))
            line += f"dropped {_count(sum(self.dropped_images.values()), 'image')} ({why})"
            if self.left_out_captions:
                line += f", so {_count(self.left_out_captions, 'caption')} not written"
            line += "; "
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
    records, of OBELICS or MMC4 documents or LLaVA-Pretrain captions, or Parquet files with
    embedded images; globs expanded) as a dataset.

    ``output`` is a local folder or an fsspec URL (``s3://bucket/prefix``, ``gs://...``,
    ``memory://...``). ``image_root`` is where relative image paths start (default: each input
    file's folder). ``storage_options`` go to fsspec for the output and for inputs and images
    given as URLs. ``engine="ray"`` runs the checks and shard writes as Ray tasks (see
    ``ray_engine``; ``inputs`` may then be a ``ray.data.Dataset`` of records), joining the
    cluster at ``ray_address`` or starting a local Ray of ``workers`` CPUs; the output is
    the same. Keyword ``options`` are the fields of ``WriteOptions``.
    """
    opts = WriteOptions(**options)
    started = time.perf_counter()
    if engine not in ENGINES:
        raise ValueError(f"engine must be {' or '.join(map(repr, ENGINES))}, not {engine!r}")
    if ray_address and engine != "ray":
        raise ValueError("a Ray address is for the Ray engine: add --engine ray / engine='ray'")
    if engine == "ray" and (opts.image_folder is not None or opts.min_sim != MIN_SIM):
        raise ValueError("--image-folder and --min-sim are for the local engine (--engine local)")
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
    module, name = ENGINES[engine].split(":")
    engine_class = getattr(import_module(module, __package__), name)
    work = inputs if dataset is None else dataset
    runner = engine_class(work, opts, image_root, storage_options, formats, ray_address)
    output = runner.place(output)
    with runner as run:
        opts = replace(opts, workers=run.workers)
        if replacing:
            # a check alone first: bad new input must leave the old dataset whole, and the
            # new shards take the old ones' names
            good, bad = _check_only(run.checked(), opts.progress)
            _refuse_bad(bad, good, opts.skip_bad, named)
            remove(index_url, storage_options)  # no reader may pair old and new from here
            remove_tables(output, storage_options)  # nor a worker of a Loader built on it
        written = _write_shards(run, run.checked(), output, opts, storage_options)
        shards, totals, bad, n_good = written
        if stops(bad, n_good, opts.skip_bad):
            if replacing:  # bad only now (an image gone or unreadable since the check)
                log.error(
                    "%s: records found bad while writing, after they were checked; the "
                    "dataset being replaced has no index any more: write it again",
                    output,
                )
            for shard in shards:  # the input turned out bad: nothing of it stays
                remove(join(output, shard["name"]), storage_options)
                remove(join(output, shard["sidecar"]["name"]), storage_options)
            remove_empty_folders(output, storage_options)  # the prefix folders it made
            _refuse_bad(bad, n_good, opts.skip_bad, named)

    skipped_url = join(output, SKIPPED_NAME)
    skipped = publish_skipped(bad, skipped_url, storage_options)
    if bad:
        log.warning(
            "skipped %d bad records (%s); listed in %s", len(bad), dict(skipped), skipped_url
        )
    if totals.dropped_images:
        dropped = dict(totals.dropped_images)
        log.warning(
            "dropped %d images from documents and captions, their text kept (%s)",
            sum(dropped.values()),
            dropped,
        )
    index = root_index(shards, totals, skipped, prefix=opts.prefix, prefixes=opts.prefixes)
    publish_root(output, index, storage_options, opts.index_version)
    remove_stale_shards(output, opts.prefix, len(shards), opts.prefixes, storage_options)
    shards.close()
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
        documents=totals.get("documents", 0),
        captions=totals.get("captions", 0),
        dropped_images=totals.get("dropped_images", {}),
        left_out_captions=totals.get("left_out_captions", 0),
    )


def _write_shards(run: Engine, checked: Iterator, output: str, opts: WriteOptions, storage_options):
    """Write the good samples of ``checked`` into shards as they fill, at most two per
    worker in flight, so memory holds the open shard and those in flight, never the dataset.
    ``run`` is the engine the writes go to. Returns the shards' root entries, the totals, the
    bad records and the number of good ones (written or only checked). Once a bad record is
    seen without ``skip_bad`` nothing more is written (the rest is only checked, so that
    every bad record is reported)."""
    totals, bad, shards = Totals(), [], SpilledShards()
    n_good = 0  # good records, written or (after a bad one, without skip_bad) only checked
    write = partial(
        write_shard,
        output=output,
        prefix=opts.prefix,
        storage_options=storage_options,
        prefixes=opts.prefixes,
    )

    def good():
        nonlocal n_good
        for item in progress(checked, enabled=opts.progress, desc="writing", unit=" records"):
            if isinstance(item, InputError):
                bad.append(item)
                continue
            n_good += 1
            if bad and not opts.skip_bad:
                continue  # refused at the end; checked only
            totals.drop(item.get("dropped") or {}, item.get("left_out", False))
            if item.get("left_out"):
                continue  # a caption whose image was dropped: counted, not written
            kind = item.get("kind", "conversation")
            totals.add(
                len(item["images"]), item["chars"], item["source"], len(item["videos"]), kind
            )
            yield item

    in_flight: list = []
    for plan in plan_shards(good(), opts.samples_per_shard, opts.max_shard_bytes):
        in_flight.append(run.apply_async(write, (plan,)))
        while len(in_flight) >= 2 * opts.workers:
            shards.append(in_flight.pop(0).get())
    for job in in_flight:
        shards.append(job.get())
    return shards, totals, bad, n_good


def _is_iterable(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or (
        hasattr(value, "__iter__") and not hasattr(value, "iter_batches")
    )


def _check_only(checked: Iterator, show: bool) -> tuple[int, list[InputError]]:
    good, bad = 0, []
    for item in progress(checked, enabled=show, desc="checking", unit=" records"):
        if isinstance(item, InputError):
            bad.append(item)
        else:
            good += 1
    return good, bad


def _refuse_bad(bad: list[InputError], good: int, skip_bad: bool, inputs: list) -> None:
    refuse_bad(
        bad,
        good,
        skip_bad,
        items="input records",
        outcome="nothing was written (pass --skip-bad / skip_bad=True to skip them and list "
        f"them in {SKIPPED_NAME})",
        empty=f"no records in {', '.join(inputs)}: nothing to write",
    )
