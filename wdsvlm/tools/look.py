"""Looking at a dataset before training on it: a few samples as they are stored (``inspect``),
and what its samples weigh in tokens and tiles and what packing saves at a ``max_length``
(``stats``). Both read through the loader's own stages, so they see what training sees."""

from __future__ import annotations

import itertools
import logging
import random
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..pipeline.images import ImageConfig, image_members, tile_count, tile_grid
from ..pipeline.stats import SkipStats
from ..progress import progress

log = logging.getLogger("wdsvlm.look")

# Token kinds in a batch picture (``token_kinds``); 0 is padding.
PAD, TEXT, IMAGE, SUPERVISED = 0, 1, 2, 3
PACK_REASONS = ("too_many_tokens", "too_many_tiles")


def _spans(picked: Sequence[tuple]) -> Iterator[dict]:
    """One read span per ``(shard URL, shard name, index entry, storage options, layout)``."""
    from ..pipeline.plan import span

    for url, shard, entry, options, layout in picked:
        yield span(url, shard, [entry], storage_options=options, layout=layout)


def pick_entries(
    index: dict, urls: Sequence[str], n: int, keys: Sequence[str] = ()
) -> list[tuple[str, str, dict]]:
    """``(shard URL, shard name, entry)`` of the samples with ``keys`` (in that order), or else
    the first ``n`` samples. An unknown key is a ``ValueError`` naming it. Only the sidecars
    of the shards needed are read (for a key: those whose first and last keys, in the root
    index of version 2, bracket it; all, if it is not found there)."""
    shards = list(zip(index["shards"], urls, strict=True))

    def among(chosen):
        return ((url, s["name"], e) for s, url in chosen for e in s["entries"])

    if not keys:
        return list(itertools.islice(among(shards), n))
    where: dict[str, tuple] = {}
    for key in keys:
        if key in where:
            continue
        bracketing = [
            (s, url)
            for s, url in shards
            if len(s.get("keys", [])) == 2 and s["keys"][0] <= key <= s["keys"][1]
        ]
        for chosen in (bracketing, shards):
            found = next(((u, name, e) for u, name, e in among(chosen) if e["key"] == key), None)
            if found is not None:
                where[key] = found
                break
    missing = [k for k in keys if k not in where]
    if missing:
        some = ", ".join(e["key"] for _, _, e in itertools.islice(among(shards), 3))
        raise ValueError(
            f"no sample with key {', '.join(missing)} in the dataset (keys look like {some})"
        )
    return [where[k] for k in keys]


@dataclass
class SampleView:
    """One stored sample as ``inspect`` shows it."""

    key: str
    shard: str
    messages: list[dict]
    images: list[bytes]
    sizes: list[tuple[int, int]]
    tiles: list[int]
    grids: list[tuple[int, int]]
    turn_tokens: list[int] | None = None  # text tokens of each turn's content
    tokens: dict[str, int] | None = None  # whole sample: total, image, text, supervised
    problem: str | None = None  # why the loader would skip it (invalid JSON, ...)

    def describe(self, max_chars: int = 400) -> str:
        lines = [f"{self.key}  ({self.shard})"]
        for i, (size, tiles, grid) in enumerate(
            zip(self.sizes, self.tiles, self.grids, strict=True)
        ):
            how = f"{grid[0]}x{grid[1]} + thumbnail" if tiles > 1 else "one tile"
            noun = "tile" if tiles == 1 else "tiles"
            lines.append(f"  image {i}: {size[0]}x{size[1]} px, {tiles} {noun} ({how})")
        if not self.images:
            lines.append("  no images")
        for i, m in enumerate(self.messages):
            text = m["content"]
            if len(text) > max_chars:
                text = text[:max_chars] + f"... ({len(m['content']) - max_chars} more chars)"
            count = f", {self.turn_tokens[i]} tokens" if self.turn_tokens else ""
            lines.append(f"  [{m['role']}{count}] " + text.replace("\n", "\n    "))
        if self.problem:
            lines.append(f"  PROBLEM: {self.problem}")
        if self.tokens:
            t = self.tokens
            lines.append(
                f"  tokens: {t['total']} ({t['image']} image, {t['text']} text, "
                f"{t['supervised']} supervised)"
            )
        return "\n".join(lines)


def inspect_samples(
    source: Any,
    *,
    n: int = 5,
    keys: Sequence[str] = (),
    tokenizer: Any = None,
    image_config: ImageConfig | None = None,
    tokens_per_tile: int = 64,
    storage_options: Mapping[str, Any] | None = None,
) -> list[SampleView]:
    """The first ``n`` samples of ``source`` (or those with ``keys``), read by their index
    offsets; with a ``tokenizer``, their token counts as the loader would make them. A sample
    the loader would skip is shown with its ``problem``."""
    from ..pipeline.read import ReadSamples
    from ..pipeline.sources import resolve_sources

    config = image_config or ImageConfig()
    sources, mixture = resolve_sources(source, storage_options)
    if not mixture:
        s = sources[0]
        picked = [
            (url, shard, entry, s.storage_options, s.index.get("layout"))
            for url, shard, entry in pick_entries(s.index, s.urls, n, keys)
        ]
    else:  # a mixture: the first n of each source, or keys named "SOURCE/KEY"
        names = {s.name for s in sources}
        strays = [k for k in keys if k.split("/", 1)[0] not in names or "/" not in k]
        if strays:
            raise ValueError(
                f"keys of a mixture are SOURCE/KEY with a source of {sorted(names)}: "
                f"{', '.join(strays)}"
            )
        picked = []
        for s in sources:
            wanted = [k.split("/", 1)[1] for k in keys if k.split("/", 1)[0] == s.name]
            if keys and not wanted:
                continue
            picked += [
                (url, f"{s.name}/{shard}", entry, s.storage_options, s.index.get("layout"))
                for url, shard, entry in pick_entries(s.index, s.urls, n, wanted)
            ]
    stats = SkipStats(max_consecutive=sys.maxsize)  # bad samples are shown, however many
    samples = list(ReadSamples(storage_options, stats=stats)(_spans(picked)))
    if stats.counts:
        log.warning("could not read every sample: %s", stats.as_dict(examples=3))
    tokenize = None
    if tokenizer is not None:
        from ..pipeline.tokenize import Tokenize

        tokenize = Tokenize(
            tokenizer, tokens_per_tile=tokens_per_tile, image_config=config, stats=stats
        )
    return [_view(sample, config, tokenize) for sample in samples]


