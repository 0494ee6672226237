"""Benchmark: how often a worker's ranged reads can be coalesced, on realistic passes.

    python scripts/bench_coalesce.py [--out /tmp/wdsvlm-coalesce] [--workers 8]
        [--read-ahead 4] [--block-bytes 4194304]

Synthetic version-2 indexes (``bench_scale.make``: no tar data, only the order is computed),
each pass's spans put through the read stage's own grouping (``pipeline.coalesce.grouped``)
with the default read policy's block and the default read-ahead as the window. For each
dataset and pass: the spans of global workers 0 and 1 of ``--workers``, the requests they take
read one by one (a span: one request per ``block_bytes``) and coalesced, the bytes fetched
coalesced against the bytes the spans need, and, as a bound, the requests if any two spans of
a shard within one window of ``--read-ahead`` consecutive spans were joined, in any order.

Passes: training (pass 0, the plan's keyed random order of chunks, default ``span_bytes`` and
``span_samples``), an evaluation loader (every sample once, in index order), a mixture of
small-chunk text samples and photos, and sparse reads of a share (every fourth place of a
worker's block, as a resumed or handed-over share may read).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_scale  # noqa: E402

# (name, samples a shard, bytes a sample, shards)
DATASETS = {
    "small shards (16 x 64 KB)": (16, 64_000, 2000),
    "COCO-sized (1500 x 170 KB)": (1500, 170_000, 100),
    "text only (5000 x 2 KB)": (5000, 2_000, 20),
}


def requests(span: dict, block: int) -> int:
    return max(1, -(-(span["stop"] - span["start"]) // block))


def measure(spans: list[dict], block: int, window: int) -> dict:
    from wdsvlm.pipeline.coalesce import bounds, grouped, joinable, needed

    alone = sum(requests(s, block) for s in spans)
    need = sum(s["stop"] - s["start"] for s in spans)
    joined = fetched = 0
    for group in grouped(iter(spans), block, window):
        lo, hi = bounds(group)
        joined += requests(group[0], block) if len(group) == 1 else 1
        fetched += hi - lo
    # the bound: within each window of consecutive spans, any spans of one shard joined
    bound = 0
    for at in range(0, len(spans), window):
        part = spans[at : at + window]
        taken = [False] * len(part)
        for i, span in enumerate(part):
            if taken[i]:
                continue
            group = [span]
            for j in range(i + 1, len(part)):
                if not taken[j] and joinable(span, part[j]):
                    lo, hi = bounds([*group, part[j]])
                    ranges = [(s["start"], s["stop"]) for s in [*group, part[j]]]
                    if hi - lo <= block and hi - lo <= 1.25 * needed(ranges):
                        group.append(part[j])
                        taken[j] = True
            bound += requests(span, block) if len(group) == 1 else 1
    return {
        "spans": len(spans),
        "requests": alone,
        "coalesced": joined,
        "bound": bound,
        "bytes": fetched / max(1, need),
    }


def passes(folders: dict, workers: int) -> dict:
    """Name -> the spans of global workers 0 and 1 of each pass."""
    from wdsvlm import Source
    from wdsvlm.pipeline.plan import Plan, WorkerConfig

    config = WorkerConfig(0, 1, workers)
    out = {}
    for name, folder in folders.items():
        train = Plan(folder, worker_config=config)
        out[f"training, {name}"] = [list(train.spans(0, w)) for w in (0, 1)]
        evaluation = Plan(folder, worker_config=config, evaluation=True)
        out[f"evaluation, {name}"] = [list(evaluation.spans(0, w)) for w in (0, 1)]
        sparse = []
        for w in (0, 1):
            start, stop = train.share(w)
            ranges = [[p, p + 1] for p in range(start, stop, 4)]
            sparse.append(list(train.read_spans(0, ranges, w)))
        out[f"sparse (1 in 4), {name}"] = sparse
    text, coco = folders["text only (5000 x 2 KB)"], folders["COCO-sized (1500 x 170 KB)"]
    mixture = [Source(text, name="text", weight=1), Source(coco, name="coco", weight=1)]
    for evaluation in (False, True):
        plan = Plan(mixture, worker_config=config, evaluation=evaluation)
        label = "evaluation" if evaluation else "training"
        out[f"{label}, mixture text + COCO"] = [list(plan.spans(0, w)) for w in (0, 1)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="/tmp/wdsvlm-coalesce")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--read-ahead", type=int, default=4)
    parser.add_argument("--block-bytes", type=int, default=4 * 2**20)
    args = parser.parse_args()
    folders = {
        name: bench_scale.make(args.out, per * shards, per, size, version=2)
        for name, (per, size, shards) in DATASETS.items()
    }
    print("| pass | spans | requests | coalesced | ratio | bound | bytes fetched / needed |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, spans in passes(folders, args.workers).items():
        rows = [measure(s, args.block_bytes, args.read_ahead) for s in spans]
        total = {k: sum(r[k] for r in rows) for k in ("spans", "requests", "coalesced", "bound")}
        ratio = total["requests"] / max(1, total["coalesced"])
        print(
            f"| {name} | {total['spans']} | {total['requests']} | {total['coalesced']} | "
            f"{ratio:.2f}x | {total['bound']} | {max(r['bytes'] for r in rows):.3f} |"
        )


if __name__ == "__main__":
    main()
