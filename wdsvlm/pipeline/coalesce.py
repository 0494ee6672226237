"""Coalescing: neighbouring spans of one shard that a worker reads close together, fetched
with one request.

The read stage has up to ``read_ahead`` spans under way at once. A run of consecutive spans
of the plan, at most that many, is read with one ranged request when they are spans of one
shard (one URL, with the same storage options and source), and the range from the first byte
any of them needs to the last one is at most one request of the read policy
(``ReadPolicy.block_bytes``) and at most ``MORE`` times the bytes the spans need (what it adds
are the gaps between them). Each span is then cut out of the joined bytes: it gets exactly its
own bytes, in its place in the plan's order; a joined read that fails gives each of its spans
its error, as their own reads of that shard would have failed.

Where it pays (``scripts/bench_coalesce.py``): an evaluation loader reads each shard's chunks
one after the other, so neighbours follow each other; a training pass visits its chunks in a
keyed random order, so a chunk is rarely followed by its neighbour.
"""

from __future__ import annotations

from collections.abc import Iterator

MORE = 1.25
"""The most a joined read fetches, as a multiple of the bytes its spans need."""


def joinable(span: dict, other: dict) -> bool:
    """Whether two spans are reads of the same shard in the same way."""
    return (
        "failed" not in span
        and "failed" not in other
        and span["url"] == other["url"]
        and span.get("source") == other.get("source")
        and span.get("storage_options") == other.get("storage_options")
        and span.get("shard_sha256") == other.get("shard_sha256")
    )


def needed(ranges: list[tuple[int, int]]) -> int:
    """Bytes in the union of ``[start, stop)`` ranges (two passes may read the same chunk)."""
    total, end = 0, None
    for start, stop in sorted(ranges):
        if end is None or start >= end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def grouped(spans: Iterator[dict], block_bytes: int, window: int) -> Iterator[list[dict]]:
    """``spans`` in order, in runs that are each read with one request (most runs: one
    span). A run holds at most ``window`` spans and ends when the next span would not join
    it (see the module's docstring)."""
    group: list[dict] = []
    for span in spans:
        if group and not _joins(group, span, block_bytes, window):
            yield group
            group = []
        group.append(span)
        if len(group) >= window:  # full: no need to wait for the next span
            yield group
            group = []
    if group:
        yield group


def bounds(group: list[dict]) -> tuple[int, int]:
    """The joined read of a run: its first byte and the byte past its last."""
    return min(s["start"] for s in group), max(s["stop"] for s in group)


def _joins(group: list[dict], span: dict, block_bytes: int, window: int) -> bool:
    if len(group) >= window or not joinable(group[0], span):
        return False
    lo, hi = bounds([*group, span])
    if hi - lo > block_bytes:
        return False
    return hi - lo <= MORE * needed([(s["start"], s["stop"]) for s in [*group, span]])
