"""Benchmark: the Loader's workers on Ray beside local DataLoader workers and beside Ray Data's
own way of feeding a trainer, on the same shards and settings, in one run.

    python scripts/bench_ray.py [--data shards_example] [--repeat 8] [--workers 2]

1. **wdsvlm, local**: ``Loader(..., num_workers=W)``, DataLoader worker processes.
2. **wdsvlm, Ray**: ``Loader(..., num_workers=W, workers=RayWorkers())`` on a local Ray of W
   CPUs (the same CPUs for the workers).
3. **Ray Data**: ``ray.data.read_webdataset`` -> ``map_batches`` running the same decode and
   tokenization (wdsvlm's own ``DecodeImages`` and ``Tokenize`` stages, samples over
   ``max_length`` dropped) -> ``streaming_split(world_size, equal=True)`` ->
   ``iter_torch_batches`` with a pad-to-longest collate, on the same local Ray.

For each: samples/s over one pass (``--repeat`` copies of the dataset), the steady rate after
the first batch, the time to the first batch, padding, and the CPU milliseconds per sample
spent on the trainer's node (the trainer process's own clock; with local workers, plus the
DataLoader worker processes it started) and elsewhere (the Ray actors; for Ray Data, every
``ray::`` process seen while it ran, sampled, so approximate). The ratio line compares CPU per
batch on the trainer's node, the batches being the same. Then, on 2 ranks: the steps each
rank gets (Ray Data: the two split iterators consumed at once, as two trainers would),
whether two runs give the same order, and whether a mid-epoch resume is possible (wdsvlm: a
state after 3 batches loaded into a new Loader, the next batches compared).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import threading
import time

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has spent; 0 once it is gone."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICKS


def process_table() -> dict[int, tuple[int, bytes]]:
    """Every live process: its pid, and its parent's pid and command line."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            parent = int(open(f"/proc/{name}/stat").read().rsplit(")", 1)[1].split()[1])
            cmdline = open(f"/proc/{name}/cmdline", "rb").read()
        except OSError:
            continue
        table[int(name)] = (parent, cmdline)
    return table


def titled(prefix: bytes):
    """A ``find`` for ``WorkerClock``: the processes whose command line starts with
    ``prefix`` (Ray names its actors' and tasks' processes ``ray::...``)."""
    return lambda: [pid for pid, (_, cmd) in process_table().items() if cmd.startswith(prefix)]


def descendants(root: int):
    """A ``find`` for ``WorkerClock``: every process below ``root`` (DataLoader workers,
    under a fork server or not)."""

    def find() -> list[int]:
        tree: dict[int, list[int]] = {}
        for pid, (parent, _) in process_table().items():
            tree.setdefault(parent, []).append(pid)
        out, todo = [], [root]
        while todo:
            for child in tree.get(todo.pop(), []):
                out.append(child)
                todo.append(child)
        return out

    return find


class WorkerClock:
    """CPU seconds spent by the worker processes ``find()`` names, sampled while they live
    (the most seen for each), less what they had spent when the clock started."""

    def __init__(self, find):
        self.find = find
        self.start = {pid: cpu_of(pid) for pid in find()}
        self.seen: dict[int, float] = {}
        self.own = 0.0  # this process's CPU seconds spent sampling: not the trainer's work

    def sample(self) -> None:
        before = time.process_time()
        for pid in self.find():
            self.seen[pid] = max(self.seen.get(pid, 0.0), cpu_of(pid))
        self.own += time.process_time() - before

    def seconds(self) -> float:
        return sum(cpu - self.start.get(pid, 0.0) for pid, cpu in self.seen.items())


def consume(batches, clock: WorkerClock | None = None) -> dict:
    """Take every batch: samples, batches, padding, timings, the trainer's CPU seconds."""
    cpu, started = time.process_time(), time.perf_counter()
    first = None
    samples = tokens = cells = count = 0
    keys = []
    for batch in batches:
        if first is None:
            first = time.perf_counter() - started
        count += 1
        samples += sum(len(row) for row in batch["sample_keys"])
        keys += [k for row in batch["sample_keys"] for k in row]
        tokens += int(batch["attention_mask"].sum())
        cells += batch["input_ids"].numel()
        if clock is not None:
            clock.sample()
    seconds = time.perf_counter() - started
    first_rows = 0 if first is None else 1
    return {
        "samples": samples,
        "batches": count,
        "seconds": seconds,
        "first": first or 0.0,
        "rate": samples / seconds,
        "steady": (samples - samples / max(count, 1) * first_rows) / (seconds - (first or 0)),
        "padding": 1 - tokens / cells if cells else 0.0,
        "trainer_cpu": time.process_time() - cpu - (clock.own if clock is not None else 0.0),
        "keys": keys,
    }


