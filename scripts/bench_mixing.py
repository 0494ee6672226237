"""Benchmark: how well mixed a worker's samples come out of the default shuffle buffer.

    python scripts/bench_mixing.py [--out /tmp/wdsvlm-mixing] [--workers 8] [--window 64]
        [--bench-data /tmp/wdsvlm-bench/n600] [--latency 0.03] [--only mixing|reading]

For each dataset (synthetic version-2 indexes, no image data: only the order is computed), the
samples of global workers 0 and 1 of ``--workers`` in pass 0 are put through the Loader's own
``Plan`` and ``Shuffle`` (three settings, below), as metadata: each
sample carries its index entry's size, so the buffer's byte bound applies as it would to the
real bytes. Two measures of each worker's order, against a uniform shuffle of the same samples:

- **neighbours**: the share of consecutive samples that come from the same shard;
- **window pairs**: of all pairs of samples within one window of ``--window`` consecutive
  samples (about a batch's worth), the share from the same shard. Unlike the first it does not
  improve when only neighbours are kept apart: it measures how many shards feed a batch.

and the ranged reads a worker makes per 1000 samples (the plan's spans).

Side by side in one run: chunks of 8 MiB (``span_bytes`` before 2026-12-01) and a buffer of
1000 samples; chunks of 1 MiB and the same buffer (before 2026-12-03); and the defaults now
(chunks of 1 MiB and at most ``span_samples``, the buffer sized by the data's mean sample). The
datasets: shards of about 256 MB, as ``wdsvlm write`` cuts them, of COCO-sized photos (170 KB,
as in ``bench_pipeline.py``'s coco mix), of large photos (1.2 MB, its web mix) and of small
images (60 KB); the 60 MB shards of ``bench_scale.py``; text-only samples (2 KB, 5,000 a shard;
and 1 KB, 100 a shard); and text with images (20 KB on average, 100 a shard).

Then what smaller chunks cost in reading: ``ReadSamples`` alone over the coco mix of
``bench_pipeline.py`` (600 samples, made once under ``--bench-data``), served over HTTP on
127.0.0.1 by ``wdsvlm.testing.stores.RangeServer`` with each ranged answer ``--latency``
seconds late (an object store's time to first byte): MB/s and requests with chunks of 8 MiB
and with the default chunks, read one and ``read_ahead`` at a time.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_scale  # noqa: E402

# (name, samples a shard, bytes a sample, shards)
DATASETS = [
    ("COCO-sized photos (170 KB)", 1500, 170_000, 500),
    ("large photos (1.2 MB)", 210, 1_200_000, 500),
    ("small images (60 KB)", 4300, 60_000, 250),
    ("bench_scale.py (60 KB, 60 MB)", 1000, 60_000, 1000),
    ("text only (2 KB, 10 MB)", 5000, 2_000, 200),
    ("text only (1 KB, 100 a shard)", 100, 1_000, 1000),
    ("text and images (20 KB, 100)", 100, 20_000, 1000),
]
OLD_SPAN = 8 * 2**20
# (label, span_bytes, span_samples, shuffle_buffer): None for the defaults now
SETTINGS = [
    ("8 MiB", OLD_SPAN, None, 1000),
    ("1 MiB", None, None, 1000),
    ("now", None, "default", None),
]


class Payload:
    """Stands for a sample's bytes: the shuffle buffer counts ``nbytes``."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes


def shuffled_shards(folder: str, worker: int, workers: int, setting: tuple) -> tuple:
    """The shards of global worker ``worker``'s samples of pass 0, in the order they leave
    the Loader's shuffle buffer with ``setting`` (see ``SETTINGS``), else its defaults; the
    ranged reads they took; and the buffer's size."""
    from wdsvlm.loader.build import shuffle_buffer
    from wdsvlm.loader.settings import LoaderSettings
    from wdsvlm.pipeline.plan import Plan, WorkerConfig
    from wdsvlm.pipeline.shuffle import Shuffle

    _, span_bytes, span_samples, buffer = setting
    defaults = LoaderSettings()
    plan = Plan(
        folder,
        seed=defaults.seed,
        worker_config=WorkerConfig(0, 1, workers),
        span_bytes=span_bytes or defaults.span_bytes,
        span_samples=defaults.span_samples if span_samples == "default" else span_samples,
    )
    buffer = buffer or shuffle_buffer(plan, defaults)

    reads = 0

    def samples():
        nonlocal reads
        for span in plan.spans(0, worker):
            reads += 1
            for entry, place in zip(span["entries"], span["positions"], strict=True):
                yield {
                    "__shard__": span["shard"],
                    "__pass__": 0,
                    "__pos__": place,
                    "__worker__": worker,
                    "payload": Payload(entry["size"]),
                }

    shuffle = Shuffle(buffer, defaults.shuffle_bytes, defaults.seed)
    return [s["__shard__"] for s in shuffle(samples())], reads, buffer


