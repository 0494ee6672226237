"""``wdsvlm bench``: the Loader's throughput beside a naive webdataset pipeline doing the same
work (``naive.py``), measured one after the other in one run. Both pipelines run in a torch
DataLoader with the same number of workers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from ..families.tiling import ImageConfig
from ..pipeline.tokenize import Tokenize
from ..progress import progress
from .naive import naive_pipeline


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
    telemetry: Any = True,
) -> dict:
    """Throughput of the naive pipeline over one pass of ``source``, then of ``wdsvlm.Loader``
    over one epoch (``len(loader)`` batches: about a pass), or each until ``limit`` samples,
    with ``workers`` DataLoader workers each (the naive pipeline splits whole shards, so it
    gets at most one worker per shard). The ratios are wdsvlm over naive (None where the naive
    side gave nothing). Times to the first batch include starting the workers. ``telemetry``:
    the Loader's setting (``wdsvlm.Telemetry(trace=...)`` writes a trace); the result's
    ``telemetry`` is what it measured (``diagnosis``)."""
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
            telemetry=telemetry,
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
    ``settings`` (the caller's, with the workers and the limit), ``naive``, ``wdsvlm``,
    their ``ratios`` (wdsvlm over naive, None where the naive side gave nothing) and the
    Loader's ``telemetry`` (``diagnosis``)."""
    from torch.utils.data import DataLoader

    from ..pipeline.sources import resolve_source

    index, urls = resolve_source(source, storage_options)
    shards = index["shards"]
    counts = getattr(shards, "samples", None)  # a shard table's column, else each entry's
    samples = int(counts.sum()) if counts is not None else sum(s["samples"] for s in shards)
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
            metrics = loader.metrics()
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
        "telemetry": diagnosis(metrics, workers),
    }


def diagnosis(metrics: Mapping[str, float], workers: int) -> dict:
    """What a Loader's ``metrics()`` say of where its time went: the share of the time spent
    waiting for batches, each stage's share of the workers' seconds (largest first), the
    advice of ``loader.advice.diagnose`` for the stage that dominates (judged on the shares
    alone: a bench has no model step to wait against) and the metrics themselves."""
    from ..loader.advice import diagnose, stage_shares
    from ..pipeline.timing import STAGES

    return {
        "wait_fraction": metrics.get("data/wait_fraction"),
        "workers": workers,
        "worker_seconds": sum(metrics.get(f"data/{stage}_s", 0.0) for stage in STAGES),
        "stage_shares": stage_shares(metrics),
        "advice": diagnose(metrics, workers, None) if metrics else None,
        "metrics": dict(metrics),
    }


def diagnosis_lines(telemetry: Mapping[str, Any]) -> list[str]:
    """``diagnosis`` in words: where the workers' time went, the wait, the advice."""
    lines = []
    shares = telemetry["stage_shares"]
    if shares:
        parts = ", ".join(
            f"{stage} {share:.0%}" for stage, share in shares.items() if share >= 0.005
        )
        workers = telemetry["workers"]
        where = f"{workers} workers" if workers else "the training process (no workers)"
        seconds = telemetry["worker_seconds"]
        lines.append(f"the Loader's pipeline, {seconds:.1f} s in {where}: {parts}")
    if telemetry["wait_fraction"] is not None:
        lines.append(
            f"the loop (no model step) waited for batches {telemetry['wait_fraction']:.0%} "
            "of its time"
        )
    if telemetry["advice"]:
        lines.append(f"advice: {telemetry['advice']}")
    return lines


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
    if result.get("telemetry"):
        lines += diagnosis_lines(result["telemetry"])
    return "\n".join(lines)
