"""Benchmark: wdsvlm's pipeline stages against a naive webdataset pipeline doing the same work.

    python scripts/bench_pipeline.py [--mix web|coco|both] [--samples N] [--workdir DIR] [--json]
    python scripts/bench_pipeline.py --make-only --mix photos --samples 1200   # data only

For each image-size mix, on the same shards and in one process, side by side:
  (a) naive: webdataset's tar reader, full PIL decode, the same resize and tiling (tile by
      tile crops), `apply_chat_template` and a tokenizer call per sample, labels found by
      tokenizing each conversation prefix;
  (b) wdsvlm: Plan -> ReadSamples -> DecodeImages -> Tokenize (draft-mode JPEG decode,
      batched tokenization, labels from character offsets);
and then (b) in a DataLoader with 2 workers against (b) in the main process (batches of 8,
tiles collated into one shared-memory tensor, as the loader ships them; the time to the first
batch is shown apart), beside the machine's ceiling: the same work split over 2 plain
processes that ship nothing; and last the whole wdsvlm.Loader (the stages plus packing and
collate, which decodes a batch's images straight into one shared tensor) with 2 workers
against none. The script checks that
(a) and (b) give the same tokens, labels and tile counts for every sample.

Mixes (made once under --workdir with wdsvlm's own writer; photo-like JPEGs: shapes plus
noise at quality 85):
  web:  long sides 480-4000 px, three quarters above 2 x max_image_side (2048 px)
  coco: long sides 224-1600 px
  photos: long sides 500-1600 px (web-sized photos; the data of `wdsvlm bench --processor`
      in the README, made with --make-only)
Each timing is the best of --rounds runs (a and b alternate), to damp a noisy machine. Torch
runs one thread, as it does in DataLoader workers, so "single process" means one core.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import sys
import time

import numpy as np
import webdataset as wds
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_example  # noqa: E402  (the example's scene drawing and texts)

from wdsvlm import write_dataset  # noqa: E402
from wdsvlm.pipeline.images import DecodeImages, ImageConfig  # noqa: E402
from wdsvlm.pipeline.plan import Plan, WorkerConfig  # noqa: E402
from wdsvlm.pipeline.read import ReadSamples  # noqa: E402
from wdsvlm.pipeline.tokenize import Tokenize  # noqa: E402
from wdsvlm.tools.naive import naive_samples  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "shards_example", "tokenizer")
CONFIG = ImageConfig()  # tile 512, max side 1024
TOKENS_PER_TILE = 64


# --- data ---------------------------------------------------------------------------------


def long_side(mix: str, rng: random.Random) -> int:
    if mix == "web":
        return int(rng.uniform(2048, 4000) if rng.random() < 0.75 else rng.uniform(480, 2048))
    if mix == "photos":
        return int(rng.uniform(500, 1600))
    return int(rng.uniform(224, 1600))


def photo_like(scene: dict, rng: random.Random) -> bytes:
    """A drawn scene with sensor-like noise: JPEG-coded like a photo, not like a flat drawing."""
    pixels = np.asarray(make_example.draw(scene), dtype=np.int16)
    noise = np.random.default_rng(rng.randrange(2**32)).normal(0, 12, pixels.shape)
    img = Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))
    out = io.BytesIO()
    img.save(out, format="JPEG", quality=85)
    return out.getvalue()


def make_mix(mix: str, samples: int, folder: str) -> str:
    out = os.path.join(folder, mix)
    if os.path.exists(os.path.join(out, "index.json")):
        return out
    rng = random.Random(f"bench/{mix}")
    images_dir = os.path.join(folder, f"{mix}-images")
    os.makedirs(images_dir, exist_ok=True)
    records = []
    for i in range(samples):
        scene = make_example.random_scene(rng)
        aspect = scene["width"] / scene["height"]
        side = long_side(mix, rng)
        if aspect >= 1:
            w, h = side, max(32, int(side / aspect))
        else:
            w, h = max(32, int(side * aspect)), side
        sx, sy = w / scene["width"], h / scene["height"]
        shapes = [
            {**s, "x": s["x"] * sx, "y": s["y"] * sy, "size": s["size"] * min(sx, sy)}
            for s in scene["shapes"]
        ]
        scene = {**scene, "width": w, "height": h, "shapes": shapes}
        name = f"{i:05d}.jpg"
        with open(os.path.join(images_dir, name), "wb") as f:
            f.write(photo_like(scene, rng))
        if rng.random() < 0.5:
            q, a = make_example.vqa(scene, rng)
        else:
            q, a = "Describe this image in detail.", make_example.detailed(scene, rng)
        records.append(
            {
                "id": f"{mix}-{i}",
                "image": name,
                "conversations": [
                    {"from": "human", "value": "<image>\n" + q},
                    {"from": "gpt", "value": a},
                ],
            }
        )
    with open(os.path.join(folder, f"{mix}.json"), "w") as f:
        json.dump(records, f)
    write_dataset(
        os.path.join(folder, f"{mix}.json"),
        out,
        image_root=images_dir,
        samples_per_shard=64,
        progress=False,
        workers=2,
    )
    return out


# --- (a) the naive pipeline (wdsvlm.tools.bench, as `wdsvlm bench` runs it) ----------------------


def run_naive(folder, tokenize):
    urls = [os.path.join(folder, s) for s in sorted(os.listdir(folder)) if s.endswith(".tar")]
    return naive_samples(wds.WebDataset(urls, shardshuffle=False), tokenize)


# --- (b) wdsvlm -------------------------------------------------------------------------------


def wdsvlm_pipeline(folder, tokenize, workers=0):
    return wds.DataPipeline(
        Plan(folder, worker_config=WorkerConfig(0, 1, workers)),
        ReadSamples(),
        DecodeImages(CONFIG),
        tokenize,
    )


def collate_shared(samples):
    """Batches of 8 as a loader ships them: one uint8 tensor of all tiles, made in shared
    memory inside a worker so that it crosses to the training process without a copy."""
    import torch

    from wdsvlm.pipeline.images import uint8_tiles

    pixels = [s["pixel_values"] for s in samples]
    out = uint8_tiles(sum(len(p) for p in pixels), pixels[0].shape[-1])
    torch.cat(pixels, out=out)
    # token arrays are small: pickled inline, cheaper than a shared-memory segment each
    return {
        "keys": [s["__key__"] for s in samples],
        "pixel_values": out,
        "input_ids": [s["input_ids"] for s in samples],
    }


def run_loader(folder, tokenize, workers):
    from torch.utils.data import DataLoader

    pipe = wdsvlm_pipeline(folder, tokenize, workers)
    pipe.pipeline.append(wds.batched(8, collation_fn=collate_shared, partial=True))
    loader = DataLoader(
        pipe, batch_size=None, num_workers=workers, prefetch_factor=4 if workers else None
    )
    for batch in loader:
        for key in batch["keys"]:
            yield {"__key__": key}


def _run_share(args):
    folder, tokenize, rank = args
    import torch

    torch.set_num_threads(1)
    pipe = wds.DataPipeline(
        Plan(folder, worker_config=WorkerConfig(rank, 2, 0)),
        ReadSamples(),
        DecodeImages(CONFIG),
        tokenize,
    )
    return sum(1 for _ in pipe)


def machine_ceiling(folder, tokenize) -> float:
    """Speed-up of the same work split over 2 plain processes, nothing shipped between them:
    what this machine's two cores allow, the most any 2-worker loader can reach."""
    import multiprocessing

    start = time.perf_counter()
    one = sum(1 for _ in wdsvlm_pipeline(folder, tokenize))
    alone = time.perf_counter() - start
    with multiprocessing.get_context("fork").Pool(2) as pool:
        start = time.perf_counter()
        two = sum(pool.map(_run_share, [(folder, tokenize, 0), (folder, tokenize, 1)]))
        together = time.perf_counter() - start
    assert one == two
    return alone / together


