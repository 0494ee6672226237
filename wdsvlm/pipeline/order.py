"""The global order of a pass, and the ranged reads it is read with.

``PassOrder`` is a pure function of the sources, the seed and the pass, never of the topology:
chunks (runs of neighbouring samples of a shard of about ``span_bytes``) visited in seeded
random order, the samples of each visit in a seeded order of their own. ``span`` describes one
ranged read of a shard as ``ReadSamples`` takes it; ``joins`` is the one rule for whether a
sample joins a read. No torch, no I/O: testable alone.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .sources import DataSource

# A span whose bytes are at most this is read in one go, however sparse its samples.
DENSE_ENOUGH = 2**20

SPAN_BYTES = 2**20
"""The default chunk size: about this many bytes of neighbouring samples of a shard are read
with one ranged read (8 MiB before 2026-12-01). Small, for mixing (see ``plan.py``)."""

SPAN_SAMPLES = 32
"""The default for the most samples a chunk holds. Without it, small samples (text) fill a chunk
of ``SPAN_BYTES`` by the hundred: a worker's samples would then come from few shards, and a
shuffle buffer of a thousand samples would hold few chunks (see ``plan.py``)."""


def seeded_rng(*parts: Any) -> np.random.Generator:
    """A generator seeded from ``parts`` (the loader's seed, a pass, a place, ...: any
    integers, negative ones too, and strings), hashed: the one way a seed becomes draws."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:16], "little"))


def span(
    url: str,
    shard: str,
    entries: Sequence[dict],
    *,
    positions: Sequence[int] | None = None,
    pass_: int = 0,
    worker: int = 0,
    source: str | None = None,
    shard_bytes: int | None = None,
    shard_sha256: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    layout: Mapping[str, Any] | None = None,
) -> dict:
    """One ranged read of shard ``url`` (shown as ``shard``), as ``ReadSamples`` takes it: the
    bytes from the first of ``entries`` (index entries) to the end of the last, its samples
    listed in reading order, with their ``positions`` (places), pass, worker and source, and
    the shard's sample ``layout`` (``layouts.Layout.to_dict``) where it is not wdsvlm's own."""
    out = {
        "url": url,
        "shard": shard,
        "start": min(e["offset"] for e in entries),
        "stop": max(e["offset"] + e["size"] for e in entries),
        "entries": list(entries),
        "positions": None if positions is None else list(positions),
        "pass": pass_,
        "worker": worker,
        "source": source,
        "storage_options": storage_options,
    }
    if shard_bytes is not None:  # the shard cache keys on its sha256, sized
        out["shard_bytes"], out["shard_sha256"] = shard_bytes, shard_sha256
    if layout and layout.get("name", "wdsvlm") != "wdsvlm":
        out["layout"] = dict(layout)
    return out


def joins(start: int, stop: int, used: int, entry: dict, limit: int) -> bool:
    """Whether ``entry`` joins the read ``[start, stop)`` holding ``used`` bytes of samples:
    while the read stays within ``limit`` bytes and the samples fill at least a quarter of
    it, or it is at most 1 MB."""
    lo, hi = min(start, entry["offset"]), max(stop, entry["offset"] + entry["size"])
    if hi - lo <= DENSE_ENOUGH:
        return True
    return hi - lo <= limit and (used + entry["size"]) * 4 >= hi - lo


def one_read(entries: Sequence[dict]) -> bool:
    """Whether ``entries`` (samples of one shard, in any order) are read with one ranged
    read: while their samples fill at least a quarter of the bytes from the first to the last
    (the samples of a chunk fill all of it), or those are at most 1 MB. Checked on the whole
    set, not entry by entry, since a visit's samples come in a shuffled order."""
    lo = min(e["offset"] for e in entries)
    hi = max(e["offset"] + e["size"] for e in entries)
    return hi - lo <= DENSE_ENOUGH or sum(e["size"] for e in entries) * 4 >= hi - lo


