"""``wdsvlm bench``: the Loader's throughput beside a naive webdataset pipeline doing the same
work, measured one after the other in one run.

The naive pipeline is what a first VLM loader usually is: webdataset's tar reader, a full PIL
decode of every image, the same resize and tiling (tile by tile crops), the chat template and
a tokenizer call per sample, labels found by tokenizing each conversation prefix, samples over
``max_length`` dropped, and batches of ``batch_size`` samples padded to the longest. Both
pipelines run in a torch DataLoader with the same number of workers.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from ..families.tiling import ImageConfig, tile_grid
from ..format.images import image_members, to_rgb
from ..pipeline.tokenize import IGNORE_INDEX, Tokenize
from ..progress import progress


def naive_tiles(data: bytes, config: ImageConfig) -> np.ndarray:
    """An image's tiles ``[N, 3, S, S]`` (uint8), decoded at full size and cut crop by crop."""
    img = to_rgb(ImageOps.exif_transpose(Image.open(io.BytesIO(data))))
    cols, rows = tile_grid(img.width, img.height, config)
    s = config.tile_size
    grid = img.resize((cols * s, rows * s), Image.Resampling.BICUBIC, reducing_gap=3.0)
    tiles = [
        np.asarray(grid.crop((c * s, r * s, (c + 1) * s, (r + 1) * s))).transpose(2, 0, 1)
        for r in range(rows)
        for c in range(cols)
    ]
    if len(tiles) > 1:
        thumb = grid.resize((s, s), Image.Resampling.BICUBIC, reducing_gap=3.0)
        tiles.insert(0, np.asarray(thumb).transpose(2, 0, 1))
    return np.stack(tiles)


def naive_tokens(
    tokenize: Tokenize, messages: list[dict], tiles: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """``input_ids`` and ``labels`` the usual slow way: the chat template applied to each
    prefix of the conversation and tokenized again, answers located by token counts."""
    tokenizer, marker = tokenize.tokenizer, tokenize.image_token
    messages = [{**m, "content": m["content"].replace("<image>", marker)} for m in messages]

    def ids_of(msgs, prompt=False):
        text = tokenizer.apply_chat_template(
            msgs, chat_template=tokenize.chat_template, tokenize=False, add_generation_prompt=prompt
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids = ids_of(messages)
    labels = [IGNORE_INDEX] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, stop = len(ids_of(messages[:i], prompt=True)), len(ids_of(messages[: i + 1]))
            while stop > start and not tokenizer.decode(ids[stop - 1]).strip():
                stop -= 1  # the newline after the end-of-turn token is not supervised
            labels[start:stop] = ids[start:stop]
    out_ids, out_labels, k = [], [], 0
    per_tile = tokenize.family.tokens_per_tile
    for t, label in zip(ids, labels, strict=True):
        if t == tokenize.image_token_id:
            out_ids += [t] * (tiles[k] * per_tile)
            out_labels += [IGNORE_INDEX] * (tiles[k] * per_tile)
            k += 1
        else:
            out_ids.append(t)
            out_labels.append(label)
    return np.asarray(out_ids, dtype=np.int64), np.asarray(out_labels, dtype=np.int64)


def naive_samples(samples: Iterator[dict], tokenize: Tokenize) -> Iterator[dict]:
    """webdataset samples (members by extension) -> tiles, ``input_ids`` and ``labels``."""
    for sample in samples:
        messages = json.loads(sample["json"])["messages"]
        per_image = [
            naive_tiles(sample[name], tokenize.family.config) for name in image_members(sample)
        ]
        tiles = [len(t) for t in per_image]
        ids, labels = naive_tokens(tokenize, messages, tiles)
        s = tokenize.family.config.tile_size
        yield {
            "__key__": sample["__key__"],
            "input_ids": ids,
            "labels": labels,
            "image_tiles": tiles,
            "pixel_values": np.concatenate(per_image)
            if per_image
            else np.zeros((0, 3, s, s), np.uint8),
        }


def pad_to_longest(samples: list[dict]) -> dict:
    """A naive batch: one row per sample, padded to the longest."""
    import torch

    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros((len(samples), longest), dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n] = torch.from_numpy(s["input_ids"])
        labels[row, :n] = torch.from_numpy(s["labels"])
        mask[row, :n] = 1
    pixels = torch.from_numpy(np.concatenate([s["pixel_values"] for s in samples]))
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": mask,
        "pixel_values": pixels,
        "sample_keys": [[s["__key__"]] for s in samples],
    }


class _OpenShards:
    """webdataset stage: shard URLs -> open streams, through fsspec (local or bucket)."""

    def __init__(self, storage_options: Mapping[str, Any] | None):
        self.storage_options = storage_options

    def __call__(self, urls):
        from ..storage.fs import filesystem

        for item in urls:
            fs, path = filesystem(item["url"], self.storage_options)
            with fs.open(path, "rb") as stream:
                yield {"url": item["url"], "stream": stream}


class _Naive:
    """webdataset stage: ``naive_samples`` (a class, so that it pickles into workers)."""

    def __init__(self, tokenize: Tokenize):
        self.tokenize = tokenize

    def __call__(self, samples):
        return naive_samples(samples, self.tokenize)


def naive_pipeline(
    urls: list[str],
    tokenize: Tokenize,
    max_length: int,
    batch_size: int,
    storage_options: Mapping[str, Any] | None = None,
    layout: Mapping[str, Any] | None = None,
):
    """The naive pipeline as a webdataset ``DataPipeline`` of padded batches (shards split
    over DataLoader workers)."""
    return webdataset_batches(
        urls, _Naive(tokenize), max_length, batch_size, pad_to_longest, storage_options, layout
    )


def webdataset_batches(
    urls: list[str],
    stage,
    max_length: int,
    batch_size: int,
    collate,
    storage_options: Mapping[str, Any] | None = None,
    layout: Mapping[str, Any] | None = None,
):
    """A plain webdataset ``DataPipeline``: shards split over DataLoader workers, read with
    webdataset's tar reader, samples (members by extension; of another ``layout``, made
    wdsvlm's own) through ``stage``, those over ``max_length`` tokens dropped, batches of
    ``batch_size`` made by ``collate``."""
    import functools

    import webdataset as wds
    from webdataset.tariterators import group_by_keys, tar_file_expander

    return wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.split_by_worker,
        _OpenShards(storage_options),
        tar_file_expander,
        group_by_keys,
        _AsOwn(layout),
        stage,
        wds.select(functools.partial(_fits, max_length=max_length)),
        wds.batched(batch_size, collation_fn=collate, partial=True),
    )