def wdsvlm_run(args, workers, world=1, rank=0, resume_check=False) -> dict:
    import wdsvlm

    source = [wdsvlm.Source(args.data, repeat=args.repeat)]
    settings = {
        "max_length": args.max_length,
        "batch_size": args.batch_size,
        "num_workers": args.workers,
        "workers": workers,
        "world_size": world,
        "rank": rank,
    }
    loader = wdsvlm.Loader(source, args.tokenizer, **settings)
    me = os.getpid()
    clock = WorkerClock(descendants(me) if workers == "local" else titled(b"ray::RayWorker"))
    found = consume(loader, clock)
    found["worker_cpu"] = clock.seconds()
    found["steps"] = len(loader)
    if resume_check:
        again = wdsvlm.Loader(source, args.tokenizer, **settings)
        batches = iter(again)
        for _ in range(3):
            next(batches)
        state = again.state_dict()
        expected = [b["sample_keys"] for b in itertools.islice(batches, 3)]
        batches.close()
        again.close()
        resumed = wdsvlm.Loader(source, args.tokenizer, **settings)
        resumed.load_state_dict(state)
        got = [b["sample_keys"] for b in itertools.islice(iter(resumed), 3)]
        found["resume"] = "yes, exact" if got == expected else "NO: differs"
    return found


def ray_data_run(args, world: int) -> list[dict]:
    """Ray Data's way, ``world`` trainers (threads here) each taking its split."""
    import fsspec
    import numpy as np
    import ray

    from wdsvlm.tools.naive import pad_to_longest

    fs, root = fsspec.core.url_to_fs(args.data)
    shards = sorted(p for p in fs.ls(root, detail=False) if p.endswith(".tar"))
    paths = shards * args.repeat
    max_length = args.max_length

    def collate(batch: dict):
        rows = [
            {
                "__key__": batch["__key__"][i],
                "input_ids": np.asarray(batch["input_ids"][i], dtype=np.int64),
                "labels": np.asarray(batch["labels"][i], dtype=np.int64),
                "pixel_values": np.asarray(batch["pixel_values"][i], dtype=np.uint8),
            }
            for i in range(len(batch["__key__"]))
        ]
        return pad_to_longest(rows)

    # a function, not an actor class: Ray Data fuses it with the read into one task, so
    # reading and preparing share the cluster's CPUs (map actors holding every CPU would
    # leave none to the read tasks, and the pipeline would wait for ever)
    data = ray.data.read_webdataset(paths, decoder=None).map_batches(
        prepare,
        batch_size=16,
        batch_format="numpy",
        fn_kwargs={"tokenizer": args.tokenizer, "max_length": max_length},
    )
    splits = data.streaming_split(world, equal=True)
    results: list[dict] = [{} for _ in range(world)]
    workers = WorkerClock(titled(b"ray::"))

    def take(rank: int) -> None:
        batches = splits[rank].iter_torch_batches(
            batch_size=args.batch_size, collate_fn=collate, drop_last=False
        )
        results[rank] = consume(batches, workers if rank == 0 else None)

    threads = [threading.Thread(target=take, args=(r,)) for r in range(world)]
    cpu = time.process_time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the driver's threads, all of it, but for the sampling
    results[0]["trainer_cpu"] = time.process_time() - cpu - workers.own
    results[0]["worker_cpu"] = workers.seconds()
    for r in results:
        r["steps"] = r["batches"]
    return results


_STAGES: dict = {}  # per Ray worker process: the stages, made once


def prepare(batch: dict, tokenizer: str, max_length: int) -> dict:
    """Ray Data's map: the same decode and tokenization as the Loader's stages, samples over
    ``max_length`` tokens dropped; ragged columns."""
    import numpy as np

    from wdsvlm.families.tiling import ImageConfig
    from wdsvlm.pipeline import DecodeImages, Tokenize

    if tokenizer not in _STAGES:
        images = ImageConfig()
        _STAGES[tokenizer] = DecodeImages(images), Tokenize(tokenizer, image_config=images)
    decode, tokenize = _STAGES[tokenizer]
    n = len(batch["__key__"])
    rows = []
    for i in range(n):  # a member the sample lacks is a missing value in its column
        row = {k: batch[k][i] for k in batch if batch[k][i] is not None}
        rows.append({k: v for k, v in row.items() if not (isinstance(v, float) and v != v)})
    for row in rows:
        for k, v in row.items():
            if isinstance(v, (np.ndarray, np.bytes_)) and k != "__key__":
                row[k] = bytes(v)
    out = [s for s in tokenize(decode(iter(rows))) if len(s["input_ids"]) <= max_length]
    return {
        "__key__": objects([str(s["__key__"]) for s in out]),
        "input_ids": objects([np.asarray(s["input_ids"]) for s in out]),
        "labels": objects([np.asarray(s["labels"]) for s in out]),
        "pixel_values": objects([s["pixel_values"].numpy() for s in out]),
    }