def _view(sample: dict, config: ImageConfig, tokenize) -> SampleView:
    import json

    sizes = [tuple(s) for s in sample["__meta__"]["images"]]
    view = SampleView(
        key=sample["__key__"],
        shard=sample["__shard__"],
        messages=[],
        images=[sample[name] for name in image_members(sample)],
        sizes=sizes,
        tiles=[tile_count(w, h, config) for w, h in sizes],
        grids=[tile_grid(w, h, config) for w, h in sizes],
    )
    try:
        view.messages = [
            {"role": str(m["role"]), "content": str(m["content"])}
            for m in json.loads(sample["json"])["messages"]
        ]
    except (KeyError, TypeError, ValueError) as e:
        view.problem = f"invalid JSON member ({type(e).__name__}: {e})"
        return view
    if tokenize is None:
        return view
    encode = tokenize.tokenizer
    view.turn_tokens = [
        len(encode(m["content"], add_special_tokens=False)["input_ids"]) for m in view.messages
    ]
    before = dict(tokenize.stats.counts)
    encoded = tokenize.encode([dict(sample)])
    if encoded:
        kinds = token_kinds(encoded[0], tokenize.image_token_id)
        view.tokens = {
            "total": len(kinds),
            "image": int((kinds == IMAGE).sum()),
            "text": int((kinds == TEXT).sum()),
            "supervised": int((kinds == SUPERVISED).sum()),
        }
    else:
        reasons = [r for r, n in tokenize.stats.counts.items() if n > before.get(r, 0)]
        view.problem = f"the loader would skip it: {', '.join(reasons) or 'not tokenized'}"
    return view


def token_kinds(sample: dict, image_token_id: int) -> np.ndarray:
    """Each token of a tokenized sample as ``TEXT``, ``IMAGE`` or ``SUPERVISED`` (uint8)."""
    from ..pipeline.tokenize import IGNORE_INDEX

    kinds = np.full(len(sample["input_ids"]), TEXT, dtype=np.uint8)
    kinds[sample["input_ids"] == image_token_id] = IMAGE
    kinds[sample["labels"] != IGNORE_INDEX] = SUPERVISED
    return kinds


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
    kept (fit the budgets), and their tokens."""

    @property
    def samples(self) -> int:
        return len(self.tokens)

    def as_dict(self) -> dict:
        t = self.tokens
        return {
            "source": self.source,
            "max_length": self.max_length,
            "batch_size": self.batch_size,
            "samples": self.samples,
            "images": self.images,
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
        }

    def table(self) -> str:
        d = self.as_dict()
        per = d["tokens_per_sample"]
        kept = self.samples - sum(self.dropped.values())
        rows = [
            ("samples", f"{d['samples']}"),
            ("images", f"{d['images']}"),
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
    tokenizer: Any,
    *,
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
    order), tokenize it as the loader does (tile counts from the index: no image is decoded)
    and pack it with the loader's packer at ``max_length``.

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
    tokenize = Tokenize(
        tokenizer, tokens_per_tile=tokens_per_tile, image_config=config, stats=skips
    )
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
                counts["read"] += 1
                counts["tokens"] += int(sample["num_tokens"])
            tokens.append(sample["num_tokens"])
            tiles.append(sum(sample["image_tiles"]))
            images += len(sample["image_tiles"])
            supervised += int((sample["labels"] != IGNORE_INDEX).sum())
            if len(picture) < picture_samples:
                picture.append(token_kinds(sample, tokenize.image_token_id))
            del sample["input_ids"], sample["labels"]  # only sizes are needed from here
            for name in image_members(sample):
                del sample[name]
            yield sample

    pack = Pack(max_length, max_tiles_per_pack=max_tiles_per_pack, window=pack_window)
    fitting = {}  # by (shard, key, place): a mixture's pass may hold a sample twice
    packing = pack(measured(tokenize(bar)))
    for packed in packing:
        fitting.update(
            ((s["__shard__"], s["__key__"], s["__pos__"]), s["num_tokens"]) for s in packed
        )
        if plan.mixture:
            for s in packed:
                per_source[s["__source__"]]["kept"] += 1
    bar.close()
    packs = packing.stats
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
        skipped=dict(skips.counts),
        dropped=dropped,
        padding=padding,
        packs=packs.packs,
        samples_per_pack=packs.samples / packs.packs if packs.packs else 0.0,
        picture=picture,
        per_source=per_source if plan.mixture else {},
    )
