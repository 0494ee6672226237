"""Benchmark: start-up time and memory of a Loader on a huge dataset (index version 2).

    python scripts/bench_scale.py [--samples 1000000 10000000 100000000] [--out /tmp/wdsvlm-scale]

For each size, a synthetic version-2 dataset of 1000-sample shards (60 MB each) is made
without any image data or tar: the root index.json, and one sidecar symlinked under every
shard's sidecar name (the shards are alike; only the index matters here). Then, each in a fresh
process:

- the training process of rank 7 of 64 with 8 workers: ``wdsvlm.Loader(...)`` made (the root
  index parsed, ``len(loader)`` estimated from 64 shards' sidecars; the 32 samples that measure
  characters per token cannot be read here and are skipped, so the estimate falls back to 3.5
  characters a token), seconds and peak memory (max RSS);
- each of its 8 DataLoader workers: the pickled dataset the worker gets, unpickled, and its
  first span of pass 0 computed (the pass's global order, the worker's block, its first
  chunk's sidecar read): seconds and peak memory of the slowest and largest.

Also the shuffle quality of a worker's stream: the share of consecutive samples from the same
shard, in the plan's order and after the default shuffle buffer (1000 samples), against the
plan before index version 2 (shards in a seeded order, then each worker's block read span by
span) on the same 1M-sample dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PER_SHARD = 1000
SAMPLE_BYTES = 60_000
RANK, WORLD, WORKERS = 7, 64, 8


def make(
    folder: str, samples: int, per_shard: int = PER_SHARD, sample_bytes: int = SAMPLE_BYTES
) -> str:
    """The synthetic dataset of ``samples`` samples under ``folder`` (kept between runs),
    ``per_shard`` samples of ``sample_bytes`` bytes a shard."""
    from wdsvlm.format.index import dumps_index, shard_summary, sidecar_entry
    from wdsvlm.format.sidecar import pack_entries, sidecar_name

    name = f"n{samples}"
    if (per_shard, sample_bytes) != (PER_SHARD, SAMPLE_BYTES):
        name += f"-{per_shard}x{sample_bytes}"
    out = os.path.join(folder, name)
    if os.path.exists(os.path.join(out, "index.json")):
        return out
    shutil.rmtree(out, ignore_errors=True)  # a run cut short
    os.makedirs(out)
    entries = [
        {
            "key": f"{i:09d}",
            "offset": i * sample_bytes,
            "size": sample_bytes,
            "images": [[640 + i % 7 * 100, 480]],
            "chars": [120, 300],
        }
        for i in range(per_shard)
    ]
    data = pack_entries(entries)
    first = os.path.join(out, "sidecar.idx")
    with open(first, "wb") as f:
        f.write(data)
    summary = shard_summary(entries)
    shards = []
    for s in range(samples // per_shard):
        name = f"data-{s:06d}.tar"
        os.symlink("sidecar.idx", os.path.join(out, sidecar_name(name)))
        shards.append(
            {
                "name": name,
                "samples": per_shard,
                "bytes": per_shard * sample_bytes,
                "sha256": "0" * 64,
                "sidecar": sidecar_entry(sidecar_name(name), data),
                **summary,
            }
        )
    index = {
        "format": "wdsvlm",
        "version": 2,
        "prefix": "data",
        "shards": shards,
        "totals": {"shards": len(shards), "samples": samples},
    }
    with open(os.path.join(out, "index.json"), "wb") as f:
        f.write(dumps_index(index))
    return out


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def training_process(folder: str, dump: str) -> dict:
    import logging

    logging.disable(logging.WARNING)  # the 32 unreadable samples of the estimate
    import wdsvlm

    start = time.perf_counter()
    loader = wdsvlm.Loader(
        folder,
        os.path.join(REPO, "shards_example", "tokenizer"),
        rank=RANK,
        world_size=WORLD,
        num_workers=WORKERS,
        max_length=4096,
        batch_size=8,
        on_shard_error="skip",
    )
    seconds = time.perf_counter() - start
    with open(dump, "wb") as f:
        pickle.dump(loader.stream, f)
    return {"seconds": seconds, "peak_mb": peak_mb(), "batches": len(loader)}


def worker_process(dump: str, slot: int) -> dict:
    start = time.perf_counter()
    with open(dump, "rb") as f:
        stream = pickle.load(f)
    plan = stream.plan
    worker = plan.worker_config.global_worker(slot)
    span = next(plan.spans(0, worker))
    return {
        "seconds": time.perf_counter() - start,
        "peak_mb": peak_mb(),
        "span": f"{span['shard']} {len(span['entries'])} samples",
    }


def in_fresh_process(*args: str) -> dict:
    run = subprocess.run(
        [sys.executable, __file__, *args], capture_output=True, text=True, timeout=1800
    )
    if run.returncode:
        raise RuntimeError(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def same_shard_share(folder: str) -> dict:
    """Share of consecutive samples from the same shard in global worker 0's stream (of 8),
    in the plan's order and after a 1000-sample shuffle buffer; now and before version 2."""
    import random

    from wdsvlm.pipeline.plan import Plan, WorkerConfig, worker_share

    plan = Plan(folder, worker_config=WorkerConfig(0, 1, 8))
    now = [sp["shard"] for sp in plan.spans(0, 0) for _ in sp["entries"]]
    # before: shards in a seeded order, each shard's samples shuffled, blocks per worker,
    # read run by run of ~8 MB spans in a seeded order (the first release's plan)
    rng = random.Random("before")
    shards = list(range(len(plan.index["shards"])))
    rng.shuffle(shards)
    order = [s for s in shards for _ in range(PER_SHARD)]
    start, stop = worker_share(len(order), 0, 8)
    before = order[start:stop]

    def after_buffer(stream, size=1000):
        rng, buffer, out = random.Random(0), [], []
        for x in stream:
            buffer.append(x)
            if len(buffer) >= size:
                out.append(buffer.pop(rng.randrange(len(buffer))))
        rng.shuffle(buffer)
        return out + buffer

    def share(stream):
        return sum(a == b for a, b in zip(stream, stream[1:], strict=False)) / max(
            1, len(stream) - 1
        )

    uniform = 1 / len(plan.index["shards"])
    return {
        "now": share(now),
        "now_buffered": share(after_buffer(now)),
        "before": share(before),
        "before_buffered": share(after_buffer(before)),
        "uniform": uniform,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[10**6, 10**7, 10**8])
    parser.add_argument("--out", default="/tmp/wdsvlm-scale")
    args = parser.parse_args()
    print(f"rank {RANK} of {WORLD}, {WORKERS} workers; shards of {PER_SHARD} samples")
    print(
        f"{'samples':>11} {'index.json':>11} {'Loader()':>9} {'peak':>8} "
        f"{'worker 1st span (slowest)':>26} {'peak (largest)':>15}"
    )
    for n in args.samples:
        folder = make(args.out, n)
        size = os.path.getsize(os.path.join(folder, "index.json")) / 1e6
        dump = os.path.join(folder, "stream.pkl")
        main_run = in_fresh_process("--train", folder, dump)
        workers = [in_fresh_process("--worker", dump, str(w)) for w in range(WORKERS)]
        slowest = max(w["seconds"] for w in workers)
        largest = max(w["peak_mb"] for w in workers)
        print(
            f"{n:>11,} {size:>9.1f}MB {main_run['seconds']:>8.2f}s "
            f"{main_run['peak_mb']:>6.0f}MB {slowest:>25.2f}s {largest:>13.0f}MB"
        )
    quality = same_shard_share(make(args.out, 10**6))
    print(
        "\nconsecutive samples of one worker from the same shard (1M samples, worker 0 of 8; "
        f"a uniform shuffle: {quality['uniform']:.4f}):"
    )
    print(
        f"  plan order: now {quality['now']:.3f}, before {quality['before']:.3f}; after a "
        f"1000-sample shuffle buffer: now {quality['now_buffered']:.4f}, before "
        f"{quality['before_buffered']:.4f}"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:
        print(json.dumps(training_process(sys.argv[2], sys.argv[3])))
    elif sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker_process(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
