"""Streaming from object storage against local disk: the same wdsvlm.Loader over the same
dataset, read from a folder and from a moto S3 server on loopback, side by side.

    python scripts/bench_storage.py [--mix coco|web] [--rounds 3] [--workers 0 2]

It makes the dataset with scripts/bench_pipeline.py's generator (under /tmp/wdsvlm-bench),
starts `moto_server` on 127.0.0.1, uploads the shards and the index, and then, alternating
local and S3 in fresh processes, measures samples/s over one epoch and the seconds from
creating the Loader to its first batch, and samples/s from there to the end of the epoch.
It prints the ratios S3 / local, the first-batch delay over local, and the round trip of one
small ranged GET.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_pipeline  # noqa: E402  (the datasets and settings of the pipeline benchmark)

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def measure(source: str, options: dict, workers: int) -> dict:
    """One epoch of the Loader: seconds to the first batch (Loader set-up included: reading
    the index and sizing the epoch) and samples/s after it (the steady stream)."""
    from wdsvlm import Loader

    started = time.perf_counter()
    loader = Loader(
        source,
        bench_pipeline.TOKENIZER,
        storage_options=options or None,
        max_length=4096,
        batch_size=2,
        num_workers=workers,
        tokens_per_tile=bench_pipeline.TOKENS_PER_TILE,
    )
    first = None
    samples = 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - started
        else:
            samples += sum(len(row) for row in batch["sample_keys"])
    return {"rate": samples / (time.perf_counter() - started - first), "first": first}


def measure_apart(source: str, options: dict, workers: int) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--measure", source, json.dumps(options)]
    command += ["--workers", str(workers)]
    run = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def round_trip(url: str, options: dict) -> float:
    """Median seconds of a 1 KB ranged GET."""
    from wdsvlm.storage.fs import read_range

    times = []
    for _ in range(20):
        started = time.perf_counter()
        read_range(url, 0, 1024, options)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", choices=("coco", "web"), default="coco")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--workdir", default="/tmp/wdsvlm-bench")
    parser.add_argument("--measure", nargs=2, metavar=("SOURCE", "OPTIONS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.update(CREDENTIALS)
    if args.measure:
        import torch

        torch.set_num_threads(1)
        source, options = args.measure
        print(json.dumps(measure(source, json.loads(options), args.workers[0])))
        return
    n = args.samples or {"web": 300, "coco": 600}[args.mix]
    folder = bench_pipeline.make_mix(args.mix, n, os.path.join(args.workdir, f"n{n}"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    server = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import s3fs

        options = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}
        for _ in range(100):
            try:
                fs = s3fs.S3FileSystem(**options)
                fs.mkdir("bench")
                break
            except OSError:
                time.sleep(0.1)
        names = sorted(os.listdir(folder))
        for name in names:
            fs.put_file(os.path.join(folder, name), f"bench/ds/{name}")
        rtt = round_trip("s3://bench/ds/index.json", options)
        print(
            f"{args.mix}: {n} samples, {len(names) - 1} shards; S3 on loopback, round trip "
            f"{rtt * 1000:.1f} ms"
        )
        print(
            f"{'workers':>7} {'local/s':>8} {'s3/s':>8} {'ratio':>6} "
            f"{'local 1st':>9} {'s3 1st':>7} {'delay':>6}"
        )
        for workers in args.workers:
            local, remote = [], []
            for _ in range(args.rounds):  # alternating, each in a fresh process
                local.append(measure_apart(folder, {}, workers))
                remote.append(measure_apart("s3://bench/ds", options, workers))
            rate_l = max(r["rate"] for r in local)
            rate_r = max(r["rate"] for r in remote)
            first_l = min(r["first"] for r in local)
            first_r = min(r["first"] for r in remote)
            print(
                f"{workers:7d} {rate_l:8.1f} {rate_r:8.1f} {rate_r / rate_l:6.2f} "
                f"{first_l:8.2f}s {first_r:6.2f}s {first_r - first_l:+5.2f}s"
            )
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
