"""What starting DataLoader workers costs with each start method, per epoch, with and without
persistent_workers: the seconds from iterating the Loader to its first batch, epoch by epoch.

    python scripts/bench_worker_start.py [--rounds 3] [--epochs 4] [--workers 2]

Each measurement runs in a fresh process (so the first epoch pays for starting the fork
server, as a training job does once); the methods alternate round by round on this shared
machine, and the median of the rounds is printed. Epoch 0 includes the fork server's start
for ``forkserver``; the later epochs show the cost of each new set of workers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "shards_example")
SETTINGS = {
    "max_length": 1024,
    "batch_size": 2,
    "tile_size": 128,
    "max_image_side": 256,
    "tokens_per_tile": 16,
}


def measure(context: str, persistent: bool, epochs: int, workers: int) -> list[float]:
    """Seconds to the first batch of each epoch, in this process."""
    import wdsvlm

    loader = wdsvlm.Loader(
        EXAMPLE,
        os.path.join(EXAMPLE, "tokenizer"),
        num_workers=workers,
        persistent_workers=persistent,
        multiprocessing_context=context,
        **SETTINGS,
    )
    firsts = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        started = time.perf_counter()
        for i, _ in enumerate(loader):
            if i == 0:
                firsts.append(time.perf_counter() - started)
    return firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--measure", nargs=2, metavar=("CONTEXT", "PERSISTENT"))
    args = parser.parse_args()
    if args.measure:
        context, persistent = args.measure[0], args.measure[1] == "1"
        print(json.dumps(measure(context, persistent, args.epochs, args.workers)))
        return
    runs: dict[tuple, list[list[float]]] = {}
    cases = [(c, p) for p in (False, True) for c in ("fork", "forkserver", "spawn")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    for _ in range(args.rounds):
        for context, persistent in cases:
            command = [sys.executable, __file__, "--measure", context, str(int(persistent))]
            command += ["--epochs", str(args.epochs), "--workers", str(args.workers)]
            out = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
            runs.setdefault((context, persistent), []).append(json.loads(out.stdout))
    print(
        f"seconds to the first batch of each epoch, {args.workers} workers, median of "
        f"{args.rounds} rounds"
    )
    print("| start method | persistent_workers | epoch 0 | later epochs (mean) |")
    print("| --- | --- | ---: | ---: |")
    for (context, persistent), rounds in runs.items():
        first = statistics.median(r[0] for r in rounds)
        later = statistics.median(statistics.mean(r[1:]) for r in rounds)
        print(f"| {context} | {persistent} | {first:.2f} | {later:.3f} |")


if __name__ == "__main__":
    main()
