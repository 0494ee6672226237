"""``wdsvlm index``: the index of WebDataset tars that exist already, without rewriting them.

Each tar is read once, sequentially (in parallel over tars). Per sample the index records its
byte range, its images' displayed sizes (read from the image headers, EXIF orientation applied,
no decode) and the characters per turn of its conversation, or a document's or caption's kind
and elements, in the layout the tars hold (``layouts``: wdsvlm's own, captions, conversations,
MINT-1T's; ``format.tarscan`` reads a tar). The root ``index.json`` records the layout, so the
Loader, ``inspect`` and ``stats`` read these tars as they read wdsvlm's own.

The tars are found in a folder and the folders under it (shards written with ``--prefixes``
lie in prefix folders), named in the index by their path there; the index and the shards'
sidecars (each at its tar's path) go beside the tars, or to ``output`` when the tars' place
is read-only; then the index names where the tars are (``shard_root``). Bad samples are
counted by reason and listed in ``index-skipped.jsonl``; without ``skip_bad`` they stop the
run with no ``index.json`` written. An image a layout leaves out of a document it keeps (a
MINT-1T frame that does not decode) is counted by reason in the index's totals
(``dropped_images``) and in what ``index_tars`` returns. ``index.json`` is written last.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..errors import DatasetExistsError
from ..format.builder import (
    SpilledShards,
    Totals,
    publish_root,
    publish_sidecar,
    publish_skipped,
    refuse_bad,
    remove_tables,
    root_index,
    stops,
)
from ..format.containers import MAX_VIDEO_PIXELS
from ..format.documents import KINDS
from ..format.index import INDEX_NAME, INDEX_SKIPPED_NAME
from ..format.layouts import LAYOUTS, Layout, detect
from ..format.prefixes import find_tars
from ..format.tarscan import first_samples, scan_tar
from ..progress import progress
from ..storage.fs import exists, join, remove
from .pool import process_pool

log = logging.getLogger("wdsvlm.tarindex")

_DETECT_SAMPLES = 16  # samples of the first tar that ``auto`` looks at


@dataclass
class IndexSummary:
    """What ``index_tars`` found."""

    output: str
    layout: str
    detected: str | None = None
    shards: int = 0
    samples: int = 0
    images: int = 0
    documents: int = 0
    captions: int = 0
    bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    dropped_images: dict[str, int] = field(default_factory=dict)
    """Images left out of the documents kept, by reason."""
    dropped_examples: list[str] = field(default_factory=list)
    """Up to 10 of them, each ``SHARD/KEY: why``."""
    seconds: float = 0.0

    def __str__(self) -> str:
        found = f" (detected: {self.detected})" if self.detected else ""
        kinds = "".join(
            f"{n} {kind}, "
            for n, kind in ((self.documents, "documents"), (self.captions, "captions"))
            if n
        )
        line = (
            f"indexed {self.samples} samples ({kinds}{self.images} images) in {self.shards} "
            f"shards, {self.bytes / 1e6:.1f} MB, layout {self.layout}{found}, "
            f"in {self.seconds:.1f} s; index at {join(self.output, INDEX_NAME)}; "
        )
        if self.dropped_images:
            reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.dropped_images.items()))
            line += f"dropped {sum(self.dropped_images.values())} images ({reasons}); "
        if not self.skipped:
            return line + "skipped none"
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))
        return line + f"skipped {sum(self.skipped.values())} ({reasons}), see {INDEX_SKIPPED_NAME}"


def tar_urls(source: str | Sequence[str], storage_options=None) -> tuple[str, list[str]]:
    """``(the tars' folder, their URLs)``: every ``.tar`` in a folder or URL prefix and in
    the folders under it, at any depth (``prefixes.find_tars``: by file name, then folder; the
    index names each by its path there, such as ``4/data-000001.tar``), or a brace pattern
    or list of tar URLs (in their order)."""
    import braceexpand

    if isinstance(source, str) and not source.endswith(".tar"):
        names = find_tars(source, storage_options)
        if not names:
            raise FileNotFoundError(f"no .tar files in {source} (nor in the folders under it)")
        return source.rstrip("/"), [join(source, n) for n in names]
    patterns = [source] if isinstance(source, str) else list(source)
    urls = [u for p in patterns for u in braceexpand.braceexpand(p)]
    if not urls:
        raise ValueError(f"no tar URLs in {source!r}")
    folders = {u.rsplit("/", 1)[0] if "/" in u else "." for u in urls}
    if len(folders) > 1:
        raise ValueError(f"the tars of one index must lie in one folder; found {sorted(folders)}")
    return folders.pop(), urls


def index_tars(
    source: str | Sequence[str],
    *,
    output: str | None = None,
    format: str = "auto",
    prompts: Sequence[str] | None = None,
    prompt_seed: int = 0,
    kind: str = "",
    workers: int = 1,
    skip_bad: bool = False,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    show_progress: bool = True,
    index_version: int = 3,
    max_video_pixels: int = MAX_VIDEO_PIXELS,
) -> IndexSummary:
    """Index the WebDataset tars of ``source`` (a folder or URL prefix, a brace pattern or a
    list of tar URLs) where they are, or into ``output``; see the module. ``format`` is a
    layout of ``layouts.LAYOUTS`` or ``auto``; ``prompts`` and ``prompt_seed`` set the
    captions layout's prompts; ``kind="caption"`` makes the captions layout's samples
    captions (trained on without a prompt) instead of conversations; ``index_version`` 3
    (default) or 2, as ``write_dataset``;
    ``max_video_pixels``: a video stating more frames x width x height is a bad sample
    (``unreadable_video``)."""
    if index_version not in (2, 3):
        raise ValueError(f"index_version must be 2 or 3, not {index_version!r}")
    if format not in ("auto", *LAYOUTS):
        raise ValueError(f"format must be auto or one of {', '.join(LAYOUTS)}, not {format!r}")
    started = time.perf_counter()
    folder, urls = tar_urls(source, storage_options)
    output = (output or folder).rstrip("/")
    index_url = join(output, INDEX_NAME)
    if exists(index_url, storage_options):
        if not overwrite:
            raise DatasetExistsError(
                f"{index_url} exists; pass --overwrite / overwrite=True to index the tars again"
            )
        remove(index_url, storage_options)  # its sidecars are rewritten: no reader may pair them
        remove_tables(output, storage_options)  # nor a worker of a Loader built on it
    detected = None
    name = format
    if format == "auto":
        name, detected = detect(list(first_samples(urls[0], _DETECT_SAMPLES, storage_options)))
        log.info("%s: layout %s (%s)", urls[0], name, detected)
    settings = {"prompts": tuple(prompts)} if prompts else {}
    layout = Layout(name, seed=prompt_seed, kind=kind, **settings)
    names = [u[len(folder) + 1 :] if u.startswith(folder + "/") else u for u in urls]
    scan = partial(
        _scan_and_publish,
        layout=layout,
        output=output,
        options=storage_options,
        max_video_pixels=max_video_pixels,
    )
    with process_pool(min(workers, len(urls))) as pool:
        jobs = zip(urls, names, strict=True)
        mapped = map(scan, jobs) if pool is None else pool.imap(scan, jobs)
        bar = progress(
            mapped, enabled=show_progress, total=len(urls), desc="indexing", unit=" tars"
        )
        shards, bad, totals = SpilledShards(), [], Totals()  # memory: not a row a shard
        examples = []  # of the images left out of their documents
        for shard, counted, found, left_out in bar:
            shards.append(shard)
            bad += found
            totals.update(counted)
            examples += [f"{d['shard']}/{d['key']}: {d['message']}" for d in left_out]
            del examples[10:]
    skipped_url = join(output, INDEX_SKIPPED_NAME)
    skipped = publish_skipped(bad, skipped_url, storage_options)
    if stops(bad, totals.samples, skip_bad):
        for shard in shards:  # no index, no sidecars of it
            remove(join(output, shard["sidecar"]["name"]), storage_options)
        refuse_bad(
            bad,
            totals.samples,
            skip_bad,
            items="samples",
            outcome="no index.json was written (pass --skip-bad / skip_bad=True to index the "
            f"rest; they are listed in {INDEX_SKIPPED_NAME})",
            empty=f"no samples in the tars of {source}: nothing to index",
        )
    shard_root = None
    if output != folder:  # absolute: the index may be read from anywhere
        shard_root = folder if "://" in folder else os.path.abspath(folder)
    index = root_index(shards, totals, skipped, layout=layout.to_dict(), shard_root=shard_root)
    dropped = totals.dropped_images
    if dropped:
        log.warning(
            "dropped %d images from their documents, the rest of each kept (%s), e.g. %s",
            sum(dropped.values()),
            dict(dropped),
            "; ".join(examples[:3]),
        )
    publish_root(output, index, storage_options, index_version)
    if bad:
        log.warning(
            "skipped %d bad samples (%s); listed in %s", len(bad), dict(skipped), skipped_url
        )
    return IndexSummary(
        output=output,
        layout=layout.name,
        detected=detected,
        shards=len(shards),
        samples=totals.samples,
        images=totals.images,
        documents=totals.documents,
        captions=totals.captions,
        bytes=index["totals"]["bytes"],
        skipped=dict(skipped),
        dropped_images=dict(sorted(dropped.items())),
        dropped_examples=examples,
        seconds=time.perf_counter() - started,
    )


def _scan_and_publish(
    job: tuple[str, str], layout: Layout, output: str, options, max_video_pixels: int
) -> tuple:
    """Scan one tar and publish its sidecar; return its root-index entry, its totals, its
    bad samples and the images left out of its documents."""
    url, name = job
    scanned = scan_tar(url, layout, options, max_video_pixels, name)
    entries = scanned["entries"]
    totals = Totals()
    for e in entries:
        kind = KINDS[e.get("kind", 0)]
        totals.add(len(e["images"]), e["chars"], layout.name, len(e.get("videos", [])), kind)
    totals.drop(Counter(d["reason"] for d in scanned["dropped"]))
    shard = publish_sidecar(output, name, entries, scanned["bytes"], scanned["sha256"], options)
    return shard, totals, scanned["bad"], scanned["dropped"]
