"""Benchmark: padding of the Loader's packing of documents against offline best-fit-decreasing.

    python scripts/bench_documents.py [--documents 2000] [--window 500] [--seed 0]
        [--family qwen2_5_vl|qwen3_vl|smolvlm] [--lengths 4096 8192] [--budgets-per-token 3 4]

The mix (``wdsvlm.testing.documents.random_documents``): web-like documents of 45 to 8,800
words drawn log-uniformly (100 to 20,000 text tokens of the family's tokenizer), 0 to 30
images each (uniformly), of web-like sizes (sides 200 to 2000 px, aspect ratios 1:3 to 3:1)
at the family's published image settings. Each document goes through the real ``Tokenize``
stage with the Loader's ``max_length`` and vision budget (``max_units``), which cuts it into
pieces (``pipeline/documents.py``); the pieces, in the order Tokenize yields them (a
document's pieces one after another, documents in their random order), go through the
Loader's ``Pack`` stage (its window, its budgets, drained at the end as at a pass end).
Offline best-fit-decreasing packs the same pieces under the same budgets. The vision budget
is ``--budgets-per-token`` units per token of ``max_length``: Qwen's image token is 4 patches,
so 3 patches a token lets images fill three quarters of a row (the budget ends packs and cuts
image-heavy documents) and 4 a whole row (it never binds before the tokens do).

Printed per ``max_length``: the pieces per document (min, median, p90, max, share of
documents cut), the fill (1 - padding) of BFD and of the Loader's packing, and the gap.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from wdsvlm.format.documents import document_json  # noqa: E402
from wdsvlm.pipeline.pack import Pack, vision_units  # noqa: E402
from wdsvlm.pipeline.packer import best_fit_decreasing  # noqa: E402
from wdsvlm.pipeline.stats import SkipStats  # noqa: E402
from wdsvlm.testing.documents import random_documents  # noqa: E402

# the published image settings of each family (its preprocessor_config.json)
FAMILY_SIZES = {
    "qwen2_5_vl": {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280},
    "qwen3_vl": {"min_pixels": 256 * 256, "max_pixels": 4096 * 4096},
    "smolvlm": {"size": {"longest_edge": 4 * 384}, "max_image_size": {"longest_edge": 384}},
}
WORDS = (45, 8800)  # 100 to 20,000 tokens of the tiny tokenizer (2.28 tokens a word)
IMAGES = (0, 30)


def family_named(name: str):
    from wdsvlm.families.registry import family_of
    from wdsvlm.testing.tiny import tiny_processor

    processor = tiny_processor(name, **FAMILY_SIZES[name])
    if name == "smolvlm":
        processor.image_seq_len = 81  # SmolVLM-Instruct's: 384-px tiles, 81 tokens each
    return family_of(processor)


def web_sizes(count: int, seed: int) -> list[tuple[int, int]]:
    """``count`` image sizes: sides 200 to 2000 px, aspect ratios 1:3 to 3:1."""
    rng = random.Random(f"sizes/{seed}")
    out = []
    for _ in range(count):
        side = rng.uniform(200, 2000)
        aspect = math.exp(rng.uniform(-math.log(3), math.log(3)))
        root = math.sqrt(aspect)
        out.append((max(1, round(side * root)), max(1, round(side / root))))
    return out


def document_mix(count: int, seed: int, words=WORDS, images=IMAGES) -> list[dict]:
    """The benchmark's documents (``random_documents``, log-uniform words)."""
    return random_documents(
        count, seed, words=words, images=images, sizes=web_sizes(500, seed), log_words=True
    )


def samples_of(docs: list[dict]) -> list[dict]:
    """The documents as the reader hands them to Tokenize: ``KEY.json``, the image members
    and the index's image sizes (``__meta__``). Tokenize sizes images by the index alone, so
    the members hold no pixels here."""
    out = []
    for i, doc in enumerate(docs):
        key = f"{i:09d}"
        sample = {"__key__": key, "__shard__": "bench.tar"}
        sample["json"] = document_json(key, doc["kind"], doc["elements"], "bench")
        for n in range(len(doc["sizes"])):
            sample[f"{n}.png"] = b""
        sample["__meta__"] = {"images": [list(s) for s in doc["sizes"]]}
        out.append(sample)
    return out


