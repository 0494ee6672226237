"""CPU time of one Loader epoch, every process counted: the training process, the fork server,
each DataLoader worker (and the probe that tells when the server is ready).

    python scripts/bench_cpu.py DATA [--workers 0 2] [--max-length 4096] [--batch-size 8]

Each worker count runs in a fresh process, one after the other. The CPU times of the processes
the run starts are read from /proc/PID/stat after every batch (a worker may end before the
last batch), so this runs on Linux only. Where the 2-worker run's CPU-seconds, spread over the
machine's cores, would take longer than its samples at the 0-worker rate allow, no scheduling
can give that rate: docs/performance.md, "Worker start".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_and_parent(pid: int) -> tuple[float, int]:
    """(user + system CPU-seconds, parent pid) of ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK, int(fields[1])


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            _, parent = cpu_and_parent(int(name))
        except (OSError, IndexError, ValueError):  # ended meanwhile
            continue
        children.setdefault(parent, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def one_epoch(source: str, workers: int, max_length: int, batch_size: int) -> dict:
    from transformers import AutoTokenizer

    import wdsvlm

    tokenizer = AutoTokenizer.from_pretrained("shards_example/tokenizer")
    started, cpu_started = time.perf_counter(), time.process_time()
    loader = wdsvlm.Loader(
        source, tokenizer, max_length=max_length, batch_size=batch_size, num_workers=workers
    )
    samples, first, others = 0, None, {}
    for batch in loader:
        samples += sum(len(keys) for keys in batch["sample_keys"])
        if first is None:
            first = time.perf_counter() - started
        for pid in descendants(os.getpid()):
            try:
                others[pid] = max(others.get(pid, 0.0), cpu_and_parent(pid)[0])
            except (OSError, IndexError, ValueError):
                pass
    seconds, own = time.perf_counter() - started, time.process_time() - cpu_started
    loader.close()
    return {
        "workers": workers,
        "samples": samples,
        "seconds": round(seconds, 2),
        "samples_per_s": round(samples / seconds, 1),
        "first_batch_s": round(first, 2),
        "cpu_training_process": round(own, 2),
        "cpu_other_processes": sorted((round(v, 2) for v in others.values()), reverse=True),
        "cpu_all": round(own + sum(others.values()), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a fresh process's run
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_epoch(args.source, args.one, args.max_length, args.batch_size)))
        return
    cores = os.cpu_count() or 1
    base = None
    for workers in args.workers:
        run = subprocess.run(
            [sys.executable, __file__, args.source, "--one", str(workers)]
            + ["--max-length", str(args.max_length), "--batch-size", str(args.batch_size)],
            capture_output=True,
            text=True,
            check=True,
        )
        result = json.loads(run.stdout.strip().splitlines()[-1])
        if workers == 0:
            base = result["samples_per_s"]
        elif base:
            fastest = result["samples"] / (result["cpu_all"] / cores)
            result["at_most_x_the_0_worker_rate"] = round(fastest / base, 2)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
