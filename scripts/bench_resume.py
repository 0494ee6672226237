"""Benchmark: the size of a loader state and what a resume costs, on the same topology and
after a topology change (elastic), for a two-source mixture over shards_example.

    python scripts/bench_resume.py [--steps 10] [--workers 2]

A run of 2 ranks x W workers (ranks simulated in one process: rank= and world_size= given)
takes --steps steps on each rank; all states are saved: their pickled size, and the samples
the old buffers held (read again by their index offsets on the same topology; handed over
with the rest of the pass on another one). Then for each new topology: the ranges of places
handed to rank 0's workers, and the seconds from load_state_dict to rank 0's first batch.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import wdsvlm  # noqa: E402
from wdsvlm import Source  # noqa: E402
from wdsvlm.loader.state import WorkerState  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_worker_start  # noqa: E402

EXAMPLE = os.path.join(REPO, "shards_example")
TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
# bench_worker_start's settings (the demo's), workers forked as in one simulated process
SETTINGS = {**bench_worker_start.SETTINGS, "multiprocessing_context": "fork"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    sources = [Source(EXAMPLE, repeat=2.0, name="a"), Source(EXAMPLE, repeat=0.5, name="b")]
    states = []
    for rank in range(2):
        loader = wdsvlm.Loader(
            sources, TOKENIZER, rank=rank, world_size=2, num_workers=args.workers, **SETTINGS
        )
        batches = iter(loader)
        for _ in range(args.steps):
            next(batches)
        states.append(loader.state_dict())
        loader.close()
    old = f"2 x {args.workers}"
    held = sum(len(WorkerState.from_saved(w).held_places()) for s in states for w in s["workers"])
    print(
        f"{old} after {args.steps} steps: a rank's state {len(pickle.dumps(states[0]))} B "
        f"pickled, all ranks {len(pickle.dumps(states))} B; the buffers hold {held} samples"
    )
    print(f"{'new topology':>14} {'load -> 1st batch':>18} {'ranges handed to rank 0':>24}")
    for world, workers in [(2, args.workers), (1, 3), (3, 1)]:
        loader = wdsvlm.Loader(
            sources, TOKENIZER, rank=0, world_size=world, num_workers=workers, **SETTINGS
        )
        start = time.perf_counter()
        loader.load_state_dict(states)
        handed = loader.state_dict()["workers"]  # the restored state, before any batch
        ranges = sum(len(r) for w in handed for _, r in w["read"]["segments"])
        next(iter(loader))
        seconds = time.perf_counter() - start
        print(f"{f'{world} x {workers}':>14} {seconds:17.2f}s {ranges:>24}")
        loader.close()


if __name__ == "__main__":
    main()
