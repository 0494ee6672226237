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
written, once, by a thread of its own (a trace of 200 steps of busy workers is ~100,000
events, a second of work that the training loop does not wait for; ``close`` does), as a
temporary file renamed over the path, so a reader never sees half a file. A file that cannot
be written then is a warning in the log, not an error in the training loop: the folder is
checked when the writer is made.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading

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
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(f"cannot write the trace {self.path}: {folder} is read-only")
        self.steps = steps
        self.done = 0  # consumer steps recorded
        self.written = False
        self._pid = os.getpid()
        self._consumer_end = float("-inf")  # where the training process's last stretch ended
        self._writing: threading.Thread | None = None
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
        """One consumer step done; False once ``steps`` are recorded and handed to be written
        (the caller can drop the writer, or ``close`` it to wait for the file)."""
        if self.written:
            return False
        self.done += 1
        if self.done < self.steps:
            return True
        self.write()
        return False

    def close(self) -> None:
        """Write what was recorded, if the file is not written yet (a run shorter than
        ``steps``), and wait until the file is there."""
        if not self.written:
            self.write()
        if self._writing is not None:
            self._writing.join()
            self._writing = None

    def write(self) -> None:
        """Hand what was recorded to the thread that writes ``path``, and keep nothing more."""
        if self.written:
            return
        self.written = True
        spans, self._spans = self._spans, []
        self._writing = threading.Thread(
            target=self._write, args=(spans, self.done), name="wdsvlm-trace"
        )
        self._writing.start()

    def _write(self, spans: list, steps: int) -> None:
        trace = {
            "traceEvents": trace_events(spans, self._pid),
            "displayTimeUnit": "ms",
            "otherData": {"producer": "wdsvlm", "steps": steps},
        }
        folder = os.path.dirname(os.path.abspath(self.path))
        try:
            handle, temporary = tempfile.mkstemp(prefix=".trace-", suffix=".json", dir=folder)
            try:
                with os.fdopen(handle, "w", encoding="utf-8") as f:
                    json.dump(trace, f, separators=(",", ":"))
                os.replace(temporary, self.path)
            except BaseException:
                os.unlink(temporary)
                raise
        except OSError as e:  # a thread's error: said in the log, the training goes on
            log.warning("could not write the trace %s: %s", self.path, e)
            return
        log.info(
            "trace of %d steps written to %s (open it in ui.perfetto.dev or chrome://tracing)",
            steps,
            self.path,
        )


def trace_events(spans: list[tuple[tuple, str, float, float, int]], own_pid: int) -> list[dict]:
    """The trace events of ``TraceWriter``'s spans (``own_pid``: the training process's):
    the lanes' names, then the spans by lane and start (an enclosing span before the spans
    it holds)."""
    base = min((start for _, _, start, _, _ in spans), default=0.0)
    meta: list[dict] = []
    named: set = set()  # the lanes and the processes named so far
    events: list[dict] = []
    for lane, name, start, end, step in spans:
        pid, tid = _ids(lane, own_pid)
        if lane not in named:
            named.add(lane)
            meta.append(_meta("thread_name", pid, tid, {"name": _label(lane, pid)}))
        if pid not in named:
            named.add(pid)
            own = pid == own_pid  # no worker processes: the workers' lanes are threads
            label = f"{TRAINING} (pid {pid})" if own else _label(lane, pid)
            meta.append(_meta("process_name", pid, 0, {"name": label}))
            sort = 0 if own else lane[1] + 1
            meta.append(_meta("process_sort_index", pid, 0, {"sort_index": sort}))
        # whole nanoseconds first, so that rounding keeps a nested span inside its parent
        begin_ns = round((start - base) * 1e9)
        end_ns = max(begin_ns, round((end - base) * 1e9))
        events.append(
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
    events.sort(key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
    return meta + events


def _ids(lane: tuple, own_pid: int) -> tuple[int, int]:
    # the training process's lane is thread 0 of its pid; a worker's is thread slot + 1 of
    # its own pid (the training process's when there are no worker processes)
    if lane[0] == TRAINING:
        return own_pid, 0
    return lane[2], lane[1] + 1


def _label(lane: tuple, pid: int) -> str:
    if lane[0] == TRAINING:
        return f"{TRAINING} (pid {pid})"
    return f"worker {lane[1]} (pid {pid})"