def timed(samples) -> tuple[float, dict]:
    start = time.perf_counter()
    out = {}
    for s in samples:
        out[s["__key__"]] = s
    return time.perf_counter() - start, out


def timed_loader(folder, tokenize, workers) -> tuple[float, float, list[str]]:
    """Samples/s over the whole run, seconds to the first batch, and the keys."""
    start = time.perf_counter()
    first = None
    keys = []
    for sample in run_loader(folder, tokenize, workers):
        if first is None:
            first = time.perf_counter()
        keys.append(sample["__key__"])
    return len(keys) / (time.perf_counter() - start), first - start, sorted(keys)


def same_work(a: dict, b: dict) -> int:
    assert sorted(a) == sorted(b), "the two pipelines saw different samples"
    for key in a:
        x, y = a[key], b[key]
        assert list(x["image_tiles"]) == list(y["image_tiles"]), key
        assert tuple(x["pixel_values"].shape) == tuple(y["pixel_values"].shape), key
        assert np.array_equal(np.asarray(x["input_ids"]), np.asarray(y["input_ids"])), key
        assert np.array_equal(np.asarray(x["labels"]), np.asarray(y["labels"])), key
    return len(a)


def measure_apart(folder: str, what: str) -> dict:
    """Run one loader or ceiling measurement in a fresh interpreter; its result as a dict."""
    import subprocess

    command = [sys.executable, os.path.abspath(__file__), "--measure", what, folder]
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def timed_full_loader(folder: str, workers: int) -> dict:
    """samples/s of wdsvlm.Loader (the stages plus packing into [2, 4096] batches and collate,
    which decodes each batch's images straight into one shared tensor)."""
    from wdsvlm import Loader

    loader = Loader(
        folder,
        TOKENIZER,
        max_length=4096,
        batch_size=2,
        num_workers=workers,
        tile_size=CONFIG.tile_size,
        max_image_side=CONFIG.max_image_side,
        tokens_per_tile=TOKENS_PER_TILE,
    )
    start = time.perf_counter()
    n = sum(len(row) for batch in loader for row in batch["sample_keys"])
    return {"rate": n / (time.perf_counter() - start), "samples": n}