def objects(values: list):
    """A numpy column of ragged values (arrays of different shapes)."""
    import numpy as np

    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def steps_of(args, workers, world: int, rank: int) -> int:
    """``len(loader)`` of rank ``rank`` of ``world``: the same on every rank by design."""
    import wdsvlm

    source = [wdsvlm.Source(args.data, repeat=args.repeat)]
    settings = {"max_length": args.max_length, "batch_size": args.batch_size}
    settings.update(num_workers=args.workers, workers=workers, world_size=world, rank=rank)
    return len(wdsvlm.Loader(source, args.tokenizer, **settings))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=os.path.join(REPO, "shards_example"))
    parser.add_argument("--tokenizer", default=os.path.join(REPO, "shards_example", "tokenizer"))
    # 2,560 samples: the actors' start (about a second each, once per epoch) weighs on a
    # shorter run; with 3 copies (960 samples) Ray workers gave 0.73-0.94x local ones
    parser.add_argument("--repeat", type=int, default=8, help="copies of the data in one pass")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=2)
    args = parser.parse_args()

    import ray

    import wdsvlm

    rows = {}
    rows["wdsvlm, local workers"] = [wdsvlm_run(args, "local", resume_check=True)]
    rows["wdsvlm, local workers"].append(wdsvlm_run(args, "local"))
    steps_local = [steps_of(args, "local", 2, r) for r in (0, 1)]
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    on_ray = wdsvlm.RayWorkers()
    rows["wdsvlm, Ray workers"] = [wdsvlm_run(args, on_ray, resume_check=True)]
    rows["wdsvlm, Ray workers"].append(wdsvlm_run(args, on_ray))
    steps_ray = [steps_of(args, on_ray, 2, r) for r in (0, 1)]
    ray_data = [ray_data_run(args, 1)[0], ray_data_run(args, 1)[0]]
    two = [ray_data_run(args, 2), ray_data_run(args, 2)]
    ray.shutdown()

    print(
        f"\n{args.repeat} x {args.data}, max_length {args.max_length}, batch {args.batch_size}, "
        f"{args.workers} worker CPUs, one trainer ({os.cpu_count()} cores here)\n"
    )
    print(
        "| pipeline | samples/s | after the first batch | first batch | padding "
        "| trainer's node CPU ms/sample | elsewhere CPU ms/sample | steps per rank (2 ranks) "
        "| same order twice | mid-epoch resume |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |")
    table = [
        ("wdsvlm, local workers", rows["wdsvlm, local workers"], steps_local, None),
        ("wdsvlm, Ray workers", rows["wdsvlm, Ray workers"], steps_ray, None),
        ("Ray Data (streaming_split, equal=True)", ray_data, [r["steps"] for r in two[0]], two),
    ]
    for name, (a, b), steps, split_runs in table:
        trainer = a["trainer_cpu"] + (a["worker_cpu"] if name.endswith("local workers") else 0)
        elsewhere = 0.0 if name.endswith("local workers") else a["worker_cpu"]
        if split_runs is None:
            same = "yes" if a["keys"] == b["keys"] else "no"
            resume = a.get("resume", "?")
        else:
            same = (
                "yes"
                if all(x["keys"] == y["keys"] for x, y in zip(*split_runs, strict=True))
                else "no"
            )
            resume = "no: no savable iterator"
            dropped = a["samples"] - sum(r["samples"] for r in split_runs[0])
            steps = f"{steps[0]}, {steps[1]} ({dropped} samples dropped by equal=True)"
        print(
            f"| {name} | {a['rate']:.1f} | {a['steady']:.1f} | {a['first']:.2f} s "
            f"| {a['padding']:.1%} | {1000 * trainer / a['samples']:.1f} "
            f"| {1000 * elsewhere / a['samples']:.1f} | {steps} | {same} | {resume} |"
        )
    local, on_ray = rows["wdsvlm, local workers"][0], rows["wdsvlm, Ray workers"][0]
    local_cpu = (local["trainer_cpu"] + local["worker_cpu"]) / local["batches"]
    ray_cpu = on_ray["trainer_cpu"] / on_ray["batches"]
    print(
        f"\nRay workers / local workers, samples/s: {on_ray['rate'] / local['rate']:.2f}x "
        f"(after the first batch {on_ray['steady'] / local['steady']:.2f}x); CPU per batch "
        f"on the trainer's node, Ray (the trainer process) / local (the trainer and its "
        f"DataLoader workers): {ray_cpu / local_cpu:.2f}x"
    )


if __name__ == "__main__":
    main()