def neighbours(order: list) -> float:
    """Share of consecutive samples from the same shard."""
    return sum(a == b for a, b in zip(order, order[1:], strict=False)) / max(1, len(order) - 1)


def window_pairs(order: list, window: int) -> float:
    """Share of same-shard pairs among the pairs within each window of ``window`` samples."""
    same = pairs = 0
    for start in range(0, len(order) - window + 1, window):
        counts = Counter(order[start : start + window])
        same += sum(n * (n - 1) // 2 for n in counts.values())
        pairs += window * (window - 1) // 2
    return same / max(1, pairs)


def measure(folder: str, workers: int, window: int, setting: tuple) -> list:
    """The buffer's size, ranged reads per 1000 samples, and both measures for the shuffle
    buffer's order and for a uniform shuffle of the same samples; averaged over global
    workers 0 and 1."""
    rows = []
    for worker in (0, 1):
        order, reads, buffer = shuffled_shards(folder, worker, workers, setting)
        uniform = list(order)
        random.Random(worker).shuffle(uniform)
        measures = [f(o) for o in (order, uniform) for f in (neighbours, pairs(window))]
        rows.append([buffer, 1000 * reads / len(order), *measures])
    return [sum(column) / len(rows) for column in zip(*rows, strict=True)]


def pairs(window: int):
    return lambda order: window_pairs(order, window)


def read_rate(url: str, span_bytes: int, read_ahead: int) -> tuple[float, int]:
    """MB/s of reading a whole pass of the dataset at ``url`` with ``ReadSamples``, and the
    spans (ranged reads) it took."""
    from wdsvlm.pipeline.plan import Plan, WorkerConfig
    from wdsvlm.pipeline.read import ReadSamples
    from wdsvlm.storage.fs import ReadPolicy

    start = time.perf_counter()
    plan = Plan(url, worker_config=WorkerConfig(0, 1, 0), span_bytes=span_bytes)
    spans = list(plan)
    read = ReadSamples(policy=ReadPolicy(timeout=60), read_ahead=read_ahead)
    size = sum(len(s["json"]) + len(s.get("0.jpg", b"")) for s in read(iter(spans)))
    return size / 1e6 / (time.perf_counter() - start), len(spans)


def reading(bench_data: str, latency: float, span_bytes: int, read_ahead: int) -> None:
    """The reading part: see the module's docstring."""
    import bench_pipeline

    from wdsvlm.testing.stores import range_server

    folder = bench_pipeline.make_mix("coco", 600, bench_data)
    print(
        f"\nReading the coco mix ({bench_data}, 600 samples) over HTTP on 127.0.0.1, "
        f"{latency * 1000:.0f} ms to each ranged answer:"
    )
    for chunk, ahead in (
        (OLD_SPAN, 1),
        (OLD_SPAN, read_ahead),
        (span_bytes, 1),
        (span_bytes, read_ahead),
    ):
        with range_server(folder, latency) as server:
            rate, spans = read_rate(server.url, chunk, ahead)
        print(
            f"  chunks of {chunk >> 10:>5} KiB, {ahead} read(s) at once: {rate:6.1f} MB/s, "
            f"{spans} spans, {server.requests} ranged requests (the index's and sidecars' too)"
        )


def mixing(out: str, workers: int, window: int) -> None:
    """The mixing part: see the module's docstring."""
    print(
        f"Global workers 0 and 1 of {workers}, pass 0. Share of samples from the same shard: "
        f"of neighbours, and of pairs in windows of {window}:"
    )
    print(
        f"{'dataset':<30} {'settings':>8} {'buffer':>7} {'reads/1000':>11} {'neighbours':>11} "
        f"{'window pairs':>13} {'uniform: neighbours':>20} {'window pairs':>13}"
    )
    for name, per_shard, sample_bytes, shards in DATASETS:
        folder = bench_scale.make(out, per_shard * shards, per_shard, sample_bytes)
        for setting in SETTINGS:
            found = measure(folder, workers, window, setting)
            widths = (11, 13, 20, 13)
            cells = f"{found[0]:>7.0f} {found[1]:>11.0f} " + " ".join(
                f"{v:>{w}.4f}" for v, w in zip(found[2:], widths, strict=True)
            )
            print(f"{name:<30} {setting[0]:>8} {cells}", flush=True)
            name = ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/wdsvlm-mixing")
    parser.add_argument("--workers", type=int, default=8, help="global workers")
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--bench-data", default="/tmp/wdsvlm-bench/n600")
    parser.add_argument("--latency", type=float, default=0.03, help="seconds")
    parser.add_argument("--only", choices=["mixing", "reading"])
    args = parser.parse_args()
    from wdsvlm.loader.settings import LoaderSettings

    defaults = LoaderSettings()
    if args.only != "reading":
        mixing(args.out, args.workers, args.window)
    if args.only != "mixing":
        reading(args.bench_data, args.latency, defaults.span_bytes, defaults.read_ahead)


if __name__ == "__main__":
    main()
