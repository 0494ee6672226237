"""Mixture weights by tokens: what a sample's supervised tokens are estimated at, from its
index entry alone.

A mixture with ``weight_by="tokens"`` gives each source a share of the **supervised tokens**
(labels that are not ignored, what a batch's ``num_loss_tokens`` counts) rather than of the
samples. The plan still draws samples (``sources.py``), so each token weight becomes a sample
weight: ``weight / s``, ``s`` the source's mean supervised tokens per sample. ``s`` must be
the same number in every process that plans (every rank, worker and resume, on any topology),
so it comes from the index and from samples every process picks alike:

- an entry's **supervised text**: of a conversation, its answers (the index keeps each turn's
  characters, an optional system turn first, then user and assistant turns by turns, each
  answered: the answers are the last turn and every second one before it); of a document or
  caption (``kind`` and ``elements``, ``format/documents.py``), every text element (images
  are never supervised);
- its estimate: those characters at ``CHARS_PER_TOKEN``, plus one token for each answer's
  end-of-turn token (a caption's end token); a source's ``s``, the mean over the entries of up
  to ``MEASURED_SHARDS`` shards spread over its shard list (``spread_shards``);
- the Loader calibrates ``s`` per source with its tokenizer (``loader/sizing.py``): times the
  supervised tokens of a few samples, the same ones everywhere, read and tokenized, over their
  estimate; a sample that packing drops counts 0. A plan made without a Loader (``wdsvlm
  stats``) takes the index's estimate as it is.

A source heavy in supervised tokens comes in smaller chunks (``DataSource.chunk_cap``): the
pass interleaves the sources' chunk visits evenly, and so the tokens too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..errors import ShardFormatError, StorageError
from ..format.documents import IMAGE_ELEMENT, KINDS

log = logging.getLogger("wdsvlm.mixture")

WEIGHT_BY = ("samples", "tokens")
"""What a mixture's weights are shares of."""
CHARS_PER_TOKEN = 3.5
"""Characters of text a token stands for, before a tokenizer calibrates it."""
MEASURED_SHARDS = 64
"""Shards that stand for a source in an estimate from its index."""

_CAPTION = KINDS.index("caption")
_CONVERSATION = KINDS.index("conversation")


def check_weight_by(value: Any, where: str = "weight_by") -> str:
    if value not in WEIGHT_BY:
        raise ValueError(f"{where} must be one of {', '.join(map(repr, WEIGHT_BY))}, not {value!r}")
    return value


def supervised_text(entry: Mapping[str, Any]) -> tuple[int, int]:
    """``(characters, ends)`` of a sample's supervised text, from its index entry: its
    answers' characters and their count (each answer's end-of-turn token is supervised too),
    or a document's or caption's text characters and its end tokens (a caption's 1; a
    document's end token makes up for its first token, which nothing predicts)."""
    kind = entry.get("kind", _CONVERSATION)
    if kind == _CONVERSATION:
        turns = list(entry.get("chars", []))
        answers = turns[::-1][::2][: len(turns) // 2]  # the last turn, every second before
        return sum(answers), len(answers)
    elements = entry.get("elements")
    if elements is None:  # no elements kept: its chars are its texts
        chars = sum(entry.get("chars", []))
    else:
        chars = sum(n for n in elements if n != IMAGE_ELEMENT)
    return chars, int(kind == _CAPTION)


def supervised_estimate(entry: Mapping[str, Any]) -> float:
    """A sample's supervised tokens as its index entry estimates them (``supervised_text``
    at ``CHARS_PER_TOKEN``)."""
    chars, ends = supervised_text(entry)
    return chars / CHARS_PER_TOKEN + ends


def spread_shards(count: int, most: int = MEASURED_SHARDS) -> list[int]:
    """The shards (numbers of ``count``) that stand for a source: all, or ``most`` spread
    evenly over the list (the same ones in every process)."""
    if count <= most:
        return list(range(count))
    step = count / most
    return sorted({int(i * step) for i in range(most)})


def readable_entries(source: Any, shards: Iterable[int]) -> Iterable[tuple[int, list]]:
    """``(shard number, its entries)`` of the source's ``shards`` whose sidecars can be read;
    the others are left out with a warning (reading them will count or raise as the Loader's
    ``on_shard_error`` says)."""
    table = source.index["shards"]
    for s in shards:
        try:
            yield s, list(table[s]["entries"])
        except (ShardFormatError, StorageError) as e:
            log.warning("%s: estimated without shard %s: %s", source.name, table[s]["name"], e)


def index_supervised(source: Any) -> float:
    """A source's mean supervised tokens per sample as its index estimates them."""
    entries = [
        e
        for _, part in readable_entries(source, spread_shards(len(source.index["shards"])))
        for e in part
    ]
    return mean(supervised_estimate(e) for e in entries)


def mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def sample_weights(weight: Any, per_sample: float) -> Any:
    """A token ``weight`` (a number, or a schedule's ``(batch, weight)`` points) as the sample
    weight that gives it: over ``per_sample``, the source's mean supervised tokens per sample.
    A schedule's shares stay exact: each of its weights is divided by the same number."""
    if isinstance(weight, Sequence):
        return tuple((b, w / per_sample) for b, w in weight)
    return weight / per_sample


def by_tokens(
    sources: Sequence[Any], resolved: list[Any], supervised: Callable[[list], list[float]] | None
) -> list[Any]:
    """The ``Source``s with their token weights made sample weights: each over its source's mean
    supervised tokens per sample (``supervised(resolved)``, else the index's estimate), which
    each ``DataSource`` records, with its chunks' cap (``DataSource.chunk_cap``)."""
    if any(s.weight is None for s in sources):
        raise ValueError(
            'weight_by="tokens" goes with weight= on every source: the weights are then each '
            "source's share of the supervised tokens"
        )
    per_sample = supervised(resolved) if supervised else [index_supervised(r) for r in resolved]
    out = []
    for s, r, tokens in zip(sources, resolved, per_sample, strict=True):
        if not tokens > 0:
            raise ValueError(
                f"source {s.name}: its samples hold no supervised tokens (as estimated from "
                "its index), so it cannot have a share of them; weigh the mixture by samples"
            )
        r.supervised_per_sample = float(tokens)
        r.span_share = min(per_sample) / tokens
        out.append(replace(s, weight=sample_weights(s.weight, tokens)))
    return out