class PassOrder:
    """The global order of one pass: every sample the pass holds, all sources together, as
    ``(source, shard, entry)`` at places ``0 .. size - 1``. A pure function of the sources,
    the seed and the pass, never of the topology, computed from per-shard counts alone: its
    memory and time grow with the number of chunks, never with the number of samples.

    It is built from chunks: runs of about ``span_bytes`` of neighbouring samples of a shard
    (from the shard's sample count and bytes), each read with one ranged read. A pass visits
    each chunk of a source ``copies`` times, and the source's ``extra`` samples of this pass
    once more: a window of ``extra`` samples of the source in a seeded rotation order of its
    chunks (fixed for the source), moved on by ``extra`` each pass, so that successive passes
    rotate through the whole source; each chunk it touches is one more visit. The visits are
    shuffled; the samples inside a visit are in a seeded order of their own, generated when
    the visit is read (``entries_of``).
    """

    def __init__(
        self,
        sources: Sequence[DataSource],
        seed: int,
        pass_: int,
        span_bytes: int,
        span_samples: int | None = None,
        ordered: bool = False,
        counts: Sequence[tuple[int, int, int]] | None = None,
    ):
        columns = _unshuffled_visits(sources, seed, pass_, span_bytes, span_samples, counts)
        if not ordered:  # ordered: the sources, their shards and samples as the index lists
            order = seeded_rng("wdsvlm-pass", seed, pass_).permutation(len(columns[0]))
            for i in range(4):  # a column at a time, so that few copies are held at once
                columns[i] = columns[i][order]
            del order
        self.ordered = ordered
        self.visit_source, self.visit_shard, self.first, self.stop = columns
        self.starts = np.zeros(len(self.first) + 1, dtype=np.int64)
        np.cumsum(self.stop - self.first, out=self.starts[1:])
        self.size = int(self.starts[-1])
        self._seed, self._pass = seed, pass_
        self._visits: OrderedDict[int, np.ndarray] = OrderedDict()

    def visit_at(self, place: int) -> int:
        return int(np.searchsorted(self.starts, place, side="right")) - 1

    def bounds(self, v: int) -> tuple[int, int]:
        """Places ``[a, b)`` of visit ``v``."""
        return int(self.starts[v]), int(self.starts[v + 1])

    def pieces(self, v: int) -> list[tuple[int, int, np.ndarray]]:
        """``(source, shard, entry numbers)`` of visit ``v``: one shard, in the visit's order."""
        return [(int(self.visit_source[v]), int(self.visit_shard[v]), self.entries_of(v))]

    def entries_of(self, v: int) -> np.ndarray:
        """The entry numbers of visit ``v`` (of its shard), in the visit's seeded order."""
        entries = self._visits.get(v)
        if entries is None:
            first, stop = int(self.first[v]), int(self.stop[v])
            if self.ordered:
                entries = np.arange(first, stop)
            else:
                rng = seeded_rng("wdsvlm-visit", self._seed, self._pass, v)
                entries = first + rng.permutation(stop - first)
            self._visits[v] = entries
            while len(self._visits) > 8:
                self._visits.popitem(last=False)
        return entries

    def entry_at(self, place: int) -> tuple[int, int, int]:
        """``(source, shard, entry)`` at ``place``."""
        v = self.visit_at(place)
        entry = int(self.entries_of(v)[place - int(self.starts[v])])
        return int(self.visit_source[v]), int(self.visit_shard[v]), entry


