"""Benchmark: start-up time and memory of a Loader on a huge dataset (index version 3).

    python scripts/bench_scale.py [--samples 1000000 ... 1000000000] [--version 3] [--out DIR]

For each size, a synthetic dataset of 1000-sample shards (60 MB each) is made without any
image data or tar: the root index (version 3: a small index.json and the shard table; 2: every
shard in index.json), and one sidecar symlinked under every shard's sidecar name (the shards
are alike; only the index matters here). Then, each in a fresh process:

- the training process of rank 7 of 1024 with 8 workers: ``wdsvlm.Loader(...)`` made (the root
  index read, ``len(loader)`` estimated from 64 shards' sidecars; the 32 samples that measure
  characters per token cannot be read here and are skipped, so the estimate falls back to 3.5
  characters a token): seconds, and memory beyond its imports (the peak resident set less the
  resident set once torch, transformers and wdsvlm are imported);
- each of its 8 DataLoader workers: the pickled dataset the worker gets, unpickled, and its
  first span of pass 0 (its block of the pass, its first chunk's sidecar read): seconds and
  memory beyond imports of the slowest and largest;
- the bytes of mapped files each holds resident (the shard table: in the page cache, shared by
  every process of a node, counted once however many map it).

Also the shuffle quality of a worker's stream: the share of consecutive samples from the same
shard, in the plan's order and after the default shuffle buffer (1000 samples), under plan
versions 3 and 2 on the same 1M-sample dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PER_SHARD = 1000
SAMPLE_BYTES = 60_000
RANK, WORLD, WORKERS = 7, 1024, 8


def make(
    folder: str,
    samples: int,
    per_shard: int = PER_SHARD,
    sample_bytes: int = SAMPLE_BYTES,
    version: int = 3,
) -> str:
    """The synthetic dataset of ``samples`` samples under ``folder`` (kept between runs),
    ``per_shard`` samples of ``sample_bytes`` bytes a shard, its root index of ``version``."""
    from wdsvlm.format.builder import publish_root
    from wdsvlm.format.index import shard_summary, sidecar_entry
    from wdsvlm.format.sidecar import pack_entries, sidecar_name

    name = f"n{samples}-v{version}"
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
    with open(os.path.join(out, "sidecar.idx"), "wb") as f:
        f.write(data)
    summary, sidecar = shard_summary(entries), sidecar_entry("", data)

    def shards():
        for s in range(samples // per_shard):
            name = f"data-{s:07d}.tar"
            os.symlink("sidecar.idx", os.path.join(out, sidecar_name(name)))
            yield {
                "name": name,
                "samples": per_shard,
                "bytes": per_shard * sample_bytes,
                "sha256": "0" * 64,
                "sidecar": {**sidecar, "name": sidecar_name(name)},
                **summary,
            }

    index = {
        "format": "wdsvlm",
        "prefix": "data",
        "shards": shards(),
        "totals": {"shards": samples // per_shard, "samples": samples},
    }
    publish_root(out, index, version=version)
    return out


def memory() -> dict:
    """This process's resident set now and at its peak (MB, /proc/self/status), and how much
    of the shard table it maps is resident (``table``: pages of the page cache, shared)."""
    fields = {"table": 0.0}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(value.split()[0]) / 1024
    with open("/proc/self/smaps") as f:
        table = False
        for line in f:
            if not line[:1].isupper():  # a mapping's first line: its address range and path
                table = line.rstrip().endswith(".shards")
            elif table and line.startswith("Rss:"):
                fields["table"] += int(line.split()[1]) / 1024
    return fields


def training_process(folder: str, dump: str) -> dict:
    import logging

    logging.disable(logging.WARNING)  # the 32 unreadable samples of the estimate
    import wdsvlm
    import wdsvlm.loader.build  # noqa: F401 - everything a Loader imports, before the baseline

    base = memory()["VmRSS"]
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
    now = memory()
    return {
        "seconds": seconds,
        "peak_mb": now["VmHWM"],
        "beyond_mb": now["VmHWM"] - base,
        "mapped_mb": now["table"],
        "batches": len(loader),
    }


def root_writing(shards: int) -> dict:
    """What ``wdsvlm write`` does with the root entries of ``shards`` shards once they are
    written: kept as they come (``SpilledShards``), then the root index published (the shard
    table, then index.json). Seconds and memory beyond imports."""
    import tempfile

    from wdsvlm.format.builder import SpilledShards, Totals, publish_root, root_index

    base = memory()["VmRSS"]
    start = time.perf_counter()
    spilled = SpilledShards()
    for s in range(shards):
        spilled.append(
            {
                "name": f"data-{s:07d}.tar",
                "samples": PER_SHARD,
                "bytes": PER_SHARD * SAMPLE_BYTES,
                "sha256": f"{s:064x}",
                "sidecar": {"name": f"data-{s:07d}.idx", "bytes": 40_000, "sha256": "1" * 64},
                "sums": {"images": 1000, "text_only": 0, "turns": 2000, "chars": 420_000},
                "keys": [f"{s * PER_SHARD:09d}", f"{s * PER_SHARD + PER_SHARD - 1:09d}"],
            }
        )
    kept = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as out:
        publish_root(out, root_index(spilled, Totals(), {}, prefix="data"))
        name = json.load(open(os.path.join(out, "index.json")))["table"]["name"]
        size = os.path.getsize(os.path.join(out, name))
    return {
        "seconds": time.perf_counter() - start,
        "kept_seconds": kept,
        "beyond_mb": memory()["VmHWM"] - base,
        "table_mb": size / 1e6,
    }


def worker_process(dump: str, slot: int) -> dict:
    import wdsvlm.loader.build  # noqa: F401 - a worker's imports, before the baseline

    base = memory()["VmRSS"]
    start = time.perf_counter()
    with open(dump, "rb") as f:
        stream = pickle.load(f)
    plan = stream.plan
    worker = plan.worker_config.global_worker(slot)
    span = next(plan.spans(0, worker))
    now = memory()
    return {
        "seconds": time.perf_counter() - start,
        "peak_mb": now["VmHWM"],
        "beyond_mb": now["VmHWM"] - base,
        "mapped_mb": now["table"],
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
    in the plan's order and after a 1000-sample shuffle buffer, under plan versions 3 and 2."""
    import random

    from wdsvlm.pipeline.plan import Plan, WorkerConfig

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

    out = {}
    for version in (3, 2):
        plan = Plan(folder, worker_config=WorkerConfig(0, 1, 8), version=version)
        order = [sp["shard"] for sp in plan.spans(0, 0) for _ in sp["entries"]]
        out[version] = (share(order), share(after_buffer(order)))
    out["uniform"] = 1 / len(plan.index["shards"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[10**6, 10**7, 10**8, 10**9])
    parser.add_argument("--version", type=int, choices=(2, 3), default=3, help="index version")
    parser.add_argument("--no-root", action="store_true", help="leave out the root's writing")
    parser.add_argument("--out", default="/tmp/wdsvlm-scale")
    args = parser.parse_args()
    print(f"rank {RANK} of {WORLD}, {WORKERS} workers; shards of {PER_SHARD} samples")
    print(
        f"{'samples':>13} {'index':>9} {'Loader()':>9} {'peak':>7} {'beyond':>7} {'table':>7} "
        f"{'worker 1st span':>16} {'peak':>7} {'beyond':>7} {'table':>7}"
    )
    for n in args.samples:
        folder = make(args.out, n, version=args.version)
        size = sum(
            os.path.getsize(os.path.join(folder, f))
            for f in os.listdir(folder)
            if f == "index.json" or f.endswith(".shards")
        )
        dump = os.path.join(folder, "stream.pkl")
        main_run = in_fresh_process("--train", folder, dump)
        workers = [in_fresh_process("--worker", dump, str(w)) for w in range(WORKERS)]
        print(
            f"{n:>13,} {size / 1e6:>7.1f}MB {main_run['seconds']:>8.2f}s "
            f"{main_run['peak_mb']:>5.0f}MB {main_run['beyond_mb']:>5.0f}MB "
            f"{main_run['mapped_mb']:>5.0f}MB {max(w['seconds'] for w in workers):>15.2f}s "
            f"{max(w['peak_mb'] for w in workers):>5.0f}MB "
            f"{max(w['beyond_mb'] for w in workers):>5.0f}MB "
            f"{max(w['mapped_mb'] for w in workers):>5.0f}MB",
            flush=True,
        )
    for n in [] if args.no_root else args.samples:
        run = in_fresh_process("--root", str(n // PER_SHARD))
        print(
            f"root index of {n // PER_SHARD:,} shards written in {run['seconds']:.1f} s "
            f"({run['kept_seconds']:.1f} s of it keeping the entries as shards finish), "
            f"{run['beyond_mb']:.0f} MB beyond imports; table {run['table_mb']:.1f} MB",
            flush=True,
        )
    quality = same_shard_share(make(args.out, 10**6, version=args.version))
    print(
        "\nconsecutive samples of one worker from the same shard (1M samples, worker 0 of 8; "
        f"a uniform shuffle: {quality['uniform']:.4f}):"
    )
    for version in (3, 2):
        order, buffered = quality[version]
        print(
            f"  plan version {version}: {order:.3f} in the plan's order, {buffered:.4f} after a "
            "1000-sample shuffle buffer"
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:
        print(json.dumps(training_process(sys.argv[2], sys.argv[3])))
    elif sys.argv[1:2] == ["--root"]:
        print(json.dumps(root_writing(int(sys.argv[2]))))
    elif sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker_process(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
