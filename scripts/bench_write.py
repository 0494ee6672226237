"""The writer side by side in one run: the local writer with N workers against the Ray writer
on a local Ray of N CPUs, from JSONL records with image files and from Parquet with the
images embedded; and what `wdsvlm index` costs per GB of existing tars.

    python scripts/bench_write.py [--samples 1000] [--workers 2] [--rounds 2]

The runs alternate (local, ray, local, ray...) so that a noisy machine hits both alike; each
prints samples/s and MB/s of shards written. Ray's start (``ray.init``) is timed apart, once:
a cluster is started once per job, not per dataset.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import time

import numpy as np
from PIL import Image

import wdsvlm
from wdsvlm.write.tarindex import index_tars


def make_inputs(folder: str, samples: int) -> tuple[str, str]:
    """Photo-like JPEGs (gradients, shapes and noise, 480-800 px) with LLaVA records, and the
    same as a Parquet file with the images embedded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(f"{folder}/images", exist_ok=True)
    rng = np.random.default_rng(0)
    records, rows = [], []
    for i in range(samples):
        w, h = int(rng.integers(480, 800)), int(rng.integers(360, 640))
        x = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
        y = np.linspace(0, 255, h, dtype=np.float32)[:, None, None]
        base = np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2], axis=2)
        pixels = np.clip(base + rng.normal(0, 18, (h, w, 3)), 0, 255).astype(np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, format="JPEG", quality=85)
        data = out.getvalue()
        with open(f"{folder}/images/{i}.jpg", "wb") as f:
            f.write(data)
        turns = [
            {"from": "human", "value": f"<image>\nDescribe picture {i}."},
            {"from": "gpt", "value": "A gradient under noise. " * int(rng.integers(1, 30))},
        ]
        records.append({"id": str(i), "image": f"{i}.jpg", "conversations": turns})
        rows.append({"id": str(i), "image": {"bytes": data, "path": None}, "conversations": turns})
    with open(f"{folder}/records.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    pq.write_table(pa.Table.from_pylist(rows), f"{folder}/rows.parquet", row_group_size=64)
    return f"{folder}/records.jsonl", f"{folder}/rows.parquet"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/wdsvlm-bench-write")
    args = parser.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    jsonl = f"{args.dir}/records.jsonl"
    parquet = f"{args.dir}/rows.parquet"
    if not os.path.exists(parquet):
        jsonl, parquet = make_inputs(args.dir, args.samples)
    import ray

    temp = f"/tmp/wdsvlm-bench-ray-{os.getpid()}"
    started = time.perf_counter()
    ray.init(num_cpus=args.workers, include_dashboard=False, _temp_dir=temp, log_to_driver=False)
    print(f"ray.init of {args.workers} CPUs: {time.perf_counter() - started:.1f} s (once a job)")
    common = {"image_root": f"{args.dir}/images", "samples_per_shard": 250, "progress": False}
    results: dict = {}
    try:
        for _ in range(args.rounds):
            for kind, source in (("jsonl", jsonl), ("parquet", parquet)):
                for engine in ("local", "ray"):
                    out = f"{args.dir}/out-{engine}-{kind}"
                    shutil.rmtree(out, ignore_errors=True)
                    summary = wdsvlm.write_dataset(
                        source, out, engine=engine, workers=args.workers, **common
                    )
                    results.setdefault((kind, engine), []).append(summary)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    print(f"\n{args.samples} samples, {args.workers} workers / CPUs, best of {args.rounds}")
    print(f"{'input':<8} {'engine':<6} {'seconds':>8} {'samples/s':>10} {'MB/s':>7}  ray/local")
    for kind in ("jsonl", "parquet"):
        best = {e: min(results[(kind, e)], key=lambda s: s.seconds) for e in ("local", "ray")}
        for engine, s in best.items():
            ratio = s.seconds / best["local"].seconds
            print(
                f"{kind:<8} {engine:<6} {s.seconds:>8.2f} {s.samples / s.seconds:>10.1f} "
                f"{s.bytes / 1e6 / s.seconds:>7.1f}  {ratio:.2f}x"
            )
    same = all(
        open(f"{args.dir}/out-local-{k}/index.json").read()
        == open(f"{args.dir}/out-ray-{k}/index.json").read()
        for k in ("jsonl", "parquet")
    )
    print(f"same index.json from both engines: {same}")

    # wdsvlm index on tars that exist: the local writer's shards, re-indexed in place
    tars = f"{args.dir}/out-local-jsonl"
    gigabytes = (
        sum(os.path.getsize(f"{tars}/{n}") for n in os.listdir(tars) if n.endswith(".tar")) / 1e9
    )
    for workers in (1, args.workers):
        out = f"{args.dir}/index-{workers}"
        shutil.rmtree(out, ignore_errors=True)
        summary = index_tars(tars, output=out, workers=workers, show_progress=False)
        print(
            f"wdsvlm index, {workers} worker(s): {summary.samples} samples, "
            f"{gigabytes * 1e3:.0f} MB in {summary.seconds:.2f} s = "
            f"{summary.seconds / gigabytes:.1f} s per GB "
            f"({gigabytes * 1e3 / summary.seconds:.0f} MB/s)"
        )


if __name__ == "__main__":
    main()
