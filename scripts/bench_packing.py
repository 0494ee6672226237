"""Benchmark: padding of batching and packing strategies on a realistic VLM length mix.

    python scripts/bench_packing.py [--samples 20000] [--window 1000] [--seed 0]
        [--family qwen2_5_vl|qwen3_vl|smolvlm]

The mix (lengths include image tokens: 64 per 512-px tile, images of 1, 3 or 5 tiles):
short VQA answers 35%, captions 20%, long detailed answers 20%, multi-turn chats 10%,
documents 5%, text-only chat 10%; about 8% of the image samples hold 2-4 images.
Strategies, each over the same samples in the same (shuffled) order:
  naive      pad each batch of 8 to its longest sample
  fixed      one sample per row of max_length
  greedy     sequential: add to the open pack while it fits, else open a new one
  bfd        whole-epoch offline best-fit-decreasing: the practical optimum
  wdsvlm     the streaming packer (window of --window samples)
With ``--family``, images get web-like sizes (sides 200 to 2000 px, aspect ratios 1:3 to 3:1)
and their image tokens and vision units (patches, tiles) come from wdsvlm's family code with
the family's published image sizes (``FAMILY_SIZES``); the vision budget of a pack is then
``--vision-budget`` units, and max_length goes up to 8192.
Samples longer than max_length are left out of all of them alike. Padding = 1 - real tokens /
(rows x max_length). Packing cost is the packer's time per sample, beside the time per sample
of the wdsvlm pipeline stages (read, decode, tokenize) on shards_example, measured in the same
run.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from wdsvlm.pipeline.packer import Packer  # noqa: E402
from wdsvlm.pipeline.packer import best_fit_decreasing as bfd_packs  # noqa: E402

TOKENS_PER_TILE = 64
MAX_TILES_PER_PACK = 64
LENGTHS = (1024, 2048, 4096, 8192)


def realistic_mix(n: int, seed: int) -> list[tuple[int, int]]:
    """``(tokens, tiles)`` per sample."""
    rng = random.Random(seed)

    def images() -> int:
        count = rng.choice([2, 3, 4]) if rng.random() < 0.08 else 1
        return sum(rng.choices([1, 3, 5], weights=[25, 35, 40])[0] for _ in range(count))

    kinds = {  # text tokens (low, high), has images
        "vqa": ((30, 90), True),
        "caption": ((40, 160), True),
        "detailed": ((180, 900), True),
        "multiturn": ((250, 1600), True),
        "document": ((900, 3500), True),
        "text": ((60, 1200), False),
    }
    weights = [35, 20, 20, 10, 5, 10]
    out = []
    for _ in range(n):
        kind = rng.choices(list(kinds), weights=weights)[0]
        (low, high), has_images = kinds[kind]
        text = int(rng.lognormvariate(0, 0.5) * (low + high) / 2)
        text = max(low, min(high, text))
        tiles = images() if has_images else 0
        out.append((text + tiles * TOKENS_PER_TILE + 10, tiles))  # + chat scaffolding
    return out


# the published image settings of each family (its preprocessor_config.json)
FAMILY_SIZES = {
    "qwen2_5_vl": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280},
    "qwen3_vl": {"min_pixels": 256 * 256, "max_pixels": 4096 * 4096},
    "smolvlm": {"size": {"longest_edge": 4 * 384}, "max_image_size": {"longest_edge": 384}},
}


def family_mix(n: int, seed: int, family: str) -> list[tuple[int, int]]:
    """``(tokens, vision units)`` per sample: the text of ``realistic_mix``, images of web-like
    sizes counted by the family's code."""
    from wdsvlm.families.registry import family_of
    from wdsvlm.testing.tiny import tiny_processor

    processor = tiny_processor(family, **FAMILY_SIZES[family])
    if family == "smolvlm":
        processor.image_seq_len = 81  # SmolVLM-Instruct's: 384-px tiles, 81 tokens each
    counter = family_of(processor)
    rng = random.Random(seed + 1)
    out = []
    for text_and_tiles, tiles in realistic_mix(n, seed):
        text = text_and_tiles - tiles * TOKENS_PER_TILE
        tokens, units = text, 0
        for _ in range(min(tiles, 4) if tiles else 0):  # about as many images as the mix has
            side = rng.uniform(200, 2000)
            aspect = math.exp(rng.uniform(-math.log(3), math.log(3)))
            w, h = max(1, round(side * math.sqrt(aspect))), max(1, round(side / math.sqrt(aspect)))
            units += counter.image_cost(w, h)
            tokens += len(counter.image_token_ids(w, h))
        out.append((tokens, units))
    return out


def padding(real: int, rows: int, row_len: int) -> float:
    return 1 - real / (rows * row_len) if rows else 0.0


