"""Measure how closely a mixture weighted by tokens keeps to its weights in the batches.

    python scripts/measure_token_shares.py [--out /tmp/wdsvlm-token-shares] [--batches 1000]
        [--window 200] [--batch-size 8] [--max-length 2048] [--weight-by tokens]
        [--shuffle-buffer N]

Three text-only conversation datasets (``wdsvlm/testing/conversations.py``, ``--samples``
each, written once under ``--out``) of very different supervised tokens per sample: ``short``
(one question, an answer of 3-8 words), ``medium`` (two questions, answers of 20-40 words) and
``long`` (three questions, answers of 60-120 words), weighted 0.5 / 0.3 / 0.2 by
``--weight-by``. A Loader (one rank, 0 workers, the tokenizer of ``shards_example``) yields
``--batches`` batches; every window of ``--window`` consecutive batches (sliding by 10) gives
each source's share of the supervised tokens (labels not ignored, ``num_loss_tokens``); the
script prints each source's estimated supervised tokens per sample, its share over all
batches, and the worst window.

``--mix pretraining`` weighs a recipe's kinds instead: ``captions`` (an image and 5-30 words),
``documents`` (20-1500 words and 0-4 images, cut into pieces at ``--max-length``) and the
``long`` conversations, 0.5 / 0.3 / 0.2 (``wdsvlm/testing/documents.py``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import wdsvlm  # noqa: E402
from wdsvlm.loader.report import supervised_by_source  # noqa: E402
from wdsvlm.testing.conversations import conversation_dataset  # noqa: E402
from wdsvlm.testing.documents import random_documents, write_documents  # noqa: E402

TOKENIZER = os.path.join(os.path.dirname(HERE), "shards_example", "tokenizer")
WEIGHTS = {"short": 0.5, "medium": 0.3, "long": 0.2}
SHAPES = {"short": (1, (3, 8)), "medium": (2, (20, 40)), "long": (3, (60, 120))}


def mixture(folder: str, samples: int, weight_by: str = "tokens") -> list[wdsvlm.Source]:
    """The three sources, weighted as ``WEIGHTS`` (``samples`` conversations each)."""
    return [
        wdsvlm.Source(
            conversation_dataset(folder, name, samples, turns, answer, samples_per_shard=500),
            name=name,
            weight=WEIGHTS[name],
        )
        for name, (turns, answer) in SHAPES.items()
    ]


PRETRAINING = {"captions": 0.5, "documents": 0.3, "long": 0.2}


def pretraining_mixture(folder: str, samples: int) -> list[wdsvlm.Source]:
    """Captions, documents and long conversations, weighted as ``PRETRAINING``."""
    made = {
        "captions": lambda: random_documents(samples, seed=1, caption_share=1.0),
        "documents": lambda: random_documents(samples, seed=2, words=(20, 1500), images=(0, 4)),
    }
    sources = []
    for name, make in made.items():
        path = os.path.join(folder, name)
        if not os.path.exists(os.path.join(path, "index.json")):
            write_documents(path, make(), per_shard=500, source=name)
        sources.append(wdsvlm.Source(path, name=name, weight=PRETRAINING[name]))
    turns, answer = SHAPES["long"]
    path = conversation_dataset(folder, "long", samples, turns, answer, samples_per_shard=500)
    return sources + [wdsvlm.Source(path, name="long", weight=PRETRAINING["long"])]


def supervised_per_batch(loader: wdsvlm.Loader, batches: int) -> list[dict[str, int]]:
    """Each of the first ``batches`` batches' supervised tokens per source, epoch after epoch."""
    out: list[dict[str, int]] = []
    epoch = 0
    while len(out) < batches:
        loader.set_epoch(epoch)
        for batch in loader:
            out.append(dict(supervised_by_source(batch)))
            if len(out) == batches:
                break
        epoch += 1
    return out


def worst_windows(
    per_batch: list[dict[str, int]], weights: dict[str, float], window: int, step: int = 10
) -> dict[str, tuple[float, int]]:
    """Per source, the largest distance (in share) of its supervised-token share over a window
    of ``window`` batches from its weight, and the window's first batch."""
    worst = {name: (0.0, 0) for name in weights}
    total = sum(weights.values())
    for start in range(0, len(per_batch) - window + 1, step):
        part = per_batch[start : start + window]
        tokens = {name: sum(b.get(name, 0) for b in part) for name in weights}
        every = sum(tokens.values())
        for name, weight in weights.items():
            off = tokens[name] / every - weight / total
            if abs(off) > abs(worst[name][0]):
                worst[name] = (off, start)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/wdsvlm-token-shares")
    parser.add_argument("--samples", type=int, default=4000)
    parser.add_argument("--batches", type=int, default=1000)
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--weight-by", default="tokens", choices=("samples", "tokens"))
    parser.add_argument("--shuffle-buffer", type=int, default=None)
    parser.add_argument("--mix", default="conversations", choices=("conversations", "pretraining"))
    args = parser.parse_args()
    folder = os.path.join(args.out, str(args.samples))
    if args.mix == "pretraining":
        sources, weights = pretraining_mixture(folder, args.samples), PRETRAINING
    else:
        sources, weights = mixture(folder, args.samples), WEIGHTS
    began = time.perf_counter()
    loader = wdsvlm.Loader(
        sources,
        TOKENIZER,
        max_length=args.max_length,
        batch_size=args.batch_size,
        weight_by=args.weight_by,
        shuffle_buffer=args.shuffle_buffer,
        tile_size=32,  # small tiles: the images' decoding is not what is measured
        max_image_side=64,
    )
    built = time.perf_counter() - began
    per_batch = supervised_per_batch(loader, args.batches)
    loader.close()
    estimates = {s.name: s.supervised_per_sample for s in loader.plan.sources}
    worst = worst_windows(per_batch, weights, args.window)
    every = {name: sum(b.get(name, 0) for b in per_batch) for name in weights}
    total = sum(every.values())
    print(
        f"weights by {args.weight_by}; Loader built in {built:.1f} s; {args.batches} batches of "
        f"{args.batch_size} x {args.max_length}, {total / args.batches:.0f} supervised tokens a "
        "batch"
    )
    for name, weight in weights.items():
        estimate = estimates[name]
        off, start = worst[name]
        print(
            f"  {name:<9} weight {weight:.2f}: "
            + (f"{estimate:.1f} supervised tokens a sample (estimated), " if estimate else "")
            + f"share {every[name] / total:.2%} of all batches, worst window of {args.window} "
            f"at batch {start}: {100 * off:+.2f} points"
        )
    print(f"worst window: {100 * max(abs(off) for off, _ in worst.values()):.2f} points")


if __name__ == "__main__":
    main()
