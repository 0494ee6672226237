"""Where a worker's time goes: each stage's own seconds, timed in the worker and shipped with
the batches it makes (``StageClock.take``), so that the training process learns where the time
went without another process, queue or round trip.

The stages run as a chain of generators in one thread: a stage's ``next`` calls the ``next``
of the stage before it. ``timed`` charges each stage the time of its own ``next`` less the
time of the stages it called (the time charged while it ran), so every second of the worker
is charged to exactly one stage; ``stage`` does the same for a stretch of work inside a stage
(decoding inside the collate step). Cost: two ``perf_counter`` calls per sample and stage.

The stage a worker is in now, and since when, goes to a ``board`` when one is given (the
Loader's ``telemetry.StatusBoard``, which names the stage of a worker that holds a step up);
``spans`` (set while a trace is recorded) keeps each stretch as ``(stage, start, end)``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# The stages a worker's seconds are charged to, in pipeline order, with what each holds.
STAGES = {
    "read": "taking samples out of the bytes read (tar members, layouts)",
    "read_wait": "waiting for the store: reads the read-ahead threads had not finished",
    "shuffle": "the shuffle buffer",
    "map": "the user's map= function",
    "tokenize": "chat template, tokenizer, labels and vision token counts",
    "pack": "the packer's window (knapsack fill) and the batches' balance",
    "decode_image": "decoding images and resizing them into the family's units",
    "image_map": "the user's image_map= function",
    "decode_video": "decoding a video's sampled frames into the family's units",
    "collate": "making the batch's tensors (not decoding)",
}


class StageClock:
    """One worker's stage seconds since the last ``take()``; see the module's docstring."""

    def __init__(self, board: Any = None, slot: int = 0):
        self.seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.charged = 0.0  # seconds charged to any stage so far: what a caller subtracts
        self.spans: list[tuple[str, float, float]] | None = None
        self.board = board
        self.slot = slot
        self._stack: list[str] = []  # the stages entered and not left, innermost last
        self._marks: list[float] = []  # ``charged`` as each of them was entered

    def _enter(self, name: str) -> None:
        self._stack.append(name)
        if self.board is not None:
            self.board.enter(self.slot, name)

    def _leave(self, start: float, name: str) -> None:
        end = time.perf_counter()
        self._stack.pop()
        own = end - start - (self.charged - self._marks.pop())
        self.seconds[name] += own
        self.charged += own
        if self.spans is not None:
            self.spans.append((name, start, end))
        if self.board is not None:
            self.board.enter(self.slot, self._stack[-1] if self._stack else "idle")

    def timed(self, name: str, items: Iterator[Any]) -> Iterator[Any]:
        """``items``, each ``next`` charged to ``name`` less what the stages it pulls from
        were charged meanwhile."""
        items = iter(items)
        while True:
            self._marks.append(self.charged)
            self._enter(name)
            start = time.perf_counter()
            try:
                item = next(items)
            except StopIteration:
                self._leave(start, name)
                return
            except BaseException:
                self._leave(start, name)
                raise
            self._leave(start, name)
            yield item

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """A stretch of work charged to ``name`` (less what nested stretches were charged)."""
        self._marks.append(self.charged)
        self._enter(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._leave(start, name)

    def take(self) -> dict:
        """The seconds per stage since the last ``take()`` (and the spans, while tracing), and
        start counting afresh: what rides on the batch made now."""
        out: dict[str, Any] = {"seconds": {k: v for k, v in self.seconds.items() if v}}
        self.seconds = dict.fromkeys(STAGES, 0.0)
        if self.spans is not None:
            out["spans"], self.spans = self.spans, []
        return out