def naive(samples, length, batch=8):
    real = rows_tokens = 0
    for i in range(0, len(samples), batch):
        chunk = [t for t, _ in samples[i : i + batch]]
        real += sum(chunk)
        rows_tokens += max(chunk) * len(chunk)
    return 1 - real / rows_tokens


def fixed(samples, length):
    return padding(sum(t for t, _ in samples), len(samples), length)


def greedy(samples, length, max_tiles):
    rows, room, tile_room = 0, 0, 0
    for t, k in samples:
        if t > room or k > tile_room:
            rows, room, tile_room = rows + 1, length, max_tiles
        room -= t
        tile_room -= k
    return padding(sum(t for t, _ in samples), rows, length)


def best_fit_decreasing(samples, length, max_tiles):
    tokens, tiles = [t for t, _ in samples], [k for _, k in samples]
    packs = bfd_packs(tokens, tiles, length, max_tiles)
    return padding(sum(tokens), len(packs), length)


def streaming(samples, length, max_tiles, window):
    packer = Packer(length, max_tiles, window)
    start = time.perf_counter()
    packs = []
    for i, (t, k) in enumerate(samples):
        packs += packer.push(i, t, k)
    packs += packer.drain()
    seconds = time.perf_counter() - start
    streaming.stats = packer.stats  # the last run's, for the budget advice
    return 1 - packer.stats.fill, seconds / len(samples), packs


