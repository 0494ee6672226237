"""Benchmark: what one node fetches from a store before its first batches, and how long its
first batch takes, on a huge dataset (index version 3) served over HTTP with a store's latency.

    python scripts/bench_cloud_start.py [--shards 1000000] [--processes 1 4 16]
        [--first-batch 1000 1000000] [--repeat 3] [--code DIR] [--latency 0.02] [--out DIR]

The dataset: one real shard of 1000 samples (a 640x480 JPEG of about 60 KB and a short
conversation each, as ``bench_scale.py``'s synthetic samples; ``wdsvlm write``) and its
sidecar, symlinked under every shard name of an index of ``--shards`` shards (as
``bench_scale.py`` makes its synthetic datasets: only the index differs between sizes), served
by the project's range server (``wdsvlm.testing.stores.RangeServer``) on 127.0.0.1, each ranged
answer ``--latency`` seconds late.

Bytes per node: N processes of one node, N = Loader processes x (1 + DataLoader workers)
(1 = 1 x (1 + 0), 4 = 2 x (1 + 1), 16 = 4 x (1 + 3)), ranks 0.. of 1024, started at once,
one node folder (``local_dir``, empty at the start); each Loader takes one batch from each of
its workers (so every process has opened the table). Reported: the bytes the server sent for
``index.json`` and the shard table, against one copy of them, and for the rest (sidecars,
samples). ``--code DIR``: run the Loader processes on another checkout of wdsvlm (one without
``local_dir``: each process reads the table itself), to compare.

First batch: one Loader (2 workers, node folder empty) on datasets of 1000 x each
``--first-batch`` shards: seconds from ``Loader(...)`` to its first batch, the median of
``--repeat`` runs of each size taken in turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("WDSVLM_CODE", REPO))

TOKENIZER = os.path.join(REPO, "shards_example", "tokenizer")
PER_SHARD = 1000
WORLD = 1024
SHAPES = {1: (1, 0), 4: (2, 1), 16: (4, 3)}
"""Processes of the node: (Loader processes, DataLoader workers each)."""


def make(folder: str, shards: int) -> str:
    """The dataset of ``shards`` alike shards under ``folder`` (kept between runs)."""
    from wdsvlm import load_index, write_dataset
    from wdsvlm.format.builder import publish_root
    from wdsvlm.format.sidecar import sidecar_name

    out = os.path.join(folder, f"s{shards}")
    if os.path.exists(os.path.join(out, "index.json")):
        return out
    one = os.path.join(folder, "one")
    if not os.path.exists(os.path.join(one, "index.json")):
        records = os.path.join(folder, "records.jsonl")
        photo(os.path.join(folder, "photo.jpg"))
        with open(records, "w") as f:
            for i in range(PER_SHARD):
                turns = [
                    {"from": "human", "value": f"<image>\nQuestion {i}: what comes after {i}?"},
                    {"from": "gpt", "value": f"{i + 1} comes after {i}. " * (1 + i % 5)},
                ]
                record = {"id": f"r{i}", "image": "photo.jpg", "conversations": turns}
                f.write(json.dumps(record) + "\n")
        write_dataset(records, one, image_root=folder, samples_per_shard=PER_SHARD, progress=False)
    index = load_index(one)
    shard = {k: v for k, v in index["shards"][0].items() if k != "entries"}
    tar, idx = os.path.join(one, shard["name"]), os.path.join(one, shard["sidecar"]["name"])
    os.makedirs(out, exist_ok=True)

    def rows():
        for s in range(shards):
            name = f"data-{s:07d}.tar"
            for source, target in ((tar, name), (idx, sidecar_name(name))):
                path = os.path.join(out, target)
                if not os.path.lexists(path):
                    os.symlink(source, path)
            yield {
                **shard,
                "name": name,
                "sidecar": {**shard["sidecar"], "name": sidecar_name(name)},
            }

    totals = {"shards": shards, "samples": shards * PER_SHARD}
    root = {"format": "wdsvlm", "prefix": "data", "shards": rows(), "totals": totals}
    publish_root(out, root, version=3)
    return out


def photo(path: str) -> None:
    """A 640x480 JPEG of about 60 KB (a smooth picture with some noise)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:480, 0:640]
    pixels = np.stack([x * 255 // 640, y * 255 // 480, (x + y) % 256], axis=-1)
    pixels = pixels + rng.integers(0, 24, pixels.shape)
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=85)


def loader_process(url: str, node: str, rank: int, workers: int) -> dict:
    """One Loader of the node (rank ``rank`` of 1024): seconds to its first batch, and to one
    batch from each of its workers."""
    import logging

    import wdsvlm

    logging.disable(logging.WARNING)
    options = (
        {"local_dir": node} if "local_dir" in wdsvlm.LoaderSettings.__dataclass_fields__ else {}
    )
    start = time.perf_counter()
    loader = wdsvlm.Loader(
        url,
        TOKENIZER,
        rank=rank,
        world_size=WORLD,
        num_workers=workers,
        max_length=1024,
        batch_size=4,
        **options,
    )
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - start
    for _ in range(workers - 1):
        next(batches)
    return {"first_s": first, "all_s": time.perf_counter() - start}


def node_run(folder: str, loaders: int, workers: int, latency: float, code: str) -> dict:
    """``loaders`` Loader processes of ``workers`` workers each, started at once on one node
    folder: what the server sent, by kind, and the slowest first batch."""
    from wdsvlm.testing.stores import range_server

    env = {**os.environ, "WDSVLM_CODE": code, "PYTHONPATH": code, "HF_HUB_OFFLINE": "1"}
    table = json.load(open(os.path.join(folder, "index.json")))["table"]["name"]
    with tempfile.TemporaryDirectory(prefix="wdsvlm-node-") as node:
        with range_server(folder, delay=latency) as server:
            args = [sys.executable, __file__, "--loader", server.url, node]
            procs = [
                subprocess.Popen(
                    [*args, str(r), str(workers)],
                    env=env,
                    cwd=code,  # a fork server's interpreter looks in its folder first
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for r in range(loaders)
            ]
            done = [p.communicate(timeout=1800) for p in procs]
            for p, (_, err) in zip(procs, done, strict=True):
                if p.returncode:
                    raise RuntimeError(f"a Loader process failed:\n{err[-3000:]}")
            outs = [out for out, _ in done]
            served = dict(server.served_by_name)
    runs = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    root = served.pop("index.json", 0) + served.pop(table, 0)
    return {"root": root, "rest": sum(served.values()), "first_s": max(r["first_s"] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=10**6)
    parser.add_argument("--processes", type=int, nargs="*", default=[1, 4, 16], choices=SHAPES)
    parser.add_argument("--first-batch", type=int, nargs="*", default=[1000, 10**6])
    parser.add_argument("--code", default=REPO, help="the wdsvlm checkout the Loaders run")
    parser.add_argument("--latency", type=float, default=0.02)
    parser.add_argument("--repeat", type=int, default=3, help="first-batch runs of each size")
    parser.add_argument("--out", default="/tmp/wdsvlm-cloud")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    folder = make(args.out, args.shards)
    one = sum(
        os.path.getsize(os.path.join(folder, n))
        for n in os.listdir(folder)
        if n == "index.json" or n.endswith(".shards")
    )
    print(
        f"{args.shards:,} shards ({args.shards * PER_SHARD:,} samples), index.json and table "
        f"{one / 1e6:.1f} MB; {args.latency * 1000:.0f} ms a ranged request; code {args.code}"
    )
    for n in args.processes:
        loaders, workers = SHAPES[n]
        run = node_run(folder, loaders, workers, args.latency, args.code)
        print(
            f"{n:>3} processes ({loaders} Loader x (1 + {workers} workers)): index and table "
            f"{run['root'] / 1e6:8.1f} MB = {run['root'] / one:5.2f}x one copy; other "
            f"{run['rest'] / 1e6:6.1f} MB; slowest first batch {run['first_s']:.1f} s",
            flush=True,
        )
    times: dict[int, list[float]] = {shards: [] for shards in args.first_batch}
    for _ in range(args.repeat):  # the sizes in turn: a busy machine slows both alike
        for shards in args.first_batch:
            run = node_run(make(args.out, shards), 1, 2, args.latency, args.code)
            times[shards].append(run["first_s"])
    for shards, seconds in times.items():
        print(
            f"first batch, 1 Loader x 2 workers, {shards * PER_SHARD:>13,} samples "
            f"({shards:,} shards): median {statistics.median(seconds):.1f} s of "
            f"{', '.join(f'{t:.1f}' for t in seconds)}",
            flush=True,
        )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--loader"]:
        url, node, rank, workers = sys.argv[2:6]
        print(json.dumps(loader_process(url, node, int(rank), int(workers))))
    else:
        main()
