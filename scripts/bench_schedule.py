"""Benchmark: how closely a Loader's batches follow a mixture's weight schedule.

    python scripts/bench_schedule.py [--out /tmp/wdsvlm-schedule] [--batches 800] [--window 200]
        [--batch-size 8] [--max-length 512]

Two text-only datasets of samples of similar size (``--samples`` each, written once under
``--out``); source ``a``'s weight goes from 1.0 to 0.2 over the first half of the run
(``schedule="linear"``), source ``b``'s stays at 1.0. The Loader (one rank, 0 workers, the
tokenizer of ``shards_example``, ``--batch-size`` rows of ``--max-length`` tokens) yields
``--batches`` batches; for every window of ``--window`` consecutive batches (sliding by 10)
the script compares ``a``'s share of the samples with the schedule's mean share over those
batches, and prints the worst window.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import wdsvlm  # noqa: E402
from wdsvlm.write.writer import write_dataset  # noqa: E402

TOKENIZER = os.path.join(os.path.dirname(HERE), "shards_example", "tokenizer")
WORDS = "the a cat dog sat on mat red blue green small large what where is are".split()


def text_dataset(folder: str, name: str, samples: int) -> str:
    out = os.path.join(folder, name)
    if os.path.exists(os.path.join(out, "index.json")):
        return out
    rng = random.Random(name)
    records = []
    for i in range(samples):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 12)))
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 12)))
        records.append(
            {
                "id": f"{name}-{i}",
                "conversations": [
                    {"from": "human", "value": question},
                    {"from": "gpt", "value": answer},
                ],
            }
        )
    os.makedirs(folder, exist_ok=True)
    source = os.path.join(folder, f"{name}.jsonl")
    with open(source, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    write_dataset(source, out, progress=False)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/wdsvlm-schedule")
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--batches", type=int, default=800)
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    args = parser.parse_args()
    half = args.batches // 2
    sources = [
        wdsvlm.Source(
            text_dataset(args.out, "a", args.samples), name="a", weight=[(0, 1.0), (half, 0.2)]
        ),
        wdsvlm.Source(text_dataset(args.out, "b", args.samples), name="b", weight=1.0),
    ]
    loader = wdsvlm.Loader(
        sources, TOKENIZER, max_length=args.max_length, batch_size=args.batch_size
    )
    schedule = loader.plan.schedule
    print(
        f"passes of {schedule.samples_per_pass} samples, {schedule.clock} batches each; "
        f"len(loader) {len(loader)}"
    )
    per_batch = []  # (samples of a, samples) per batch
    epoch = 0
    while len(per_batch) < args.batches:
        loader.set_epoch(epoch)
        for batch in loader:
            names = [s for row in batch["sample_sources"] for s in row]
            per_batch.append((names.count("a"), len(names)))
            if len(per_batch) == args.batches:
                break
        epoch += 1
    loader.close()
    worst = (0.0, 0, 0.0, 0.0)
    for start in range(0, args.batches - args.window + 1, 10):
        part = per_batch[start : start + args.window]
        got = sum(a for a, _ in part) / sum(n for _, n in part)
        want = sum(schedule.shares(t + 0.5)[0] for t in range(start, start + args.window))
        want /= args.window
        if abs(got - want) >= abs(worst[0]):
            worst = (got - want, start, got, want)
    samples = sum(n for _, n in per_batch) / len(per_batch)
    print(
        f"{args.batches} batches of {samples:.0f} samples on average; windows of "
        f"{args.window} batches: the worst is at batch {worst[1]}, a's share {worst[2]:.2%} "
        f"against the schedule's {worst[3]:.2%} ({100 * worst[0]:+.2f} points)"
    )


if __name__ == "__main__":
    main()
