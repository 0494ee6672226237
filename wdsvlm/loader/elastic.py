"""Elastic resume: the states of all ranks of a run, handed to another topology exactly.

A sample's place ``[pass, place]`` is in the pass's global order, the same on any topology
(``plan.py``). So the states of all old ranks say exactly which planned samples were not yet
yielded: for each old global worker, what it had left to read (the rest of its share, and
any segments handed to it) and the places its buffers held (shuffle buffer, tokenizer batch,
packing window, packs waiting for a batch: ``WorkerState.held_places``). Passes that no old
worker had begun are whole.

Those unread places, pass by pass, are merged into sorted ranges and split into contiguous,
near-equal parts over the new global workers; each new worker reads its part of each
unfinished pass first, then its own share of every later pass. Every planned sample not yet
yielded comes once, nothing yielded comes again. A document some of whose pieces were yielded
is not read again whole: its pieces still held (``[pass, place, piece]``) are split over the
new global workers likewise, each held by its tokenizer stage, which yields them first. The
new states hold ranges, not samples: O(old global workers + what the old buffers held).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..pipeline.plan import worker_share
from .state import LoaderState, WorkerState


def unread_ranges(
    workers: Sequence[WorkerState], pass_size: int, pieces: list | None = None
) -> tuple[dict[int, list[list[int]]], int]:
    """The places not yet yielded by the old global workers (their stream states, in global
    worker order), as sorted disjoint ranges per pass; and the first pass no worker had
    begun (whole from there on). Overlapping places mean the states are not of one step of
    one run, and are refused. The pieces of documents held (``[pass, place, piece]``: the
    document's other pieces were yielded) go to ``pieces``, sorted, not into the ranges."""
    old = len(workers)
    held_pieces = set()
    later = max(w.read.next for w in workers)
    by_pass: dict[int, list[list[int]]] = {}
    for number, worker in enumerate(workers):
        read = worker.read
        for pass_, ranges in read.segments:
            by_pass.setdefault(pass_, []).extend([a, b] for a, b in ranges if a < b)
        for pass_ in range(read.next, later):
            start, stop = worker_share(pass_size, number, old)
            if start < stop:
                by_pass.setdefault(pass_, []).append([start, stop])
        for held in worker.held_places():
            if len(held) == 3:
                if tuple(held) in held_pieces:
                    raise ValueError(
                        f"the loader states overlap (pass {held[0]}, place {held[1]}, piece "
                        f"{held[2]} is in two of them): they are not the states of all ranks "
                        "of one run at one step"
                    )
                held_pieces.add(tuple(held))
                continue
            pass_, place = held
            by_pass.setdefault(pass_, []).append([place, place + 1])
    merged = {}
    for pass_, ranges in sorted(by_pass.items()):
        ranges.sort()
        out: list[list[int]] = []
        for a, b in ranges:
            if out and a < out[-1][1]:
                raise ValueError(
                    f"the loader states overlap (pass {pass_}, place {a} is in two of them): "
                    "they are not the states of all ranks of one run at one step"
                )
            if out and a == out[-1][1]:
                out[-1][1] = b
            else:
                out.append([a, b])
        merged[pass_] = out
    for p, place, _ in held_pieces:  # a document both whole and in pieces: not one step
        if any(a <= place < b for a, b in merged.get(p, ())):
            raise ValueError(
                f"the loader states overlap (pass {p}, place {place} is held whole and in "
                "pieces): they are not the states of all ranks of one run at one step"
            )
    if pieces is not None:
        pieces[:] = [list(h) for h in sorted(held_pieces)]
    return merged, later


def split(ranges: Sequence[Sequence[int]], part: int, parts: int) -> list[list[int]]:
    """Part ``part`` of ``parts`` contiguous, near-equal parts of the places in ``ranges``."""
    total = sum(b - a for a, b in ranges)
    first, stop = worker_share(total, part, parts)
    out, seen = [], 0
    for a, b in ranges:
        lo, hi = max(a, a + first - seen), min(b, a + stop - seen)
        if lo < hi:
            out.append([lo, hi])
        seen += b - a
    return out


def remap(
    states: Sequence[LoaderState],
    pass_size: int,
    rank: int,
    world_size: int,
    workers_per_rank: int,
) -> list[WorkerState]:
    """This rank's worker states (one per DataLoader worker) on the new topology, from the
    loader states of all ranks of the old run (rank order)."""
    old = [worker for state in states for worker in state.workers]
    pieces: list = []
    unread, later = unread_ranges(old, pass_size, pieces)
    new_workers = world_size * workers_per_rank
    out = []
    for slot in range(workers_per_rank):
        number = rank * workers_per_rank + slot
        segments = []
        for pass_, ranges in unread.items():
            part = split(ranges, number, new_workers)
            if part:
                segments.append([pass_, part])
        state = WorkerState.fresh(later, segments)
        first, stop = worker_share(len(pieces), number, new_workers)
        state.tokenize.held = pieces[first:stop]  # taken back and yielded first
        out.append(state)
    return out


def check_states(states: Sequence[LoaderState]) -> None:
    """The states must be those of every rank of one run, in rank order, at one step."""
    if not states:
        raise ValueError("load_state_dict got an empty list of states")
    world = len(states)
    for rank, state in enumerate(states):
        topology = state.topology
        if topology["world_size"] != world or topology["rank"] != rank:
            raise ValueError(
                f"states[{rank}] is rank {topology['rank']} of {topology['world_size']}: "
                f"pass the states of all {topology['world_size']} ranks of the old run, in "
                "rank order"
            )
        if len(state.workers) != max(1, topology["num_workers"]):
            raise ValueError(f"states[{rank}] holds {len(state.workers)} worker states")
    first = states[0]
    for rank, state in enumerate(states[1:], 1):
        for name in ("epoch", "done", "config"):
            if getattr(state, name) != getattr(first, name):
                raise ValueError(
                    f"states[{rank}] differs from states[0] in its {name}: the states are not "
                    "of one run at one step"
                )
        if state.topology["num_workers"] != first.topology["num_workers"]:
            raise ValueError(f"states[{rank}] has another num_workers than states[0]")
