"""A Loader's figures for the epoch so far: what its batches hold (counted as they are
yielded) and what its workers report with each batch (drops, truncations, skips, the vision
load of the batches)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..pipeline.pack import tiles_cv
from ..pipeline.packer import budget_advice
from ..pipeline.stats import SkipStats
from ..pipeline.tokenize import IGNORE_INDEX


@dataclass
class Yielded:
    """What the batches yielded this epoch hold: real packs, samples, tokens and tiles, and
    a mixture's samples per source."""

    packs: int = 0
    samples: int = 0
    tokens: int = 0
    tiles: int = 0
    sources: Counter = field(default_factory=Counter)
    supervised: Counter = field(default_factory=Counter)
    """A mixture's supervised tokens per source."""

    def count(self, batch: Mapping) -> tuple[int, int]:
        """Count ``batch`` in; returns its samples and (real) tokens."""
        samples = sum(len(row) for row in batch["sample_keys"])
        tokens = int(batch["attention_mask"].sum())
        self.packs += sum(1 for row in batch["sample_keys"] if row)
        self.samples += samples
        self.tokens += tokens
        self.tiles += int(batch["image_tiles"].sum())
        for row in batch.get("sample_sources", ()):
            self.sources.update(row)
        if "sample_sources" in batch:
            self.supervised.update(supervised_by_source(batch))
        return samples, tokens


def supervised_by_source(batch: Mapping) -> Counter:
    """A mixture's batch's supervised tokens (labels not ignored) per source: each row's
    samples are its first segments (``cu_seqlens``), padding the segment after them."""
    supervised = (batch["labels"] != IGNORE_INDEX).reshape(-1).cumsum(0).tolist()
    ends = batch["cu_seqlens"].tolist()
    length = batch["labels"].shape[-1]
    out: Counter = Counter()
    segment = 0
    for r, row in enumerate(batch["sample_sources"]):
        for name in row:
            a, b = ends[segment], ends[segment + 1]
            out[name] += supervised[b - 1] - (supervised[a - 1] if a else 0)
            segment += 1
        if ends[segment] < (r + 1) * length:  # the row's padding
            segment += 1
    return out


def epoch_stats(yielded: Yielded, reports: Mapping[int, dict], max_length: int) -> dict:
    """The Loader's ``stats()``: fill ratio of the packed rows, samples and tiles per pack,
    tiles-per-batch spread, a mixture's share of the samples and of the supervised tokens per
    source, from ``yielded``;
    and, all workers' latest ``reports`` together, drops, truncations and skipped samples
    (counts, and up to 10 ``"SHARD/KEY"`` per reason and worker), and the requests of their
    reads per source."""
    skips = SkipStats()
    truncated = batches = tiles = squares = vision_bound = 0
    dropped: dict = {}
    dropped_examples: dict = {}
    for report in reports.values():
        skips.merge(report["skips"])
        packing = report["packing"]
        truncated += packing["truncated"]
        vision_bound += packing.get("vision_bound", 0)
        full_batches, batch_tiles, batch_squares = report["batch_tiles"]
        batches += full_batches
        tiles += batch_tiles
        squares += batch_squares
        for reason, n in packing["dropped"].items():
            dropped[reason] = dropped.get(reason, 0) + n
        for reason, keys in packing["dropped_examples"].items():
            dropped_examples.setdefault(reason, []).extend(keys)
    packs, samples = yielded.packs, yielded.samples
    capacity = packs * max_length
    return {
        "fill": yielded.tokens / capacity if capacity else 0.0,
        "packs": packs,
        "samples": samples,
        "samples_per_pack": samples / packs if packs else 0.0,
        "tiles_per_pack": yielded.tiles / packs if packs else 0.0,
        "tiles_per_batch_cv": tiles_cv(batches, tiles, squares),
        "truncated": truncated,
        "vision_bound": vision_bound,
        "dropped": dropped,
        "dropped_examples": dropped_examples,
        **(
            {"sources": {k: n / samples for k, n in sorted(yielded.sources.items())}}
            if yielded.sources
            else {}
        ),
        **(
            {"sources_supervised": shares(yielded.supervised)}
            if sum(yielded.supervised.values())
            else {}
        ),
        "skipped": dict(skips.counts),
        "skipped_examples": {k: list(v) for k, v in skips.examples.items()},
        "requests": skips.as_dict(timed=False)["requests"],  # the counts; seconds: metrics()
    }


def shares(counts: Counter) -> dict[str, float]:
    total = sum(counts.values())
    return {k: n / total for k, n in sorted(counts.items())}


def epoch_advice(
    reports: Mapping[int, dict], max_length: int, max_units: int | None, unit: str
) -> str | None:
    """``packer.budget_advice`` for all workers' packs of the epoch together."""
    names = ("packs", "tokens", "tiles", "vision_bound", "vision_bound_room")
    packing = {n: sum(r["packing"].get(n, 0) for r in reports.values()) for n in names}
    return budget_advice(packing, max_length, max_units, unit)
