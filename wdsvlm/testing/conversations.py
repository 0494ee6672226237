"""Text-only conversation datasets of chosen lengths, written with ``write_dataset``: a mixture
whose sources differ in supervised tokens per sample (short answers, long multi-turn ones),
for tests and benchmarks of weights by tokens. The same arguments give the same dataset."""

from __future__ import annotations

import json
import os
import random

WORDS = (
    "the a cat dog sat on mat red blue green small large what where is are house tree "
    "river walked quickly under over bright dark picture shows people standing near"
).split()


def conversation_dataset(
    folder: str,
    name: str,
    samples: int,
    turns: int,
    answer_words: tuple[int, int],
    question_words: tuple[int, int] = (6, 12),
    samples_per_shard: int | None = None,
) -> str:
    """The dataset ``folder/name`` of ``samples`` conversations of ``turns`` questions, each
    answered with ``answer_words`` (least, most) words drawn at random; written once (kept
    when its index is there)."""
    out = os.path.join(folder, name)
    if os.path.exists(os.path.join(out, "index.json")):
        return out
    rng = random.Random(f"{name}-{samples}-{turns}-{answer_words}")

    def words(least_most: tuple[int, int]) -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(*least_most)))

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{name}.jsonl")
    with open(path, "w") as f:
        for i in range(samples):
            turns_of = []
            for _ in range(turns):
                turns_of.append({"from": "human", "value": words(question_words)})
                turns_of.append({"from": "gpt", "value": words(answer_words)})
            f.write(json.dumps({"id": f"{name}-{i}", "conversations": turns_of}) + "\n")
    from ..write.writer import write_dataset

    options = {} if samples_per_shard is None else {"samples_per_shard": samples_per_shard}
    write_dataset(path, out, progress=False, **options)
    return out
