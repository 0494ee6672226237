"""What the training process sees of its data: how long each step waited for its batch, what
the Loader did in the training process itself, and, from the workers' reports that ride with
the batches (``pipeline.timing``), each stage's seconds, the store's requests and the samples
skipped; as figures for the logs (``Loader.metrics()``: names under ``data/``), advice when the
steps wait, and the stage of each worker when a step waits too long.

The training process's side is timed around each ``next`` of the Loader's iteration
(``DataMeter.timed``): a step's *wait* runs from the consumer asking for the next batch to the
worker's batch coming out of the DataLoader (or the Ray actors' iterator), so it holds the
handing over (shared memory, the pin-memory thread) and, without workers, the whole pipeline;
the Loader's *own work* runs from then until the batch is handed to the consumer (its stats,
counts), plus ``work()`` stretches outside the iteration (the Trainer's ``model_inputs``); the
*step* is the rest of the time between handing a batch over and asking for the next: the
model's. An iteration's first wait holds the start of its workers (and of a local Ray); on
Ray, the copy of a batch into pinned memory is part of the wait. Cost: a few ``perf_counter``
calls, two small sums over the batch (its real and supervised tokens) and a float appended per
step; per sample nothing (the board's two stores per stage change are the workers').
"""

from __future__ import annotations

import logging
import re
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .. import compat
from ..pipeline.tokenize import IGNORE_INDEX
from .advice import diagnose
from .figures import CONSUMER, COUNTS, REQUESTS, STAGE_KEYS, figures
from .watchdog import StatusBoard, Watchdog

log = logging.getLogger("wdsvlm.loader")


@dataclass(frozen=True)
class Telemetry:
    """The Loader's ``telemetry=`` setting (``True``: these defaults; ``False``: off, no figure
    is timed or shipped and ``metrics()`` has only the consumer's counts)."""

    window: int = 200
    """Steps over which the advice looks at the share of time spent waiting."""
    advice_wait: float = 0.10
    """The share of a window's time waiting for data above which one line of advice is
    logged, on rank 0 (the stage that dominates, what to change: ``advice.diagnose``); the
    same advice again only every 10 windows. The first wait of an iteration (its workers'
    start) is not weighed."""
    hang_after_s: float = 120.0
    """A step waiting longer than this logs which worker holds it and the stage each worker
    is in, with how long (again every ``hang_after_s``), on any rank (``watchdog.py``); 0:
    never (no board, no watchdog thread)."""
    trace: str | None = None
    """A path: the first ``trace_steps`` steps are written there as a Chrome/Perfetto trace
    (JSON trace events: each worker's stages, the training process's waits and steps)."""
    trace_steps: int = 200
    """Steps the trace holds."""

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"Telemetry window must be at least 1 step, not {self.window}")
        if not 0 < self.advice_wait <= 1:
            raise ValueError(f"Telemetry advice_wait must be in (0, 1], not {self.advice_wait}")
        if self.hang_after_s < 0:
            raise ValueError(f"Telemetry hang_after_s must be >= 0, not {self.hang_after_s}")
        if self.trace_steps < 1:
            raise ValueError(f"Telemetry trace_steps must be at least 1, not {self.trace_steps}")


def telemetry_of(setting: Any) -> Telemetry | None:
    """The ``telemetry=`` setting as a ``Telemetry`` (None: off)."""
    if setting is True:
        return Telemetry()
    if setting is False or setting is None:
        return None
    if isinstance(setting, Telemetry):
        return setting
    raise TypeError(f"telemetry= takes True, False or wdsvlm.Telemetry(...), not {setting!r}")


_KEEP_WAITS = 1 << 16  # waits kept for the percentiles of an interval; then every other one
_REPEAT_EVERY = 10  # windows between two lines of the same advice