def _unshuffled_visits(
    sources: Sequence[DataSource], seed: int, pass_: int, span_bytes: int, span_samples, counts
) -> list:
    """The pass's visits before they are shuffled, as four int32 columns: source, shard, first
    entry and stop. int32, since a shard's entries and a source's shards stay far below 2**31,
    and a pass of 100M samples in 1 MiB chunks is about 6M visits."""
    parts = []  # (source, shard, first entry, stop) arrays
    for number, source in enumerate(sources):
        shard, first, stop = _chunks(source, span_bytes, span_samples)
        # a schedule's counts of this pass (``schedule.py``), else the source's own
        copies, extra, start = (
            counts[number]
            if counts is not None
            else (source.copies, source.extra, (pass_ * source.extra) % max(1, source.size))
        )
        for _ in range(copies):
            parts.append((np.full(len(shard), number, np.int32), shard, first, stop))
        if extra:
            extra = _extra_visits(source, number, seed, extra, start, shard, first, stop)
            parts.append((np.full(len(extra[0]), number, np.int32), *extra))
    if not parts:
        return [np.zeros(0, dtype=np.int32)] * 4
    if len(parts) == 1:
        return [column.astype(np.int32, copy=False) for column in parts[0]]
    return [np.concatenate([p[i] for p in parts]).astype(np.int32) for i in range(4)]


def chunk_samples(source: DataSource, span_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Per shard of the source: its samples, and how many of them make about ``span_bytes``
    (from the shard's sample count and bytes; at least 1)."""
    shards = source.index["shards"]
    samples = np.fromiter((s["samples"] for s in shards), dtype=np.int64, count=len(shards))
    nbytes = np.fromiter((s.get("bytes") or 1 for s in shards), dtype=np.int64, count=len(shards))
    return samples, np.maximum(1, span_bytes * samples // np.maximum(1, nbytes))


def caps_chunks(sources: Sequence[DataSource], span_bytes: int, span_samples: int | None) -> bool:
    """Whether ``span_samples`` makes any chunk of the sources smaller than ``span_bytes``
    alone would (whether it changes the order of their passes)."""
    if span_samples is None:
        return False
    for source in sources:
        samples, per_chunk = chunk_samples(source, span_bytes)
        if len(samples) and int(np.minimum(per_chunk, samples).max()) > span_samples:
            return True
    return False


def _chunks(source: DataSource, span_bytes: int, span_samples: int | None = None):
    """``(shard, first entry, stop)`` of each chunk of the source, in shard order: runs of
    neighbouring samples of about ``span_bytes`` and at most ``span_samples`` samples."""
    samples, per_chunk = chunk_samples(source, span_bytes)
    span_samples = source.chunk_cap(span_samples)
    if span_samples is not None:
        per_chunk = np.minimum(per_chunk, span_samples)
    per_chunk = np.minimum(per_chunk, np.maximum(1, samples))  # the same chunks, in int32
    counts = -(-samples // per_chunk)
    shard = np.repeat(np.arange(len(samples), dtype=np.int32), counts)
    first = np.arange(len(shard), dtype=np.int32)
    first -= np.repeat((np.cumsum(counts) - counts).astype(np.int32), counts)  # in its shard
    first *= per_chunk.astype(np.int32)[shard]
    stop = np.minimum(first + per_chunk.astype(np.int32)[shard], samples.astype(np.int32)[shard])
    return shard, first, stop


def _extra_visits(
    source: DataSource, number: int, seed: int, extra: int, start: int, shard, first, stop
):
    """``(shard, first entry, stop)`` of the visits holding the source's ``extra`` samples of
    this pass: the window ``[start, start + extra)`` (modulo the source's size; ``start`` is
    ``pass * extra`` for a fixed share) of the source's samples with its chunks in a seeded
    rotation order, fixed for the source."""
    n = source.size
    rotation = seeded_rng("wdsvlm-extra", seed, number, source.name).permutation(len(shard))
    shard, first, stop = shard[rotation], first[rotation], stop[rotation]
    ends = np.cumsum(stop - first)
    begins = ends - (stop - first)
    windows = [(start, min(n, start + extra))]
    if start + extra > n:  # wrapping round to the source's start
        windows.append((0, start + extra - n))
    out = [[], [], []]
    for lo, hi in windows:
        touched = (ends > lo) & (begins < hi)
        out[0].append(shard[touched])
        out[1].append(first[touched] + np.maximum(0, lo - begins[touched]))
        out[2].append(first[touched] + np.minimum(stop - first, hi - begins)[touched])
    return tuple(np.concatenate(parts) for parts in out)
