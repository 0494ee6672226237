"""Counting what the pipeline skips: per reason, with shard and key, and a cap on runs of
failures so that a systematic fault becomes one clear error instead of an empty epoch."""

from __future__ import annotations

import logging
from collections import Counter

from ..errors import TooManyFailuresError
from ..storage.fs import RequestCounts

log = logging.getLogger("wdsvlm.stats")


def sample_name(sample: dict) -> str:
    """``"SHARD/KEY"``: how messages, stats and batches name a sample."""
    return f"{sample.get('__shard__', '?')}/{sample.get('__key__', '?')}"


def tally(
    counts: Counter,
    examples: dict[str, list[str]],
    keep: int,
    reason: str,
    sample: dict,
    detail: str,
    verb: str,
    logger: logging.Logger,
) -> str:
    """Count one sample (a dict with ``__shard__`` and ``__key__``) under ``reason``, keep its
    ``"SHARD/KEY"`` among the first ``keep`` of that reason, and log the first one of each
    reason (``verb``: what happens to it, "skipping", "dropping"). Returns ``"SHARD/KEY"``."""
    where = sample_name(sample)
    counts[reason] += 1
    kept = examples.setdefault(reason, [])
    if len(kept) < keep:
        kept.append(where)
    if counts[reason] == 1:
        logger.warning(
            "%s %s: %s: %s (further %s samples are counted, not logged)",
            verb,
            where,
            reason,
            detail,
            reason,
        )
    return where


class SkipStats:
    """Skipped samples of one worker process, shared by the stages it runs, and what its
    reads asked of the stores.

    ``counts`` is exact; ``examples`` keeps the first ``keep_examples`` ``"SHARD/KEY"`` per
    reason. Each reason is logged once, at its first occurrence. ``max_consecutive``
    failures in a row in one stage raise ``TooManyFailuresError``. ``requests``: a
    ``storage.fs.RequestCounts`` per source (``None``: a dataset read alone), added to by
    the read stage as it takes each span.
    """

    def __init__(self, max_consecutive: int = 100, keep_examples: int = 1000):
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be at least 1, not {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.keep_examples = keep_examples
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, list[str]] = {}
        self._in_a_row: Counter[str] = Counter()
        self.requests: dict[str | None, RequestCounts] = {}

    def requests_of(self, source: str | None) -> RequestCounts:
        """Where the reads of ``source`` are counted (made on first use, by any thread)."""
        counts = self.requests.get(source)
        return counts if counts is not None else self.requests.setdefault(source, RequestCounts())

    def skip(
        self, stage: str, reason: str, sample: dict, detail: str, *, streak: bool = True
    ) -> None:
        """Count one skipped sample (a dict with ``__shard__`` and ``__key__``); ``streak``:
        whether it counts towards the cap on failures in a row (not for samples skipped
        because their whole shard could not be read, which is reported once)."""
        where = tally(
            self.counts, self.examples, self.keep_examples, reason, sample, detail, "skipping", log
        )
        if not streak:
            return
        self._in_a_row[stage] += 1
        if self._in_a_row[stage] >= self.max_consecutive:
            raise TooManyFailuresError(
                f"{self._in_a_row[stage]} samples in a row failed in the {stage} stage; the "
                f"last: {where} ({reason}: {detail}). This looks systematic, not a few bad "
                f"samples: check {sample.get('__url__', where)}"
            )

    def reset(self) -> None:
        """Start counting afresh (a new epoch)."""
        self.counts.clear()
        self.examples.clear()
        self._in_a_row.clear()
        for counts in list(self.requests.values()):  # kept: reads under way add to them
            counts.add(**{name: -n for name, n in counts.figures().items()})

    def ok(self, stage: str) -> None:
        """A sample passed ``stage``: its run of failures is over."""
        self._in_a_row[stage] = 0

    def as_dict(
        self, examples: int | None = None, source: str | None = None, timed: bool = True
    ) -> dict:
        """Counts per reason and ``"SHARD/KEY"`` examples (the first ``examples`` per reason,
        or all that are kept), and the requests per source (``source``: the name of a dataset
        read alone): with ``timed``, their seconds and the cache's hits too."""
        requests = {
            source if k is None else k: v.figures() if timed else v.as_dict()
            for k, v in self.requests.items()
        }
        return {
            "skipped": dict(sorted(self.counts.items())),
            "examples": {k: list(v[:examples]) for k, v in sorted(self.examples.items())},
            "requests": {k: requests[k] for k in sorted(requests, key=str)},
        }

    def merge(self, other: dict) -> None:
        """Add the ``as_dict()`` of another worker's stats."""
        for source, counts in other.get("requests", {}).items():
            self.requests_of(source).add(**counts)
        for reason, n in other.get("skipped", {}).items():
            self.counts[reason] += n
            kept = self.examples.setdefault(reason, [])
            kept.extend(other.get("examples", {}).get(reason, [])[: self.keep_examples - len(kept)])