class _AsOwn:
    """Samples of another layout (``layouts``) as wdsvlm's own members; those that make no
    sample of it are dropped (the Loader counts them)."""

    def __init__(self, layout: Mapping[str, Any] | None):
        from ..format.layouts import Layout

        self.layout = Layout.from_dict(layout)

    def __call__(self, samples: Iterator[dict]) -> Iterator[dict]:
        from ..format.layouts import BadSample

        for sample in samples:
            if self.layout.native:
                yield sample
                continue
            meta = {k: v for k, v in sample.items() if k.startswith("__")}
            members = {k: v for k, v in sample.items() if not k.startswith("__")}
            try:
                yield {**meta, **self.layout.convert(sample["__key__"], members)}
            except BadSample:
                continue


def _fits(sample: dict, max_length: int) -> bool:
    return len(sample["input_ids"]) <= max_length


def timed(batches, limit: int | None, bar, started: float | None = None, each=None) -> dict:
    """Consume batches (until ``limit`` samples): counts and rates, the first batch apart,
    timed from ``started`` (default: now). ``each(batch)``, if given, is called on every
    batch inside the timing (work the training loop would do on it)."""
    started = time.perf_counter() if started is None else started
    first = None
    samples = tokens = cells = count = first_samples = 0
    for batch in batches:
        if each is not None:
            each(batch)
        n = sum(len(keys) for keys in batch["sample_keys"])
        if first is None:
            first, first_samples = time.perf_counter() - started, n
        count += 1
        samples += n
        tokens += int(batch["attention_mask"].sum())
        cells += batch["input_ids"].numel()
        bar.update(n)
        if limit is not None and samples >= limit:
            break
    seconds = time.perf_counter() - started
    after_first = seconds - (first or 0.0)
    return {
        "samples": samples,
        "batches": count,
        "tokens": tokens,
        "seconds": seconds,
        "samples_per_s": samples / seconds if seconds else 0.0,
        # the steady rate: what the first batch's set-up (workers, buffers) does not weigh on
        "samples_per_s_after_first": (samples - first_samples) / after_first
        if after_first > 0
        else 0.0,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "batches_per_s": count / seconds if seconds else 0.0,
        "first_batch_s": first,  # None when there was no batch
        "padding": 1 - tokens / cells if cells else 0.0,
    }


def run_bench(
    source: str,
    tokenizer: Any,
    *,
    max_length: int = 2048,
    batch_size: int = 8,
    workers: int = 2,
    limit: int | None = None,
    image_config: ImageConfig | None = None,
    tokens_per_tile: int = 64,
    storage_options: Mapping[str, Any] | None = None,
    show_progress: bool = True,
) -> dict:
    """Throughput of the naive pipeline over one pass of ``source``, then of ``wdsvlm.Loader``
    over one epoch (``len(loader)`` batches: about a pass), or each until ``limit`` samples,
    with ``workers`` DataLoader workers each (the naive pipeline splits whole shards, so it
    gets at most one worker per shard). The ratios are wdsvlm over naive (None where the naive
    side gave nothing). Times to the first batch include starting the workers."""
    from ..loader.loader import Loader

    config = image_config or ImageConfig()
    tokenize = Tokenize(tokenizer, tokens_per_tile=tokens_per_tile, image_config=config)

    def loader():
        return Loader(
            source,
            tokenize.tokenizer,
            max_length=max_length,
            batch_size=batch_size,
            num_workers=workers,
            tile_size=config.tile_size,
            max_image_side=config.max_image_side,
            upscale=config.upscale,
            tokens_per_tile=tokens_per_tile,
            storage_options=storage_options,
        )

    return side_by_side(
        source,
        lambda urls, layout: naive_pipeline(
            urls, tokenize, max_length, batch_size, storage_options, layout
        ),
        loader,
        workers=workers,
        limit=limit,
        settings={
            "max_length": max_length,
            "batch_size": batch_size,
            "tile_size": config.tile_size,
            "max_image_side": config.max_image_side,
            "tokens_per_tile": tokens_per_tile,
        },
        storage_options=storage_options,
        show_progress=show_progress,
    )


