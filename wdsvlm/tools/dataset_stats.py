"""What a dataset's samples weigh in tokens and tiles, and what packing saves at a
``max_length`` (``wdsvlm stats``), read through the loader's own stages."""

from __future__ import annotations

import itertools
import logging
import random
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..families.tiling import ImageConfig
from ..format.images import image_members
from ..format.videos import video_members
from ..pipeline.packer import Packer, budget_advice, suggest_budget
from ..pipeline.stats import SkipStats
from ..progress import progress
from .document_stats import OVER_BUDGET, DocumentTally, table_rows
from .samples import token_kinds

log = logging.getLogger("wdsvlm.stats")

PACK_REASONS = ("too_many_tokens", "too_many_vision_units")


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


@dataclass
class DatasetStats:
    """What ``dataset_stats`` found. ``tokens`` and ``tiles``: per sample read and tokenized
    (before the ``max_length`` cut); padding fractions are over the samples that fit (None
    when none does)."""

    source: str
    max_length: int
    batch_size: int
    tokens: np.ndarray
    tiles: np.ndarray
    images: int
    supervised: int
    skipped: dict[str, int]
    dropped: dict[str, int]
    padding: dict[str, float]
    packs: int
    samples_per_pack: float
    picture: list[np.ndarray] = field(repr=False, default_factory=list)
    per_source: dict[str, dict] = field(default_factory=dict)
    """For a mixture, per source: samples its share of the pass plans, read and tokenized,
    kept (fit the budgets), and their tokens (a document counts once, by its first piece; its
    tokens are all its pieces')."""
    videos: dict[str, int] = field(default_factory=dict)
    """Videos read, their vision units and their tokens (those in place of each video's
    marker, as ``inspect`` counts them), with a processor's family."""
    unit_name: str = "tiles"
    advice: str | None = None
    """Where the vision budget binds: how much it costs and a budget that does not bind
    (``packer.budget_advice``, measured by packing the same samples)."""
    documents: dict = field(default_factory=dict)
    """Of the documents and captions read (``document_stats.DocumentTally.as_dict``): their
    characters, tokens, images and pieces, and the images dropped; empty without any."""
    max_units: int | None = None

    @property
    def samples(self) -> int:
        return len(self.tokens)

    def as_dict(self) -> dict:
        t = self.tokens
        return {
            "source": self.source,
            "max_length": self.max_length,
            "naive_batch_size": self.batch_size,
            "batch_size": self.batch_size,  # its old name
            "samples": self.samples,
            "images": self.images,
            **({"videos": self.videos} if self.videos.get("videos") else {}),
            "tiles": int(self.tiles.sum()),
            "tokens": int(t.sum()),
            "supervised_tokens": self.supervised,
            "tokens_per_sample": {
                "mean": float(t.mean()) if len(t) else 0.0,
                "p50": _percentile(t, 50),
                "p95": _percentile(t, 95),
                "max": int(t.max()) if len(t) else 0,
            },
            "skipped": self.skipped,
            "dropped": self.dropped,
            "padding": self.padding,
            "packs": self.packs,
            "samples_per_pack": self.samples_per_pack,
            **({"sources": self.per_source} if self.per_source else {}),
            **({"advice": self.advice} if self.advice else {}),
            **({"documents": self.documents} if self.documents else {}),
        }

    def table(self) -> str:
        d = self.as_dict()
        per = d["tokens_per_sample"]
        kept = self.samples - sum(self.dropped.values())
        rows = [
            ("samples", f"{d['samples']}"),
            ("images", f"{d['images']}"),
            *(
                [
                    (
                        "videos",
                        f"{self.videos['videos']} ({self.videos['units']} {self.unit_name}, "
                        f"{self.videos['tokens']} tokens)",
                    )
                ]
                if self.videos.get("videos")
                else []
            ),
            ("tiles", f"{d['tiles']} ({d['tiles'] / max(d['samples'], 1):.2f} per sample)"),
            (
                "tokens per sample",
                f"mean {per['mean']:.0f}, p50 {per['p50']:.0f}, p95 {per['p95']:.0f}, "
                f"max {per['max']}",
            ),
            (
                "supervised tokens",
                f"{self.supervised} ({self.supervised / max(d['tokens'], 1):.1%} of all)",
            ),
            ("skipped (bad data)", _reasons(self.skipped)),
            (f"dropped at max_length {self.max_length}", _reasons(self.dropped)),
            (
                f"padding, naive (batches of {self.batch_size})",
                _share(self.padding["naive"], "pad to the longest in each batch"),
            ),
            ("padding, fixed length", _share(self.padding["fixed"], "each sample to max_length")),
            (
                "padding, wdsvlm packing",
                _share(
                    self.padding["packed"],
                    f"{kept} samples in {self.packs} rows of {self.max_length}, "
                    f"{self.samples_per_pack:.1f} per row",
                ),
            ),
        ]
        for name, n in self.per_source.items():
            rows.append(
                (
                    f"source {name}",
                    f"{n['planned']} a pass, {n['read']} read, {n['kept']} kept "
                    f"({n['planned'] - n['read']} skipped, {n['read'] - n['kept']} dropped); "
                    f"{n['tokens']} tokens",
                )
            )
        if self.documents:
            cut = f"at max_length {self.max_length}"
            if self.max_units is not None:
                cut += f", {self.max_units} {self.unit_name} a piece"
            rows += table_rows(self.documents, cut)
        if self.advice:
            rows.append(("vision budget", self.advice))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _share(value: float | None, how: str) -> str:
    return "n/a (no sample fits)" if value is None else f"{value:.1%} ({how})"