def measure(what: str, folder: str) -> dict:
    tokenize = Tokenize(TOKENIZER, tokens_per_tile=TOKENS_PER_TILE, image_config=CONFIG)
    if what == "ceiling":
        return {"ceiling": machine_ceiling(folder, tokenize)}
    if what.startswith("Loader"):
        return timed_full_loader(folder, int(what[-1]))
    rate, first, keys = timed_loader(folder, tokenize, {"loader0": 0, "loader2": 2}[what])
    return {"rate": rate, "first": first, "keys": keys}


def bench_mix(mix, folder, rounds):
    tokenize = Tokenize(TOKENIZER, tokens_per_tile=TOKENS_PER_TILE, image_config=CONFIG)
    for name in os.listdir(folder):  # warm the page cache: time decoding, not the disk
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(1 << 24):
                pass
    naive_times, ours_times = [], []
    for _ in range(rounds):
        t, naive_out = timed(run_naive(folder, tokenize))
        naive_times.append(t)
        t, ours_out = timed(wdsvlm_pipeline(folder, tokenize))
        ours_times.append(t)
    n = same_work(naive_out, ours_out)
    keys = sorted(ours_out)
    del naive_out, ours_out
    one, two, ceilings, full0, full2 = [], [], [], [], []
    for _ in range(rounds):  # each in a fresh process, as a training job starts its loader
        one.append(measure_apart(folder, "loader0"))
        two.append(measure_apart(folder, "loader2"))
        ceilings.append(measure_apart(folder, "ceiling")["ceiling"])
        full0.append(measure_apart(folder, "Loader0")["rate"])
        full2.append(measure_apart(folder, "Loader2")["rate"])
    assert two[-1]["keys"] == keys
    ceiling = max(ceilings)
    result = {
        "mix": mix,
        "samples": n,
        "naive_samples_per_s": n / min(naive_times),
        "wdsvlm_samples_per_s": n / min(ours_times),
        "loader_0_workers_samples_per_s": max(r["rate"] for r in one),
        "loader_2_workers_samples_per_s": max(r["rate"] for r in two),
        "loader_0_workers_first_batch_s": min(r["first"] for r in one),
        "loader_2_workers_first_batch_s": min(r["first"] for r in two),
    }
    result["wdsvlm_over_naive"] = result["wdsvlm_samples_per_s"] / result["naive_samples_per_s"]
    result["2_workers_over_0"] = (
        result["loader_2_workers_samples_per_s"] / result["loader_0_workers_samples_per_s"]
    )
    result["machine_2_process_ceiling"] = ceiling
    result["Loader_0_workers_samples_per_s"] = max(full0)
    result["Loader_2_workers_samples_per_s"] = max(full2)
    result["Loader_2_workers_over_0"] = max(full2) / max(full0)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", choices=("web", "coco", "photos", "both"), default="both")
    parser.add_argument(
        "--make-only", action="store_true", help="make the mix's dataset, print its folder"
    )
    parser.add_argument(
        "--samples", type=int, default=None, help="samples per mix (default: web 300, coco 600)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workdir", default="/tmp/wdsvlm-bench")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measure", nargs=2, metavar=("WHAT", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # single process means one core for both sides (as in workers)
    if args.measure:
        print(json.dumps(measure(*args.measure)))
        return
    mixes = ["web", "coco"] if args.mix == "both" else [args.mix]
    if args.make_only:
        for mix in mixes:
            n = args.samples or {"web": 300, "coco": 600, "photos": 1200}[mix]
            print(make_mix(mix, n, os.path.join(args.workdir, f"n{n}")))
        return
    results = []
    for mix in mixes:
        n = args.samples or {"web": 300, "coco": 600}[mix]
        folder = make_mix(mix, n, os.path.join(args.workdir, f"n{n}"))
        results.append(bench_mix(mix, folder, args.rounds))
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"{'mix':6} {'samples':>7} {'naive/s':>9} {'wdsvlm/s':>9} {'ratio':>6}"
        f" {'0 workers/s':>12} {'2 workers/s':>12} {'ratio':>6} {'ceiling':>8}"
    )
    for r in results:
        print(
            f"{r['mix']:6} {r['samples']:7d} {r['naive_samples_per_s']:9.1f} "
            f"{r['wdsvlm_samples_per_s']:9.1f} {r['wdsvlm_over_naive']:6.2f} "
            f"{r['loader_0_workers_samples_per_s']:12.1f} "
            f"{r['loader_2_workers_samples_per_s']:12.1f} {r['2_workers_over_0']:6.2f} "
            f"{r['machine_2_process_ceiling']:8.2f}"
        )
    print("\nwdsvlm.Loader (the stages + pack + collate into [2, 4096] batches):")
    print(f"{'mix':6} {'0 workers/s':>12} {'2 workers/s':>12} {'ratio':>6}")
    for r in results:
        print(
            f"{r['mix']:6} {r['Loader_0_workers_samples_per_s']:12.1f} "
            f"{r['Loader_2_workers_samples_per_s']:12.1f} {r['Loader_2_workers_over_0']:6.2f}"
        )
    for r in results:
        print(
            f"{r['mix']}: first batch after {r['loader_0_workers_first_batch_s']:.2f} s "
            f"(0 workers), {r['loader_2_workers_first_batch_s']:.2f} s (2 workers)"
        )
    print("same tokens, labels and tile counts in (a) and (b) for every sample: checked")


if __name__ == "__main__":
    main()
