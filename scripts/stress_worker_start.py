"""Many DataLoader worker starts right after ``load_state_dict``, in a 2-rank gloo group, while
native threads enter Python the way torch's C++ threads do: does a worker ever hang at start?

    python scripts/stress_worker_start.py [--context forkserver|spawn|fork] [--starts 100]
        [--native-threads 4] [--deadline 20] [--json]

Each rank loads the same saved state again and again and takes the first batch, so each time
its DataLoader starts 2 workers; an all_reduce between starts keeps gloo busy. Meanwhile
``--native-threads`` threads created outside Python (pthreads, through ctypes) call into
Python in a loop: each call makes a thread state and holds the interpreter's thread-list lock
without the GIL, the moment a fork from this process must not meet (CPython gh-112275, on
3.11.7). A start whose first batch does not come within ``--deadline`` seconds is a hang: its
workers are killed, the hang counted, and the run goes on. It prints starts, hangs and the
seconds per start by rank; with ``--context fork`` it shows the hang this guards against.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "shards_example")
SETTINGS = {
    "max_length": 256,
    "batch_size": 2,
    "tile_size": 32,
    "max_image_side": 64,
    "tokens_per_tile": 4,
    "shuffle_buffer": 12,
    "pack_window": 10,
    "seed": 3,
}


def native_threads(count: int) -> threading.Event:
    """Start ``count`` loops that each create pthreads whose body is a Python callback (so
    each makes and drops a Python thread state from outside Python); set the event to stop."""
    stop = threading.Event()
    libc = ctypes.CDLL(None)
    body = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(lambda arg: None)

    def loop():
        thread = ctypes.c_ulong()
        while not stop.is_set():
            if libc.pthread_create(ctypes.byref(thread), None, body, None) == 0:
                libc.pthread_join(thread, None)  # ctypes lets go of the GIL while it waits

    for _ in range(count):
        threading.Thread(target=loop, daemon=True, name="native-churn").start()
    stop.body = body  # kept alive as long as the loops run
    return stop


def kill_workers() -> None:
    for child in multiprocessing.active_children():
        os.kill(child.pid, signal.SIGKILL)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch
    import torch.distributed as dist

    import wdsvlm

    # a rank that is stuck for good dumps every thread's stack and exits, failing the run
    faulthandler.dump_traceback_later(args.deadline + 2 * args.starts + 60, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    loader = wdsvlm.Loader(
        EXAMPLE,
        os.path.join(EXAMPLE, "tokenizer"),
        num_workers=2,
        multiprocessing_context=args.context,
        **SETTINGS,
    )
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    batches.close()
    stop = native_threads(args.native_threads)
    hangs, seconds = 0, []
    try:
        for _ in range(args.starts):
            loader.load_state_dict(state)
            started = time.monotonic()
            watchdog = threading.Timer(args.deadline, kill_workers)
            watchdog.start()
            batches = iter(loader)
            try:
                next(batches)
            except RuntimeError as e:  # the watchdog killed a worker that never started
                if "DataLoader worker" not in str(e):
                    raise
                hangs += 1
            finally:
                watchdog.cancel()
                batches.close()
            seconds.append(time.monotonic() - started)
            step = torch.ones(1)
            dist.all_reduce(step)  # gloo at work between starts, as in training
    finally:
        stop.set()
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump({"starts": len(seconds), "hangs": hangs, "seconds": seconds}, f)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            rank_main, args=(2, port, args, out), nprocs=2, start_method="spawn", join=False
        )
        try:
            while not context.join():
                pass
        finally:  # no rank left behind, whatever happened
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        ranks = [pickle.load(open(os.path.join(out, f"rank{r}.pkl"), "rb")) for r in range(2)]
    return {
        "context": args.context,
        "native_threads": args.native_threads,
        "starts": sum(r["starts"] for r in ranks),
        "workers_started": 2 * sum(r["starts"] for r in ranks),
        "hangs": sum(r["hangs"] for r in ranks),
        "seconds_per_start": [round(sum(r["seconds"]) / len(r["seconds"]), 3) for r in ranks],
        "max_seconds": round(max(max(r["seconds"]) for r in ranks), 3),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", default="forkserver", choices=("forkserver", "spawn", "fork"))
    parser.add_argument("--starts", type=int, default=100, help="DataLoader starts per rank")
    parser.add_argument("--native-threads", type=int, default=4)
    parser.add_argument("--deadline", type=float, default=20.0, help="seconds to a first batch")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.context}: {result['hangs']} hangs in {result['starts']} DataLoader starts "
            f"({result['workers_started']} workers) with {args.native_threads} native threads "
            f"entering Python; seconds per start by rank {result['seconds_per_start']}, "
            f"slowest {result['max_seconds']}"
        )
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["hangs"] else 0)
