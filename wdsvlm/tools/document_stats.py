"""What ``wdsvlm stats`` says of a dataset's documents and captions: the distributions of
their lengths, images and pieces, and the images dropped on the way.

Each document is counted from the pieces the Loader's own ``Tokenize`` cuts it into (at the
``max_length`` and vision budget given): ``stats`` tokenizes every sample it reads anyway, to
count tokens and pack them, so its pieces are the Loader's, not an estimate (the Loader's
``Documents.estimated``, from the index alone, is what sizes an epoch before reading it).
What the index already knows is taken from it: a document's kind, its characters (its
elements' numbers) and its images.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..format.documents import IMAGE_ELEMENT, KINDS

OVER_BUDGET = "image_over_budget"  # the tokenizer's reason for an image that fits no piece


def summary(values: Iterable[float]) -> dict:
    """Mean, median, 95th percentile and maximum of ``values`` (0 for none)."""
    a = np.asarray(list(values), dtype=np.float64)
    if not len(a):
        return {"mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0}
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p95": float(np.percentile(a, 95)),
        "max": int(a.max()),
    }


class DocumentTally:
    """The documents and captions of the pieces ``add``-ed, each once (its pieces share its
    source, shard, key and place in the pass)."""

    def __init__(self) -> None:
        self.kinds: dict[tuple, str] = {}
        self.chars: dict[tuple, int] = {}
        self.images: dict[tuple, int] = {}
        self.kept_images: Counter = Counter()
        self.tokens: Counter = Counter()
        self.pieces: Counter = Counter()

    def add(self, piece: Mapping[str, Any]) -> None:
        """Count one piece (a tokenized sample with ``__piece__``)."""
        key = (piece.get("__source__"), piece["__shard__"], piece["__key__"], piece.get("__pos__"))
        meta = piece.get("__meta__", {})
        if key not in self.kinds:
            self.kinds[key] = KINDS[meta.get("kind", 1)]
            if "elements" in meta:  # from the index: what the document holds as stored
                self.chars[key] = sum(n for n in meta["elements"] if n != IMAGE_ELEMENT)
                self.images[key] = sum(n == IMAGE_ELEMENT for n in meta["elements"])
        if "elements" not in meta:  # an index without elements: what its pieces hold
            self.chars[key] = self.chars.get(key, 0) + sum(meta.get("chars", []))
            self.images[key] = self.images.get(key, 0) + len(piece["image_tiles"])
        self.kept_images[key] += len(piece["image_tiles"])
        self.tokens[key] += int(piece["num_tokens"])
        self.pieces[key] += 1

    def __len__(self) -> int:
        return len(self.kinds)

    def as_dict(self, skipped: Mapping[str, int], totals: Iterable[Mapping[str, Any]]) -> dict:
        """The figures: ``skipped`` (the tokenizer's counts) gives the images dropped for
        fitting no piece; ``totals`` (each source's index totals), what the writer dropped."""
        keys = list(self.kinds)
        kinds = Counter(self.kinds.values())
        written: Counter = Counter()
        left_out = 0
        for t in totals:
            written.update(t.get("dropped_images", {}))
            left_out += t.get("left_out_captions", 0)
        return {
            "documents": kinds["document"],
            "captions": kinds["caption"],
            "chars_per_document": summary(self.chars[k] for k in keys),
            "tokens_per_document": summary(self.tokens[k] for k in keys),
            "images_per_document": {
                **summary(self.images[k] for k in keys),
                "counts": dict(sorted(Counter(self.images[k] for k in keys).items())),
            },
            "pieces_per_document": {
                **summary(self.pieces[k] for k in keys),
                "counts": dict(sorted(Counter(self.pieces[k] for k in keys).items())),
            },
            "dropped_images": {OVER_BUDGET: int(skipped.get(OVER_BUDGET, 0))},
            "dropped_when_written": {
                "dropped_images": dict(sorted(written.items())),
                "left_out_captions": left_out,
            },
        }


def _spread(d: Mapping[str, Any], digits: int = 0) -> str:
    return (
        f"mean {d['mean']:.{max(digits, 0)}f}, p50 {d['p50']:.0f}, p95 {d['p95']:.0f}, "
        f"max {d['max']}"
    )


def _counts(counts: Mapping[int, int], shown: int = 8) -> str:
    items = sorted(counts.items())
    text = ", ".join(f"{k}: {n}" for k, n in items[:shown])
    if len(items) > shown:
        text += f", {items[shown][0]}+: {sum(n for _, n in items[shown:])}"
    return text


def table_rows(d: Mapping[str, Any], cut: str) -> list[tuple[str, str]]:
    """The rows of ``stats``'s table for the documents' figures ``d`` (``as_dict``); ``cut``
    says at what the pieces were cut."""
    images, pieces = d["images_per_document"], d["pieces_per_document"]
    written = d["dropped_when_written"]
    lost = written["dropped_images"]
    when_written = (
        f"{sum(lost.values())} images ({', '.join(f'{r}: {n}' for r, n in lost.items())})"
        if lost
        else "no image"
    )
    when_written += f", {written['left_out_captions']} captions left out (index totals)"
    return [
        (
            "documents",
            f"{d['documents']} documents, {d['captions']} captions (each piece a sample)",
        ),
        ("characters per document", _spread(d["chars_per_document"]) + " (from the index)"),
        ("tokens per document", _spread(d["tokens_per_document"])),
        ("images per document", f"mean {images['mean']:.2f}, {_counts(images['counts'])}"),
        (
            "pieces per document",
            f"mean {pieces['mean']:.2f}, {_counts(pieces['counts'])} ({cut})",
        ),
        ("images dropped", f"{d['dropped_images'][OVER_BUDGET]} fit no piece ({OVER_BUDGET})"),
        ("dropped when written", when_written),
    ]
