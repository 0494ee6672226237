"""A pass over a store that throttles: the request governor against a rate limit on loopback.

    python scripts/bench_throttle.py [--rates 20 100] [--styles s3 hub] [--ranks 4] [--workers 2]

The example dataset (shards_example) is served by the project's range server
(``wdsvlm.testing.stores``) on 127.0.0.1, admitting at most N requests in any sliding second
and answering the others as S3 does (``503 Slow Down``, ``SlowDown`` body, no Retry-After) or
as the Hub does (``429`` with ``Retry-After: 1``). RANKS processes (ranks 0..RANKS-1 of a world
of RANKS, WORKERS DataLoader workers each) read one pass of it with small blocks (so that the
pass takes many requests) and a fresh node folder. For each N and style it prints: whether the
pass completed with batches identical to an unthrottled run, the request rate of the same pass
unthrottled (the demand: a share of N above it needs a demand above N), the admitted
requests/s as a share of N over the whole pass and once settled (from 5 s after the first
request to the last), and the throttled answers as a share of all answers, over the whole pass
and once settled.

    python scripts/bench_throttle.py rank URL RANK WORLD WORKERS BLOCK NODE_DIR OUT

is one rank's process: it writes OUT (JSON: each batch's digest).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "shards_example")
SETTINGS = {
    "max_length": 1024,
    "batch_size": 2,
    "tile_size": 64,
    "max_image_side": 128,
    "tokens_per_tile": 8,
    "shuffle_buffer": 50,
    "pack_window": 50,
}
SETTLED_AFTER = 5.0


def digest(batch: dict) -> str:
    import torch

    h = hashlib.sha256()
    for name in sorted(batch):
        value = batch[name]
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(str(value.dtype).encode() + str(tuple(value.shape)).encode())
            h.update(value.contiguous().numpy().tobytes())
        else:
            h.update(json.dumps(value).encode())
    return h.hexdigest()


def rank_main(url, rank, world, workers, block, node_dir, out) -> None:
    import faulthandler

    import wdsvlm
    from wdsvlm.storage.fs import ReadPolicy

    faulthandler.dump_traceback_later(300, exit=True)  # a hang prints every thread's stack
    policy = ReadPolicy(block_bytes=int(block), node_dir=node_dir)
    loader = wdsvlm.Loader(
        url,
        os.path.join(EXAMPLE, "tokenizer"),
        rank=int(rank),
        world_size=int(world),
        num_workers=int(workers),
        read_policy=policy,
        **SETTINGS,
    )
    batches = [digest(b) for b in loader]
    loader.close()
    with open(out, "w") as f:
        json.dump({"batches": batches}, f)


def run_pass(url: str, ranks: int, workers: int, block: int, timeout: float = 240) -> list:
    """Each rank's batch digests of one pass over ``url``, the ranks in processes at once."""
    folder = tempfile.mkdtemp(prefix="wdsvlm-throttle-")
    node_dir = os.path.join(folder, "node")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    for rank in range(ranks):
        out = os.path.join(folder, f"rank-{rank}.json")
        args = [url, rank, ranks, workers, block, node_dir, out]
        command = [sys.executable, os.path.abspath(__file__), "rank", *map(str, args)]
        procs.append((subprocess.Popen(command, env=env, start_new_session=True), out))
    deadline = time.monotonic() + timeout
    for proc, _ in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other, _ in procs:
                other.kill()
            raise RuntimeError(f"a rank did not finish in {timeout} s") from None
        if proc.returncode != 0:
            raise RuntimeError(f"{proc.args} failed with {proc.returncode}")
    return [json.load(open(out))["batches"] for _, out in procs]


def figures(answers: list, cap: float) -> dict:
    """Admitted requests/s over the cap and throttled answers over all, for the whole pass
    and once settled (from SETTLED_AFTER s after the first answer to the last)."""
    first, last = answers[0][0], answers[-1][0]

    def shares(since: float) -> tuple[float, float]:
        kept = [admitted for at, admitted in answers if at >= since]
        seconds = max(1e-9, last - since)
        return sum(kept) / seconds / cap, (len(kept) - sum(kept)) / max(1, len(kept))

    whole, settled = shares(first), shares(first + SETTLED_AFTER)
    return {
        "seconds": round(last - first, 1),
        "answers": len(answers),
        "throughput_of_cap": round(whole[0], 3),
        "throttled_share": round(whole[1], 3),
        "settled_throughput_of_cap": round(settled[0], 3),
        "settled_throttled_share": round(settled[1], 3),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        return rank_main(*sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[20, 100])
    parser.add_argument("--styles", nargs="+", default=["s3", "hub"])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, REPO)
    from wdsvlm.testing.stores import Throttle, range_server

    with range_server(EXAMPLE) as server:
        reference = run_pass(server.url, args.ranks, args.workers, 1 << 20)
    for rate in args.rates:
        # blocks of a size that makes the pass about 40 s of requests at the cap
        block = 65536 if rate <= 20 else 8192
        for style in args.styles:
            throttle = Throttle(rate, style)
            counted = Throttle(10**9)  # throttles nothing: the pass's own request rate
            with range_server(EXAMPLE, throttle=counted) as server:
                run_pass(server.url, args.ranks, args.workers, block)
            demand = figures(counted.answers, rate)["throughput_of_cap"] * rate
            with range_server(EXAMPLE, throttle=throttle) as server:
                started = time.monotonic()
                got = run_pass(server.url, args.ranks, args.workers, block, timeout=600)
                wall = time.monotonic() - started
            result = {
                "rate": rate,
                "style": style,
                "block_bytes": block,
                "identical": got == reference,
                "wall_s": round(wall, 1),
                "unthrottled_requests_per_s": round(demand, 1),
                **figures(throttle.answers, rate),
            }
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