class DataMeter:
    """The training process's side: timed around each ``next`` of the Loader's iteration
    (``timed``), fed with each batch's worker report (``arrived``) and each batch handed over
    (``handed``); ``metrics()`` gives the figures since the last reset, and every
    ``Telemetry.window`` steps the advice is weighed (``advice.diagnose``). See the module's
    docstring for what the wait, the Loader's work and the step hold.

    Counts are kept as running totals; an interval (``metrics``) or a window (the advice) is
    the difference from the totals at its start. The workers' requests and skips come
    cumulative per epoch and slot: each report's increase over that slot's previous one is
    added (a count that went down, after a Ray actor restarted, counts from zero)."""

    def __init__(
        self,
        telemetry: Telemetry | None,
        num_workers: int,
        *,
        slots: int | None = None,
        rank: int = 0,
        folder: str | None = None,
        ray: bool = False,
    ):
        self.telemetry = telemetry
        self.num_workers = num_workers
        self.slots = max(1, num_workers if slots is None else slots)
        self.rank = rank
        self.folder = folder
        self.ray = ray
        self.board: StatusBoard | None = None
        self._trace: Any = None
        self._traced = False
        self._held: list = []  # the board and the trace: let go when the meter goes
        weakref.finalize(self, _release, self._held)
        self._sum: dict[str, float] = dict.fromkeys(CONSUMER + COUNTS, 0.0)
        self._mark = dict(self._sum)  # the totals when the interval began
        self._window_mark = dict(self._sum)
        self._window_steps = 0
        self._told: tuple[str, int] = ("", 0)  # the last advice (digits masked), windows since
        self._waits: list[float] = []
        self._max_wait = 0.0
        self._last: dict[tuple, float] = {}  # each slot's last cumulative request/skip figure
        self._waiting = 0.0  # the start of the current wait (0: not waiting): the watchdog's
        self._index = 0  # the batch of the epoch waited for
        self._asked = self._arrived = self._handed = self._begun = 0.0
        self._worked = 0.0  # work() seconds since the last batch was handed over
        self._watchdog: Watchdog | None = None

    # -- set-up, per iteration --------------------------------------------------------------

    def prepare(self, stream: Any) -> None:
        """Before an iteration's workers start: what the stream's workers do for telemetry
        (time their stages, write the board, keep a trace's spans). The consumer asked for the
        iteration's first batch now: starting the workers is part of its wait. An earlier
        iteration's watchdog stops now (one left suspended, not yet collected), before any
        worker is forked."""
        self.stop()
        self._begun = time.perf_counter()
        telemetry = self.telemetry
        stream.telemetry = telemetry is not None
        if telemetry is not None and telemetry.hang_after_s and self.board is None:
            self.board = _new_board(self.folder, self.slots)
            if self.board is not None:
                self._held.append(self.board)
        stream.board = self.board
        stream.trace_batches = 0
        if telemetry is not None and telemetry.trace and not self._traced:
            from .trace import TraceWriter

            self._traced = True
            self._trace = TraceWriter(telemetry.trace, telemetry.trace_steps)
            self._held.append(self._trace)
        if self._trace is not None:  # each slot's share of the steps, and one in hand
            stream.trace_batches = -(-telemetry.trace_steps // self.slots) + 1

    def timed(self, batches: Iterator[dict], index: int) -> Iterator[dict]:
        """``batches``, an iteration's from batch ``index`` of the epoch on, each ``next``
        timed as the wait for it; the watchdog runs while it does (the iteration's workers
        are started: ``batches`` is the DataLoader's iterator)."""
        self._last.clear()  # the workers count afresh each iteration
        self._handed = 0.0  # the time since an earlier iteration is not a step
        ready = compat.ready_batches if self.num_workers and not self.ray else None
        telemetry = self.telemetry
        watchdog = None
        if telemetry is not None and telemetry.hang_after_s:
            # an actor on another node cannot map this node's board: its stage is unknown
            unseen = "not started, or on another node (stage unknown)" if self.ray else ""
            args = self._waited, self.board, self.slots, self._name
            watchdog = self._watchdog = Watchdog(telemetry.hang_after_s, *args, unseen=unseen)
        s = self._sum
        clock = time.perf_counter
        starting = True
        try:
            while True:
                asked = self._asked = self._begun or clock()
                self._begun = 0.0
                if self._handed:  # the model's step: since the last batch, less work()
                    s["data/step_s"] += asked - self._handed - self._worked
                    if self._trace is not None:
                        self._trace.consumer("step", self._handed, asked)
                        if not self._trace.step():
                            self._trace = None
                    self._handed = 0.0
                self._worked = 0.0
                if ready is not None:
                    s["ready"] += ready(batches)
                    s["ready_asks"] += 1
                self._index = index
                self._waiting = asked
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                except (ConnectionError, EOFError) as e:
                    if not self.num_workers or self.ray:
                        raise
                    # a DataLoader worker that dies while its batch's shared memory is being
                    # handed over
                    raise RuntimeError(
                        "DataLoader worker exited unexpectedly while handing over a batch "
                        f"({type(e).__name__}: {e})"
                    ) from e
                finally:
                    self._waiting = 0.0
                arrived = self._arrived = clock()
                wait = arrived - asked
                s["data/wait_s"] += wait
                self._waits.append(wait)
                if wait > self._max_wait:
                    self._max_wait = wait
                if len(self._waits) > _KEEP_WAITS:
                    del self._waits[::2]
                if starting:  # the workers' start: in the figures, not weighed by the advice
                    self._window_mark["data/wait_s"] += wait
                    starting = False
                index += 1
                yield batch
        finally:  # this iteration's watchdog; a later iteration's runs on
            if watchdog is not None:
                watchdog.stop()
            if self._watchdog is watchdog:
                self._watchdog, self._waiting = None, 0.0

    def _waited(self) -> tuple[float, int]:
        return self._waiting, self._index

    def _name(self, slot: int) -> str:
        if self.ray:
            return f"Ray worker {slot}"
        if not self.num_workers:
            return "the training process (num_workers=0)"
        return f"worker slot {slot}"

    def stop(self) -> None:
        """The iteration ended: stop the watchdog."""
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop()

    def close(self) -> None:
        """The Loader closes: stop the watchdog, remove the board, write the trace so far."""
        self.stop()
        _release(self._held)
        self.board = self._trace = None

    # -- per step ---------------------------------------------------------------------------

    def arrived(self, report: Mapping[str, Any] | None) -> None:
        """A batch's worker report: its stages' seconds (each batch's own), its requests and
        skips (cumulative per epoch and slot). Nothing with telemetry off."""
        if self.telemetry is None or not report:
            return
        s = self._sum
        slot = report.get("slot", 0)
        timing = report.get("timing")
        if timing:
            for stage, seconds in timing.get("seconds", {}).items():
                key = STAGE_KEYS.get(stage) or f"data/{stage}_s"
                s[key] = s.get(key, 0.0) + seconds
            spans = timing.get("spans")
            if spans and self._trace is not None:
                self._trace.worker(timing.get("slot", slot), timing.get("pid", 0), spans)
        skips = report.get("skips") or {}
        for source, counts in skips.get("requests", {}).items():
            for name, value in counts.items():
                key = REQUESTS.get(name)
                if key is not None:
                    self._increase(key, (slot, source, name), value)
        for reason, n in skips.get("skipped", {}).items():
            self._increase(f"data/skipped/{reason}", (slot, reason), n)

    def _increase(self, key: str, where: tuple, value: float) -> None:
        before = self._last.get(where, 0)
        self._last[where] = value
        added = value - before if value >= before else value
        if added:
            self._sum[key] = self._sum.get(key, 0.0) + added

    def handed(self, batch: Mapping[str, Any], samples: int, tokens: int) -> None:
        """The batch of ``samples`` and ``tokens`` (real ones) goes to the consumer now."""
        s = self._sum
        labels = batch.get("labels")
        if labels is not None:
            s["supervised"] += int((labels != IGNORE_INDEX).sum())
        s["positions"] += batch["attention_mask"].numel()
        s["samples"] += samples
        s["tokens"] += tokens
        s["data/steps"] += 1
        if self.telemetry is not None:
            self._window_steps += 1
            if self._window_steps >= self.telemetry.window:
                self._advise()
        handed = self._handed = time.perf_counter()
        s["data/loader_s"] += handed - self._arrived
        if self._trace is not None:
            self._trace.consumer("wait", self._asked, self._arrived)
            self._trace.consumer("loader", self._arrived, handed)

    @contextmanager
    def work(self, loader: bool = True) -> Iterator[None]:
        """Work done for the Loader in the training process outside its iteration (the
        Trainer's ``model_inputs``): counted as the Loader's, not as the model's step;
        ``loader=False``: neither (the Trainer's evaluation between two steps), left out."""
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self._sum["data/loader_s"] += seconds if loader else 0.0
            self._worked += seconds

    # -- figures ----------------------------------------------------------------------------

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """The figures since the last reset (``reset``: a new interval starts now). Names and
        meanings: see ``figures``."""
        out = self.figures(self._mark, self._waits, self._max_wait)
        if reset:
            self._mark = dict(self._sum)
            self._waits = []
            self._max_wait = 0.0
        return out

    def figures(
        self, mark: Mapping[str, float], waits: list[float] | None = None, max_wait: float = 0.0
    ) -> dict[str, float]:
        """The figures since the totals were ``mark`` (``figures.figures``)."""
        since = {k: v - mark.get(k, 0.0) for k, v in self._sum.items()}
        return figures(since, waits, max_wait, self.telemetry is not None, self.ray)

    def _advise(self) -> None:
        """A window is over: one line of advice if its steps waited too long (rank 0)."""
        figures = self.figures(self._window_mark)
        self._window_mark = dict(self._sum)
        self._window_steps = 0
        telemetry = self.telemetry
        if self.rank != 0 or telemetry is None:
            return
        waiting = figures["data/wait_fraction"]
        text = diagnose(figures, self.num_workers, waiting, telemetry.advice_wait, self.ray)
        last, windows = self._told
        if text is None:
            self._told = (last, windows + 1)
            return
        kind = re.sub(r"\d+", "#", text)  # the same advice, whatever its figures
        if kind == last and windows + 1 < _REPEAT_EVERY:
            self._told = (last, windows + 1)  # said lately: not again every window
            return
        self._told = (kind, 0)
        log.warning("%s", text)


def meter_of(settings: Any, worker_config: Any) -> DataMeter:
    """The meter of a Loader with ``settings`` (``LoaderSettings``) and ``worker_config``."""
    from ..storage.folders import node_folder
    from .placement import RayWorkers

    return DataMeter(
        telemetry_of(settings.telemetry),
        settings.num_workers,
        slots=worker_config.workers_per_rank,
        rank=worker_config.rank,
        folder=node_folder(settings.local_dir, settings.cache_dir, make=False),
        ray=isinstance(settings.workers, RayWorkers),
    )


def _new_board(folder: str | None, slots: int) -> StatusBoard | None:
    """A board in the node folder, else in the temporary folder; None (hangs are still told,
    without the workers' stages) where neither can hold one."""
    import tempfile

    for where in (folder, tempfile.gettempdir()):
        try:
            return StatusBoard.create(where or tempfile.gettempdir(), slots)
        except OSError as e:
            log.debug("no status board in %s: %s", where, e)
    return None


def _release(held: list) -> None:
    """Remove the board's file, write the trace recorded so far (the meter goes, or closes)."""
    for thing in held:
        try:
            if isinstance(thing, StatusBoard):
                thing.remove()
            else:
                thing.close()
        except Exception:  # noqa: BLE001 - at interpreter exit, parts may be gone already
            log.debug("could not release %r", thing, exc_info=True)
    held.clear()