def pieces_of(
    samples: list[dict], family, max_length: int, max_units: int | None, stats=None
) -> list[dict]:
    """The pieces the Loader's Tokenize makes of ``samples``, in its order; only what packing
    reads is kept of each (its key, number, tokens, vision units), and where its images are.
    ``stats`` (a ``SkipStats``) counts what Tokenize skips or drops."""
    from wdsvlm.pipeline.tokenize import Tokenize

    stage = Tokenize(family=family, max_length=max_length, max_units=max_units, stats=stats)
    out = []
    for piece in stage(iter(samples)):
        out.append(
            {
                "__key__": piece["__key__"],
                "__piece__": piece["__piece__"],
                "num_tokens": piece["num_tokens"],
                "image_tiles": list(piece["image_tiles"]),
                "image_at": list(piece["image_at"]),
                "sizes": piece["__meta__"]["images"],
            }
        )
    return out


def loader_fill(pieces: list[dict], max_length: int, max_units: int | None, window: int):
    """Fill of the Loader's Pack stage over ``pieces`` (in order), and its packing figures."""
    run = Pack(max_length, max_tiles_per_pack=max_units, window=window)(iter(pieces))
    packs = list(run)
    assert sum(len(p) for p in packs) == len(pieces), "every piece packed once"
    return run.stats.fill, run.stats


def bfd_fill(pieces: list[dict], max_length: int, max_units: int | None) -> float:
    """Fill of offline best-fit-decreasing over the same pieces and budgets."""
    tokens = [p["num_tokens"] for p in pieces]
    tiles = [vision_units(p) for p in pieces]
    packs = best_fit_decreasing(tokens, tiles, max_length, max_units or 1 << 62)
    return sum(tokens) / (len(packs) * max_length)


def per_document(pieces: list[dict]) -> dict:
    """Pieces per document: min, median, p90, max and the share of documents cut."""
    counts: dict[str, int] = {}
    for p in pieces:
        counts[p["__key__"]] = counts.get(p["__key__"], 0) + 1
    values = sorted(counts.values())
    return {
        "min": values[0],
        "median": statistics.median(values),
        "p90": values[int(0.9 * (len(values) - 1))],
        "max": values[-1],
        "cut": sum(1 for v in values if v > 1) / len(values),
    }


def document_lengths(pieces: list[dict]) -> list[int]:
    """Each document's tokens (its pieces' together: the whole document's, see documents.py)."""
    totals: dict[str, int] = {}
    for p in pieces:
        totals[p["__key__"]] = totals.get(p["__key__"], 0) + p["num_tokens"]
    return sorted(totals.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--window", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=sorted(FAMILY_SIZES), default="qwen2_5_vl")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument(
        "--budgets-per-token",
        type=float,
        nargs="+",
        default=[3.0, 4.0],
        help="vision budgets, in units a token of max_length",
    )
    args = parser.parse_args()
    family = family_named(args.family)
    samples = samples_of(document_mix(args.documents, args.seed))
    print(
        f"{args.documents} documents, {args.family}, window {args.window}: {WORDS[0]}-{WORDS[1]}"
        f" words (log-uniform), {IMAGES[0]}-{IMAGES[1]} images each\n"
    )
    print(
        f"{'max_length':>10} {'budget':>7} {'pieces':>7} {'per doc min/med/p90/max':>24} "
        f"{'cut':>6} {'bfd fill':>9} {'wdsvlm':>8} {'gap':>8} {'bound':>6} {'s':>5}"
    )
    skips = SkipStats()
    for length, per_token in [(n, b) for n in args.lengths for b in args.budgets_per_token]:
        budget = int(per_token * length)
        start = time.perf_counter()
        pieces = pieces_of(samples, family, length, budget, skips)
        ours, stats = loader_fill(pieces, length, budget, args.window)
        bfd = bfd_fill(pieces, length, budget)
        d = per_document(pieces)
        spread = f"{d['min']}/{d['median']:g}/{d['p90']}/{d['max']}"
        print(
            f"{length:>10} {budget:>7} {len(pieces):>7} {spread:>24} {d['cut']:6.1%} "
            f"{bfd:9.2%} {ours:8.2%} {100 * (bfd - ours):+7.2f}pp "
            f"{stats.vision_bound / stats.packs:6.1%} {time.perf_counter() - start:5.0f}"
        )
    lengths = document_lengths(pieces)
    print(
        f"\ndocument tokens (text and images): min {lengths[0]}, median "
        f"{statistics.median(lengths):g}, max {lengths[-1]}; images over every budget "
        f"(dropped, all runs): {skips.counts['image_over_budget']}"
    )


if __name__ == "__main__":
    main()