def pass_end_share(n: int, length: int, seed: int) -> list[tuple[int, int]]:
    """One worker's share of a pass in the pass-end regime: a third of the samples 40-100%
    of max_length (an image tile per 512 tokens), the rest the realistic mix's that fit."""
    rng = random.Random(f"pass-end/{seed}/{length}")
    rest = [s for s in realistic_mix(4 * n, seed) if s[0] <= length]
    out = []
    for i in range(n):
        if i % 3 == 0:
            tokens = rng.randint(int(0.4 * length), length)
            out.append((tokens, min(MAX_TILES_PER_PACK, tokens // 512)))
        else:
            out.append(rest[i])
    return out


class _PackByPack(Packer):
    """The packer as it drained before: one pack at a time, longest sample first."""

    def drain(self):
        while self.waiting:
            yield self._emit()


def pass_end(share, length, max_tiles, window, passes, packer_class=Packer):
    """Padding of the packer over ``passes`` passes of one worker's share (reshuffled each
    pass, the window drained at each pass end as the Loader's Pack drains it), and the
    share of rows under 97% full."""
    rng = random.Random(0)
    packer = packer_class(length, max_tiles, window)
    packs = []
    for _ in range(passes):
        order = list(share)
        rng.shuffle(order)
        for t, k in order:
            packs += packer.push(t, t, k)
        packs += packer.drain()
    under = sum(1 for p in packs if sum(p) < 0.97 * length) / len(packs)
    return 1 - packer.stats.fill, under


def print_pass_end(window: int, seed: int, passes: int = 4) -> None:
    print(
        f"\npass ends: one worker's share of a pass, {window} samples (all in its window) or"
        f" {2 * window}, a third 40-100% of max_length; {passes} passes, the window drained at"
        " each pass end pack by pack (before) or by best-fit-decreasing (now), against"
        " best-fit-decreasing over the same samples"
    )
    print(
        f"{'share':>5} {'max_length':>10} {'bfd':>7} {'before':>7} {'wdsvlm':>7} "
        f"{'wdsvlm-bfd':>10} {'rows <97% full: bfd':>20} {'before':>7} {'wdsvlm':>7}"
    )
    for size, length in [(n, length) for n in (window, 2 * window) for length in LENGTHS]:
        share = pass_end_share(size, length, seed)
        tokens, tiles = [t for t, _ in share], [k for _, k in share]
        packs = bfd_packs(tokens, tiles, length, MAX_TILES_PER_PACK)
        bfd = padding(sum(tokens), len(packs), length)
        bfd_under = sum(1 for p in packs if sum(tokens[i] for i in p) < 0.97 * length)
        before, before_under = pass_end(
            share, length, MAX_TILES_PER_PACK, window, passes, _PackByPack
        )
        ours, under = pass_end(share, length, MAX_TILES_PER_PACK, window, passes)
        print(
            f"{size:>5} {length:>10} {bfd:7.2%} {before:7.2%} {ours:7.2%} "
            f"{100 * (ours - bfd):+9.2f}pp "
            f"{bfd_under / len(packs):20.1%} {before_under:7.1%} {under:7.1%}"
        )


def tiles_per_batch_cv(packs, tiles_of, balanced, batch=8):
    """Coefficient of variation of tiles per batch of 8 packs: in pack order, or grouped by
    wdsvlm's BalanceBatches."""
    from wdsvlm.pipeline.pack import BalanceBatches, tiles_cv

    as_samples = [[{"image_tiles": [tiles_of[i]]} for i in pack] for pack in packs]
    if balanced:
        run = BalanceBatches(batch)(iter(as_samples))
        for _ in run:
            pass
        return run.cv
    sums = [
        sum(tiles_of[i] for p in packs[j : j + batch] for i in p)
        for j in range(0, len(packs) - batch + 1, batch)
    ]
    return tiles_cv(len(sums), sum(sums), sum(x * x for x in sums))


def pipeline_seconds_per_sample() -> float:
    """Per-sample time of the wdsvlm stages on shards_example (one process, one thread)."""
    import torch
    import webdataset as wds

    from wdsvlm.pipeline import DecodeImages, Plan, ReadSamples, Tokenize, WorkerConfig

    torch.set_num_threads(1)
    example = os.path.join(REPO, "shards_example")
    pipe = wds.DataPipeline(
        Plan(example, worker_config=WorkerConfig()),
        ReadSamples(),
        DecodeImages(),
        Tokenize(os.path.join(example, "tokenizer")),
    )
    start = time.perf_counter()
    n = sum(1 for _ in pipe)
    return (time.perf_counter() - start) / n


def print_advice(runs, max_units: int, window: int, unit: str) -> None:
    """What the Loader logs at the end of an epoch, and ``wdsvlm stats`` prints, where the
    vision budget binds (the Loader's estimate; the budget ``stats`` measures by packing)."""
    from wdsvlm.pipeline.packer import budget_advice
    from wdsvlm.tools.dataset_stats import unbound_budget

    print(f"\nvision budget advice at {max_units} {unit} a pack:")
    for length, kept, stats in runs:
        figures = stats.as_dict()
        logged = budget_advice(figures, length, max_units, unit)
        if logged is None:
            print(f"{length:>10}  none (the budget does not bind)")
            continue
        measured = unbound_budget(kept, length, max_units, window, stats)
        print(f"{length:>10}  the Loader logs: {logged}")
        measured = budget_advice(figures, length, max_units, unit, measured)
        print(f"{'':>10}  wdsvlm stats: {measured}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=sorted(FAMILY_SIZES), default=None)
    parser.add_argument(
        "--vision-budget", type=int, default=None, help="units a pack may hold (--family)"
    )
    args = parser.parse_args()
    if args.family:
        mix = family_mix(args.samples, args.seed, args.family)
        max_units = args.vision_budget or (16384 if args.family.startswith("qwen") else 64)
        lengths = (2048, 4096, 8192)
    else:
        mix = realistic_mix(args.samples, args.seed)
        max_units, lengths = MAX_TILES_PER_PACK, LENGTHS
    random.Random(args.seed).shuffle(mix)
    per_sample = pipeline_seconds_per_sample()
    print(f"{args.samples} samples; padding fraction by strategy (lower is better):\n")
    print(
        f"{'max_length':>10} {'kept':>6} {'naive':>7} {'fixed':>7} {'greedy':>7} {'bfd':>7} "
        f"{'wdsvlm':>7} {'wdsvlm-bfd':>10} {'pack us/sample':>15} {'of pipeline':>11}"
    )
    cvs, advice = [], []
    if args.family:
        print(f"family {args.family}: vision budget {max_units} units a pack\n")
    for length in lengths:
        kept = [(t, k) for t, k in mix if t <= length and k <= max_units]
        ours, cost, packs = streaming(kept, length, max_units, args.window)
        tiles_of = [k for _, k in kept]
        cvs.append(
            (
                length,
                tiles_per_batch_cv(packs, tiles_of, True),
                tiles_per_batch_cv(packs, tiles_of, False),
            )
        )
        bfd = best_fit_decreasing(kept, length, max_units)
        advice.append((length, kept, streaming.stats))
        print(
            f"{length:>10} {len(kept) / len(mix):6.1%} {naive(kept, length):7.2%} "
            f"{fixed(kept, length):7.2%} {greedy(kept, length, max_units):7.2%} "
            f"{bfd:7.2%} {ours:7.2%} {100 * (ours - bfd):+9.2f}pp "
            f"{cost * 1e6:15.0f} {cost / per_sample:11.1%}"
        )
    print("\nvision load: coefficient of variation of tiles per batch of 8 packs")
    print(f"{'max_length':>10} {'balanced':>9} {'in pack order':>14}")
    for length, balanced, in_order in cvs:
        print(f"{length:>10} {balanced:9.3f} {in_order:14.3f}")
    if not args.family:
        print_pass_end(args.window, args.seed)
    print_advice(advice, max_units, args.window, "patches" if args.family else "tiles")
    print(f"\npipeline stages on shards_example: {per_sample * 1e3:.1f} ms per sample")


if __name__ == "__main__":
    main()