def side_by_side(
    source: str,
    make_naive,
    make_loader,
    *,
    workers: int,
    limit: int | None,
    settings: Mapping[str, Any],
    storage_options: Mapping[str, Any] | None = None,
    show_progress: bool = True,
    each=None,
) -> dict:
    """Time the naive pipeline that ``make_naive(urls, layout)`` makes of the source's shards
    (batches, in a DataLoader with ``workers`` workers, at most one a shard), then the Loader
    that ``make_loader()`` makes (timed from before it is made: its set-up counts;
    ``each(batch)`` is called on every batch inside the timing): the ``source``, its
    ``settings`` (the caller's, with the workers and the limit), ``naive``, ``wdsvlm`` and
    their ``ratios`` (wdsvlm over naive, None where the naive side gave nothing)."""
    from torch.utils.data import DataLoader

    from ..pipeline.sources import resolve_source

    index, urls = resolve_source(source, storage_options)
    samples = sum(shard["samples"] for shard in index["shards"])
    total = samples if limit is None else min(limit, samples)
    naive_workers = min(workers, len(urls))
    results = {}
    with progress(total=total, enabled=show_progress, desc="naive", unit=" samples") as bar:
        pipeline = make_naive(urls, index.get("layout"))
        naive = DataLoader(pipeline, batch_size=None, num_workers=naive_workers)
        results["naive"] = timed(naive, limit, bar)
    with progress(total=total, enabled=show_progress, desc="wdsvlm", unit=" samples") as bar:
        started = time.perf_counter()
        loader = make_loader()
        try:
            results["wdsvlm"] = timed(loader, limit, bar, started, each)
        finally:
            loader.close()
    naive, ours = results["naive"], results["wdsvlm"]

    def ratio(name: str) -> float | None:
        if not naive[name] or not ours[name] or not naive["samples"]:
            return None
        return ours[name] / naive[name]

    return {
        "source": source,
        "settings": {
            **settings,
            "workers": workers,
            "naive_workers": naive_workers,
            "limit": limit,
        },
        **results,
        "ratios": {
            name: ratio(name)
            for name in (
                "samples_per_s",
                "samples_per_s_after_first",
                "tokens_per_s",
                "first_batch_s",
            )
        },
    }


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def bench_table(result: dict, header: str | None = None) -> str:
    """The result of ``run_bench`` as a table, under ``header`` (default: what each side's
    batches are)."""
    naive, ours, ratios = result["naive"], result["wdsvlm"], result["ratios"]
    settings = result["settings"]
    rows = [
        ("", "naive", "wdsvlm", "wdsvlm/naive"),
        (
            "samples/s",
            f"{naive['samples_per_s']:.1f}",
            f"{ours['samples_per_s']:.1f}",
            _times(ratios["samples_per_s"]),
        ),
        (
            "samples/s after the 1st batch",
            f"{naive['samples_per_s_after_first']:.1f}",
            f"{ours['samples_per_s_after_first']:.1f}",
            _times(ratios["samples_per_s_after_first"]),
        ),
        (
            "tokens/s (real)",
            f"{naive['tokens_per_s']:.0f}",
            f"{ours['tokens_per_s']:.0f}",
            _times(ratios["tokens_per_s"]),
        ),
        ("batches/s", f"{naive['batches_per_s']:.2f}", f"{ours['batches_per_s']:.2f}", ""),
        (
            "first batch (s)",
            _seconds(naive["first_batch_s"]),
            _seconds(ours["first_batch_s"]),
            _times(ratios["first_batch_s"]),
        ),
        ("padding", f"{naive['padding']:.1%}", f"{ours['padding']:.1%}", ""),
        ("samples", f"{naive['samples']}", f"{ours['samples']}", ""),
        ("batches", f"{naive['batches']}", f"{ours['batches']}", ""),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    workers = f"{settings['workers']} DataLoader workers each"
    if settings["naive_workers"] < settings["workers"]:
        workers += f" (naive: {settings['naive_workers']}, one per shard)"
    header = header or (
        f"naive batches of {settings['batch_size']} samples padded to the longest, wdsvlm "
        f"batches [{settings['batch_size']}, {settings['max_length']}] packed"
    )
    lines = [f"{result['source']}: {workers}; {header}"]
    for r in rows:
        lines.append(
            f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]:>{widths[3]}}"
        )
    return "\n".join(lines)
