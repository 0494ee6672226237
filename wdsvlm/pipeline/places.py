"""Sample places and the resumable stages' common shape.

A sample's place ``[pass, place in the pass's global order]`` (set by the plan as
``__pass__`` and ``__pos__``) names it on any topology. A buffering stage (shuffle, tokenize,
pack, balance) runs each iteration as a ``StageRun``: an iterator that keeps that
iteration's live state, so one stage instance can serve several iterators at once. A run's
``state()`` says what it holds as places (never sample bytes) plus the few numbers that
decide what comes next; ``stage.restore(state, upstream, fetch)`` starts a run that goes on
exactly from there, taking the held samples back from ``fetch``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

Place = list[int]
"""``[pass, place]``: a sample's place in its pass's global order; ``[pass, place, piece]``
for a piece of a document (``documents.py``), the document being at ``[pass, place]``."""

Fetch = Callable[[Sequence[Place]], list]
"""The samples at some places, as they came into the stage that asks (read again, and passed
through the stages before it); ``None`` for one that could not be had again."""


def place(sample: dict) -> Place:
    """A sample's place: ``[pass, place in the pass's global order]`` (the same on any
    topology), and its piece's number for a piece of a document."""
    if "__piece__" in sample:
        return [sample["__pass__"], sample["__pos__"], sample["__piece__"]]
    return [sample["__pass__"], sample["__pos__"]]


def places_of(samples: Sequence[dict]) -> list[Place]:
    """The places of ``samples``, in their order."""
    return [place(s) for s in samples]


def present(samples: Sequence[Any]) -> list:
    """``samples`` without the ones a ``Fetch`` could not have again."""
    return [s for s in samples if s is not None]


def copied(held: Sequence[Sequence[int]]) -> list[Place]:
    """Places as fresh lists (a state must not share lists with the one it came from);
    ``ValueError`` for one that is not a place."""
    out = [[int(x) for x in p] for p in held]
    if any(len(p) not in (2, 3) for p in out):
        raise ValueError(f"a place is [pass, place] or [pass, place, piece], not {held!r}")
    return out


class StageRun(Iterator):
    """One iteration of a stage over its upstream: an iterator over ``items`` (the stage's
    generator, which keeps its live state on the run), with ``state()`` as places."""

    def __init__(self, items: Iterator):
        self._items = items

    def __iter__(self) -> StageRun:
        return self

    def __next__(self):
        return next(self._items)

    def state(self) -> Any:
        raise NotImplementedError


@dataclass
class TokenizeState:
    """The places of the samples a tokenizer batch ``held``: taken in, not yet yielded (a
    document's pieces not yet yielded each by its own place)."""

    held: list[Place] = field(default_factory=list)

    def held_places(self) -> list[Place]:
        return list(self.held)

    def saved(self) -> list[Place]:
        return copied(self.held)

    @classmethod
    def from_saved(cls, saved: list) -> TokenizeState:
        return cls(copied(saved))


class TokenizeRun(StageRun):
    """One iteration of a ``Tokenize`` (``stage``): ``rest``, the samples of the batch being
    encoded that are not yet yielded."""

    def __init__(self, stage: Any, samples: Iterator[dict], rest: list[dict]):
        self.rest = rest
        super().__init__(stage._run(samples, rest))

    def state(self) -> TokenizeState:
        return TokenizeState(places_of(self.rest))
