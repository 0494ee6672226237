"""How far the default tiling's pixels moved when its resize went from torch's antialiased
bicubic (until 2026-12-01) to OpenCV's (``wdsvlm.families.tiling.resize``).

    python scripts/compare_resize.py DATASET [DATASET ...] [--limit 200]

Decodes each image of the datasets (the first --limit samples of each) once as the index
records it, tiles it both ways at the defaults (tile 512, max side 1024, no draft decode, so
both start from the same pixels), and prints per dataset the mean absolute difference per
pixel value, its 99th percentile and maximum, and the share of values that moved by more than
2 levels.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch.nn.functional import interpolate

from wdsvlm.families.tiling import ImageConfig, resize, tile_grid
from wdsvlm.format.images import image_members, open_image
from wdsvlm.pipeline.plan import Plan, WorkerConfig
from wdsvlm.pipeline.read import ReadSamples


def torch_tiles(pixels: np.ndarray, cols: int, rows: int, tile: int) -> tuple:
    """(grid, thumbnail) as the tiling made them before: torch's antialiased bicubic on uint8,
    [H, W, 3] in and out."""
    x = torch.from_numpy(np.array(pixels)).permute(2, 0, 1)[None]
    size = (rows * tile, cols * tile)
    grid = x if x.shape[-2:] == size else interpolate(x, size, mode="bicubic", antialias=True)
    thumb = interpolate(grid, (tile, tile), mode="bicubic", antialias=True)
    return grid[0].permute(1, 2, 0).numpy(), thumb[0].permute(1, 2, 0).numpy()


def opencv_tiles(pixels: np.ndarray, cols: int, rows: int, tile: int) -> tuple:
    grid = resize(pixels, cols * tile, rows * tile)
    return grid, resize(grid, tile, tile)


def compare(dataset: str, limit: int, config: ImageConfig) -> dict:
    plan = Plan(dataset, seed=0, worker_config=WorkerConfig(0, 1, 0))
    diffs = []
    samples = 0
    for sample in ReadSamples()(plan.spans(0, 0)):
        for name, size in zip(image_members(sample), sample["__meta__"]["images"], strict=True):
            pixels = np.asarray(open_image(sample[name], size))
            cols, rows = tile_grid(*size, config)
            old = torch_tiles(pixels, cols, rows, config.tile_size)
            new = opencv_tiles(pixels, cols, rows, config.tile_size)
            for a, b in zip(old, new, strict=True):
                diffs.append(np.abs(a.astype(np.int16) - b.astype(np.int16)).ravel())
        samples += 1
        if samples >= limit:
            break
    d = np.concatenate(diffs)
    return {
        "samples": samples,
        "mean": float(d.mean()),
        "p99": float(np.percentile(d, 99)),
        "max": int(d.max()),
        "over_2": float((d > 2).mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("datasets", nargs="+")
    parser.add_argument("--limit", type=int, default=200)
    args = parser.parse_args()
    config = ImageConfig()
    print("dataset | samples | mean abs diff | p99 | max | share moved > 2 levels")
    for dataset in args.datasets:
        r = compare(dataset, args.limit, config)
        print(
            f"{dataset} | {r['samples']} | {r['mean']:.2f} | {r['p99']:.0f} | {r['max']} | "
            f"{r['over_2']:.2%}"
        )


if __name__ == "__main__":
    main()
