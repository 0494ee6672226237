"""Where a worker's time goes: each stage's own seconds, timed in the worker and shipped with
the batches it makes (``StageClock.take``), so that the training process learns where the time
went without another process, queue or round trip.

The stages run as a chain of generators in one thread: a stage's ``next`` calls the ``next``
of the stage before it. ``timed`` charges each stage the time of its own ``next`` less the
time of the stages it called (the time charged while it ran), so every second of the worker
is charged to exactly one stage; ``stage`` does the same for a stretch of work inside a stage
(decoding inside the collate step). Cost: two ``perf_counter`` calls per sample and stage, a
float added; nothing is allocated per item but the span of a trace.

The stage a worker is in now, and since when, goes to a ``board`` when one is given (the
Loader's ``telemetry.StatusBoard``, which names the stage of a worker that holds a step up);
``spans`` (set while a trace is recorded: the first ``trace`` batches' worth) keeps each
stretch as ``(stage, start, end)`` in ``time.perf_counter`` seconds.

A stage used alone (in a user's own webdataset pipeline) has no clock: each stage that times
a stretch of its own work reads its ``clock`` attribute (None by default), which the Loader's
stream sets in each worker, and ``stretch(clock, name)`` is then a no-op context.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

# The stages a worker's seconds are charged to, in pipeline order, with what each holds.
STAGES = {
    "read": "taking samples out of the bytes read (tar members, layouts)",
    "read_wait": "waiting for the store: reads the read-ahead threads had not finished "
    "(read_ahead=0: every read)",
    "shuffle": "the shuffle buffer",
    "map": "the user's map= function",
    "tokenize": "chat template, tokenizer, labels and vision token counts",
    "pack": "the packer's window (knapsack fill) and the batches' balance",
    "decode_image": "decoding images and resizing them into the family's units",
    "image_map": "the user's image_map= function",
    "decode_video": "decoding a video's sampled frames into the family's units",
    "collate": "making the batch's tensors (not decoding)",
}

_NOTHING = nullcontext()  # reusable: what ``stretch`` is without a clock
_now = time.perf_counter  # what the clock reads (a test puts a clock of its own here)


class _Stretch:
    """``StageClock.stage(name)``: one reusable object per name (nesting kept by the clock)."""

    __slots__ = ("clock", "name")

    def __init__(self, clock: StageClock, name: str):
        self.clock, self.name = clock, name

    def __enter__(self) -> None:
        clock = self.clock
        clock._open.append(clock.charged)
        clock._enter(self.name)
        clock._open.append(_now())

    def __exit__(self, *exc: Any) -> None:
        clock = self.clock
        start = clock._open.pop()
        clock._leave(self.name, start, clock._open.pop())


class StageClock:
    """One worker's stage seconds since the last ``take()``; see the module's docstring.
    ``trace``: how many ``take()`` calls (batches) keep their ``spans``; 0: none."""

    def __init__(self, board: Any = None, slot: int = 0, trace: int = 0):
        if trace < 0:
            raise ValueError(f"trace must be >= 0 batches, not {trace}")
        self.seconds: dict[str, float] = dict.fromkeys(STAGES, 0.0)
        self.charged = 0.0  # seconds charged to any stage so far: what a caller subtracts
        self.trace = trace  # batches whose spans are still to be kept
        self.spans: list[tuple[str, float, float]] | None = [] if trace else None
        self.board = board
        self.slot = slot
        self._stack: list[str] = []  # the stages entered and not left, innermost last
        self._open: list[float] = []  # ``charged`` and the start of each open stretch
        self._stretches: dict[str, _Stretch] = {}

    def __reduce__(self):
        # a clock times one process's stages: a copy sent elsewhere starts empty, off the board
        return (StageClock, ())

    def _enter(self, name: str) -> None:
        self._stack.append(name)
        if self.board is not None:
            self.board.enter(self.slot, name)

    def _leave(self, name: str, start: float, mark: float) -> None:
        end = _now()
        self._stack.pop()
        own = end - start - (self.charged - mark)
        self.seconds[name] += own
        self.charged += own
        if self.spans is not None:
            self.spans.append((name, start, end))
        if self.board is not None:
            self.board.enter(self.slot, self._stack[-1] if self._stack else "idle")

    def timed(self, name: str, items: Iterator[Any]) -> Iterator[Any]:
        """``items``, each ``next`` charged to ``name`` less what the stages it pulls from
        were charged meanwhile."""
        if name not in STAGES:
            raise ValueError(f"{name!r} is not one of the stages {list(STAGES)}")
        items = iter(items)
        clock = _now
        while True:
            mark = self.charged
            self._enter(name)
            start = clock()
            try:
                item = next(items)
            except StopIteration:
                self._leave(name, start, mark)
                return
            except BaseException:
                self._leave(name, start, mark)
                raise
            self._leave(name, start, mark)
            yield item

    def stage(self, name: str) -> _Stretch:
        """A stretch of work charged to ``name`` (less what nested stretches were charged):
        ``with clock.stage("decode_image"): ...``; the same reusable object for each name."""
        stretch = self._stretches.get(name)
        if stretch is None:
            if name not in STAGES:
                raise ValueError(f"{name!r} is not one of the stages {list(STAGES)}")
            stretch = self._stretches[name] = _Stretch(self, name)
        return stretch

    def take(self) -> dict:
        """The seconds per stage since the last ``take()`` (and the spans, while tracing), and
        start counting afresh: what rides on the batch made now."""
        out: dict[str, Any] = {"seconds": {k: v for k, v in self.seconds.items() if v}}
        self.seconds = dict.fromkeys(STAGES, 0.0)
        if self.spans is not None:
            out["spans"] = self.spans
            self.trace -= 1
            self.spans = [] if self.trace > 0 else None
        return out


def stretch(clock: StageClock | None, name: str) -> Any:
    """``clock.stage(name)``, or a context that does nothing where there is no clock."""
    return _NOTHING if clock is None else clock.stage(name)
