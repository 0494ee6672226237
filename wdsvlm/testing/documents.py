"""Small datasets of documents and captions for tests and benchmarks, written here as
``wdsvlm write`` lays them out (``KEY.json`` with ``kind`` and ``elements``, images
``KEY.n.png``) with their index: no input files, no download.

``random_documents`` draws a mix of web-like documents (texts of random words, images of
random sizes between them); ``write_documents`` writes any list of them.
"""

from __future__ import annotations

import io
import math
import os
import random
from collections.abc import Sequence

from ..format.builder import Totals, publish_root, publish_sidecar, root_index, sample_entry
from ..format.documents import document_json, element_numbers
from ..format.tarball import HashingTarWriter

WORDS = (
    "the a cat dog river city market light paper garden window stone morning music train "
    "old new small large red green blue quiet busy near far under over through"
).split()


def image_png(width: int, height: int, seed: int = 0) -> bytes:
    """A ``width`` x ``height`` PNG of a gradient with a seeded tint."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    tint = rng.integers(0, 255, 3)
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    pixels = ((x + y) / 2 * 0.5 + tint * 0.5).astype(np.uint8)  # [height, width, 3]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def random_documents(
    count: int,
    seed: int = 0,
    words: tuple[int, int] = (20, 600),
    images: tuple[int, int] = (0, 4),
    sizes: Sequence[tuple[int, int]] = ((64, 48), (32, 32), (96, 64), (48, 80)),
    caption_share: float = 0.0,
    log_words: bool = False,
) -> list[dict]:
    """``count`` documents ``{"kind", "elements", "sizes"}``: between ``words`` words of text
    in paragraphs and ``images`` images (of ``sizes``) placed between them; a
    ``caption_share`` of them captions (one image, a short text). ``log_words``: the number
    of words drawn log-uniformly between the bounds (as many documents of 100 to 1,000 words
    as of 1,000 to 10,000, as web documents run), else uniformly."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if rng.random() < caption_share:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30)))
            out.append(
                {
                    "kind": "caption",
                    "elements": [{"image": 0}, {"text": text}],
                    "sizes": [rng.choice(sizes)],
                }
            )
            continue
        n_words = (
            round(math.exp(rng.uniform(math.log(words[0]), math.log(words[1]))))
            if log_words
            else rng.randint(*words)
        )
        n_images = rng.randint(*images)
        paragraphs = []
        left = n_words
        while left > 0:
            k = min(left, rng.randint(10, 120))
            paragraphs.append(" ".join(rng.choice(WORDS) for _ in range(k)))
            left -= k
        slots = [rng.randint(0, len(paragraphs)) for _ in range(n_images)]
        elements, shown = [], 0
        for i, paragraph in enumerate(paragraphs + [None]):
            for _ in range(slots.count(i)):
                elements.append({"image": shown})
                shown += 1
            if paragraph is not None:
                elements.append({"text": paragraph})
        out.append(
            {
                "kind": "document",
                "elements": elements,
                "sizes": [rng.choice(sizes) for _ in range(n_images)],
            }
        )
    return out


def write_documents(
    output: str, docs: Sequence[dict], per_shard: int = 100, source: str = "docs"
) -> str:
    """Write ``docs`` (``{"kind", "elements", "sizes"}`` each, images drawn at those sizes)
    as shards with their index under ``output``; returns ``output``."""
    os.makedirs(output, exist_ok=True)
    shards, totals = [], Totals()
    for first in range(0, len(docs), per_shard):
        name = f"data-{first // per_shard:06d}.tar"
        entries = []
        with open(os.path.join(output, name), "wb") as f:
            tar = HashingTarWriter(f)
            for i, doc in enumerate(docs[first : first + per_shard], first):
                key = f"{i:09d}"
                start = tar.offset
                tar.member(f"{key}.json", document_json(key, doc["kind"], doc["elements"], source))
                for n, (w, h) in enumerate(doc["sizes"]):
                    tar.member(f"{key}.{n}.png", image_png(w, h, seed=i * 31 + n))
                chars = [len(e["text"]) for e in doc["elements"] if "text" in e]
                numbers = element_numbers(doc["elements"])
                entries.append(
                    sample_entry(
                        key,
                        start,
                        tar.offset - start,
                        doc["sizes"],
                        chars,
                        (),
                        doc["kind"],
                        numbers,
                    )
                )
                totals.add(len(doc["sizes"]), chars, source, kind=doc["kind"])
            tar.close()
        shards.append(publish_sidecar(output, name, entries, tar.offset, tar.digest.hexdigest()))
    publish_root(output, root_index(shards, totals, {}, prefix="data"))
    return output
