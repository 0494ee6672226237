"""A Chrome/Perfetto trace of the first steps of a training run: each worker's stages (the
spans its ``StageClock`` kept while tracing, shipped with its batches) and the training
process's waits, its own Loader work and its steps, on one time axis.

The file is the Chrome trace event format (``{"traceEvents": [...], "displayTimeUnit":
"ms"}``) that ui.perfetto.dev and chrome://tracing open: one complete event (``"ph": "X"``,
``ts`` and ``dur`` in microseconds from the first event) per span, and metadata events
(``"ph": "M"``) naming each lane: the training process, and each worker as ``worker N (pid
P)``. A worker's spans nest (a stage's span holds the spans of the stages it pulled from), as
complete events on one thread may: the viewers draw them stacked.

Times are ``time.perf_counter()`` seconds, taken in each process: on Linux and macOS one
monotonic clock for the whole machine, so workers' spans and the training process's line up.
(Ray workers on other machines have clocks of their own: their lanes are shifted.)

Memory is bounded by ``steps``: nothing is kept after the ``steps``-th step, when the file is
written (once: a temporary file renamed over the path, so a reader never sees half a file).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

log = logging.getLogger("wdsvlm.loader.trace")

TRAINING = "training"  # the training process's lane (its waits, its Loader work, its steps)


def _meta(kind: str, pid: int, tid: int, args: dict) -> dict:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


class TraceWriter:
    """Collects spans until ``steps`` consumer steps are done, then writes ``path``."""

    def __init__(self, path: str, steps: int):
        if steps < 1:
            raise ValueError(f"a trace holds at least 1 step, not {steps}")
        self.path = os.fspath(path)
        self.steps = steps
        self.done = 0  # consumer steps recorded
        self.written = False
        self._pid = os.getpid()
        self._consumer_end = float("-inf")  # where the training process's last stretch ended
        # (lane, name, start, end, step); a lane is ("worker", slot, pid) or ("training",)
        self._spans: list[tuple[tuple, str, float, float, int]] = []

    def worker(self, slot: int, pid: int, spans: list[tuple[str, float, float]]) -> None:
        """A worker's spans (``(stage, start, end)``, perf_counter seconds) from one batch."""
        if self.written or not spans:
            return
        lane = ("worker", int(slot), int(pid))
        self._spans.extend((lane, str(s), float(a), float(b), self.done) for s, a, b in spans)

    def consumer(self, name: str, start: float, end: float) -> None:
        """A stretch of the training process: ``"wait"`` (in ``next(loader)`` for a batch),
        ``"loader"`` (the Loader's own work there) or ``"step"`` (the model's, between
        batches)."""
        if self.written:
            return
        # one after another on one lane: a stretch read from clocks taken apart never
        # overlaps the one before (the viewers would take it for a nested one)
        start = max(float(start), self._consumer_end)
        self._consumer_end = end = max(start, float(end))
        self._spans.append(((TRAINING,), name, start, end, self.done))

    def step(self) -> bool:
        """One consumer step done; False once ``steps`` are recorded and the file is written
        (the caller can drop the writer)."""
        if self.written:
            return False
        self.done += 1
        if self.done < self.steps:
            return True
        self.write()
        return False

    def close(self) -> None:
        """Write what was recorded, if the file is not written yet (a run shorter than
        ``steps``)."""
        if not self.written:
            self.write()

    def events(self) -> list[dict]:
        """The trace events: the lanes' names, then the spans by start (an enclosing span
        before the spans it holds)."""
        base = min((start for _, _, start, _, _ in self._spans), default=0.0)
        meta: list[dict] = []
        named: set[tuple] = set()  # the lanes and the processes named so far
        spans: list[dict] = []
        for lane, name, start, end, step in self._spans:
            pid, tid = self._ids(lane)
            if lane not in named:
                named.add(lane)
                meta.append(_meta("thread_name", pid, tid, {"name": self._label(lane, pid)}))
            if pid not in named:
                named.add(pid)
                own = pid == self._pid  # no worker processes: the workers' lanes are threads
                label = f"{TRAINING} (pid {pid})" if own else self._label(lane, pid)
                meta.append(_meta("process_name", pid, 0, {"name": label}))
                sort = 0 if own else lane[1] + 1
                meta.append(_meta("process_sort_index", pid, 0, {"sort_index": sort}))
            # whole nanoseconds first, so that rounding keeps a nested span inside its parent
            begin_ns = round((start - base) * 1e9)
            end_ns = max(begin_ns, round((end - base) * 1e9))
            spans.append(
                {
                    "name": name,
                    "cat": "worker" if lane[0] == "worker" else TRAINING,
                    "ph": "X",
                    "ts": begin_ns / 1000,
                    "dur": (end_ns - begin_ns) / 1000,
                    "pid": pid,
                    "tid": tid,
                    "args": {"step": step},
                }
            )
        spans.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
        return meta + spans

    def _ids(self, lane: tuple) -> tuple[int, int]:
        # the training process's lane is thread 0 of its pid; a worker's is thread slot + 1 of
        # its own pid (the training process's when there are no worker processes)
        if lane[0] == TRAINING:
            return self._pid, 0
        return lane[2], lane[1] + 1

    def _label(self, lane: tuple, pid: int) -> str:
        if lane[0] == TRAINING:
            return f"{TRAINING} (pid {pid})"
        return f"worker {lane[1]} (pid {pid})"

    def write(self) -> None:
        """Write the trace to ``path`` (atomically) and keep nothing more."""
        trace = {
            "traceEvents": self.events(),
            "displayTimeUnit": "ms",
            "otherData": {"producer": "wdsvlm", "steps": self.done},
        }
        self.written = True
        self._spans = []
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".trace-", suffix=".json", dir=folder)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as f:
                json.dump(trace, f, separators=(",", ":"))
            os.replace(temporary, self.path)
        except BaseException:
            os.unlink(temporary)
            raise
        log.info(
            "trace of %d steps written to %s (open it in ui.perfetto.dev or chrome://tracing)",
            self.done,
            self.path,
        )