def _reasons(counts: Mapping[str, int]) -> str:
    if not any(counts.values()):
        return "none"
    return ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()) if n)


def naive_padding(lengths: Mapping[Any, int], batch_size: int, seed: int = 0) -> float:
    """Padding fraction of batches of ``batch_size`` samples (``{(shard, key): tokens}``) in a
    seeded shuffle of their sorted order, each padded to its longest."""
    order = [lengths[key] for key in sorted(lengths)]
    random.Random(seed).shuffle(order)
    rows = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    room = sum(max(r) * len(r) for r in rows)
    return 1 - sum(order) / room if room else 0.0


def dataset_stats(
    source: str,
    tokenizer: Any = None,
    *,
    processor: Any = None,
    max_length: int = 2048,
    batch_size: int = 8,
    limit: int | None = None,
    image_config: ImageConfig | None = None,
    tokens_per_tile: int = 64,
    max_tiles_per_pack: int | None = None,
    pack_window: int = 500,
    seed: int = 0,
    picture_samples: int = 256,
    storage_options: Mapping[str, Any] | None = None,
    show_progress: bool = True,
) -> DatasetStats:
    """Read ``source`` (all of it, or its first ``limit`` samples in a seeded shuffled shard
    order), tokenize it as the loader does (tile counts from the index: no image is decoded;
    with a ``processor``, as its family does, videos included) and pack it with the loader's
    packer at ``max_length``. A document or caption is cut into pieces as the Loader cuts it
    (at ``max_length`` and ``max_tiles_per_pack``), each piece a sample; ``documents`` gives
    their figures (``document_stats``).

    Padding is compared over the samples that fit: naive pad-to-longest batches of
    ``batch_size`` in shuffled order, every sample padded to ``max_length``, and wdsvlm's
    packing. The token kinds of the first ``picture_samples`` samples are kept for
    ``batch_picture``.
    """
    from ..pipeline.pack import Pack
    from ..pipeline.plan import Plan, WorkerConfig
    from ..pipeline.read import ReadSamples
    from ..pipeline.tokenize import IGNORE_INDEX, Tokenize

    config = image_config or ImageConfig()
    skips = SkipStats(max_consecutive=sys.maxsize)  # count every bad sample: no cap here
    pieces = {"max_length": max_length, "max_units": max_tiles_per_pack}  # as the Loader's
    documents = DocumentTally()
    if processor is not None:
        from ..families.registry import family_of

        tokenize = Tokenize(family=family_of(processor), stats=skips, **pieces)
    else:
        tokenize = Tokenize(
            tokenizer, tokens_per_tile=tokens_per_tile, image_config=config, stats=skips, **pieces
        )
    video_token = tokenize.video_token_id
    videos = {"videos": 0, "units": 0, "tokens": 0}
    plan = Plan(source, seed=seed, worker_config=WorkerConfig(), storage_options=storage_options)
    total = plan.num_samples
    if limit is not None:
        total = min(total, limit)
    read = ReadSamples(storage_options, stats=skips)(plan)
    read = itertools.islice(read, total)
    bar = progress(read, enabled=show_progress, total=total, desc="reading", unit=" samples")
    tokens, tiles, picture = [], [], []
    images = supervised = 0

    per_source = {
        source.name: {"planned": source.per_pass, "read": 0, "kept": 0, "tokens": 0}
        for source in plan.sources
    }

    def measured(samples: Iterator[dict]) -> Iterator[dict]:
        nonlocal images, supervised
        for sample in samples:
            if plan.mixture:
                counts = per_source[sample["__source__"]]
                counts["read"] += not sample.get("__piece__")  # a document once, not per piece
                counts["tokens"] += int(sample["num_tokens"])
            tokens.append(sample["num_tokens"])
            tiles.append(sum(sample["image_tiles"]))
            images += len(sample["image_tiles"])
            if sample.get("video_units"):
                videos["videos"] += len(sample["video_units"])
                videos["units"] += int(sum(sample["video_units"]))
                videos["tokens"] += sum(
                    len(tokenize.video.token_ids(info)) for info in tokenize.videos_of(sample)
                )
            supervised += int((sample["labels"] != IGNORE_INDEX).sum())
            if "__piece__" in sample:
                documents.add(sample)
            if len(picture) < picture_samples:
                picture.append(token_kinds(sample, tokenize.image_token_id, video_token))
            del sample["input_ids"], sample["labels"]  # only sizes are needed from here
            for name in [*image_members(sample), *video_members(sample)]:
                del sample[name]
            yield sample

    pack = Pack(
        max_length,
        max_tiles_per_pack=max_tiles_per_pack,
        window=pack_window,
        unit=tokenize.family.unit_name,
    )
    fitting = {}  # by (shard, key, place): a mixture's pass may hold a sample twice
    packing = pack(measured(tokenize(bar)))
    for packed in packing:
        fitting.update(
            ((s["__shard__"], s["__key__"], s["__pos__"]), s["num_tokens"]) for s in packed
        )
        if plan.mixture:
            for s in packed:
                per_source[s["__source__"]]["kept"] += not s.get("__piece__")
    bar.close()
    packs = packing.stats
    advice = None
    if budget_advice(packs.as_dict(), max_length, max_tiles_per_pack, "", ()):
        fits = [(n, t) for n, t in zip(tokens, tiles, strict=True) if n <= max_length]
        measured = unbound_budget(fits, max_length, max_tiles_per_pack, pack_window, packs)
        unit = tokenize.family.unit_name
        advice = budget_advice(packs.as_dict(), max_length, max_tiles_per_pack, unit, measured)
    dropped = {r: packs.dropped.get(r, 0) for r in PACK_REASONS}
    padding = {  # None when no sample fits
        "naive": naive_padding(fitting, batch_size, seed) if fitting else None,
        "fixed": 1 - sum(fitting.values()) / (len(fitting) * max_length) if fitting else None,
        "packed": 1 - packs.fill if fitting else None,
    }
    return DatasetStats(
        source=source,
        max_length=max_length,
        batch_size=batch_size,
        tokens=np.asarray(tokens, dtype=np.int64),
        tiles=np.asarray(tiles, dtype=np.int64),
        images=images,
        supervised=supervised,
        skipped={r: n for r, n in skips.counts.items() if r != OVER_BUDGET},  # not bad data
        dropped=dropped,
        padding=padding,
        packs=packs.packs,
        samples_per_pack=packs.samples / packs.packs if packs.packs else 0.0,
        picture=picture,
        per_source=per_source if plan.mixture else {},
        videos=videos,
        unit_name=tokenize.family.unit_name,
        advice=advice,
        documents=(
            documents.as_dict(skips.counts, [s.index.get("totals", {}) for s in plan.sources])
            if len(documents)
            else {}
        ),
        max_units=max_tiles_per_pack,
    )


def unbound_budget(
    samples: list[tuple[int, int]], max_length: int, max_units: int, window: int, packs
) -> tuple[int, float]:
    """The smallest of the budgets tried (``suggest_budget``'s, then a quarter more each time)
    that ends at most a twentieth of the packs of ``samples`` (``(tokens, units)``, in reading
    order), and the padding it gives."""
    budget = suggest_budget(packs.tokens, packs.tiles, max_length, max_units)
    while True:
        packer = Packer(max_length, budget, window)
        for i, (n, t) in enumerate(samples):
            packer.push(i, n, t)
        for _ in packer.drain():
            pass
        found = packer.stats
        if found.vision_bound <= found.packs / 20 or budget >= max_length * 64:
            return budget, 1 - found.fill
        budget = int(-(-budget * 1.25 // 1024) * 1024)
