"""Naming a hang: the stage each worker of a rank is in, and since when (``StatusBoard``), read
by a thread of the training process (``Watchdog``) when a step has waited too long for its
batch, so that a stuck job says which worker holds it and where, instead of nothing until a
timeout.

The board is a small file in the node folder that every worker of the rank maps (a Ray actor
on the same node too): ``enter(slot, stage)`` writes the stage's code and a
``time.monotonic()`` stamp into the slot's cells of the mapping, two stores and no system call
(CLOCK_MONOTONIC is the same clock in every process of a Linux machine, so the training
process can tell how long ago a stamp was written). It is pickled by its path and mapped in
each process at the first ``enter``; a process that cannot map it (a Ray actor on another
node, where the path is another file or none) writes nothing, and its stage is unknown. A
stamp and a code are not written atomically together: a reader may see a stage with a stamp a
few microseconds off, which does not matter at the scale of a hang.

Layout: a header (magic, the board's random token, the slot count), then per slot a float64
stamp, then per slot an int32 stage code, then per slot an int32 pid (written when a process
first enters that slot).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ..pipeline.timing import STAGES

log = logging.getLogger("wdsvlm.loader")

_MAGIC = b"WDSVLMSB"
_HEADER = struct.Struct("<8s8sI4x")  # magic, token, slots
# code 0: never entered; 1: between stages (waiting for its turn to hand a batch over)
NAMES = ("not started", "idle", *STAGES, "other")
CODES = {name: code for code, name in enumerate(NAMES)}
_OTHER = CODES["other"]
_code = CODES.get
_ORPHAN_AFTER_S = 3600.0
_monotonic = time.monotonic


class StatusBoard:
    """The stage each of ``slots`` workers is in, and since when, in the file ``path`` (made
    and removed by the training process: ``create``, ``remove``); see the module's
    docstring."""

    def __init__(self, path: str, token: bytes, slots: int):
        self.path = path
        self.token = token
        self.slots = slots
        self._opened = False
        self._stamps: Any = None  # memoryview of float64, one per slot
        self._codes: Any = None
        self._pids: Any = None
        self._slot = -1  # the slot this process last entered
        self._map: mmap.mmap | None = None

    @classmethod
    def create(cls, folder: str, slots: int) -> StatusBoard:
        """A new board for ``slots`` workers in ``folder`` (made if missing)."""
        os.makedirs(folder, exist_ok=True)
        _remove_orphans(folder)
        token = os.urandom(8)
        fd, path = tempfile.mkstemp(prefix=f"status-{os.getpid()}-", suffix=".board", dir=folder)
        try:
            os.write(fd, _HEADER.pack(_MAGIC, token, slots) + bytes(16 * slots))
        finally:
            os.close(fd)
        return cls(path, token, slots)

    def __getstate__(self) -> dict:
        return {"path": self.path, "token": self.token, "slots": self.slots}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["token"], state["slots"])

    def _open(self) -> bool:
        # mapped for writing also where it is only read: without workers, the training
        # process both writes it (its pipeline) and reads it (the watchdog), through one map
        self._opened = True
        size = _HEADER.size + 16 * self.slots
        try:
            with open(self.path, "r+b") as f:
                mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_WRITE)
        except (OSError, ValueError):  # not this node's board, or removed: nothing to write
            return False
        if _HEADER.unpack_from(mapped) != (_MAGIC, self.token, self.slots):
            mapped.close()
            return False
        view = memoryview(mapped)
        start = _HEADER.size
        self._stamps = view[start : start + 8 * self.slots].cast("d")
        self._codes = view[start + 8 * self.slots : start + 12 * self.slots].cast("i")
        self._pids = view[start + 12 * self.slots : start + 16 * self.slots].cast("i")
        self._map = mapped
        return True

    def enter(self, slot: int, stage: str) -> None:
        """The worker playing ``slot`` enters ``stage`` now (``"idle"``: between stages)."""
        stamps = self._stamps
        if stamps is None:
            if self._opened or not self._open():
                return
            stamps = self._stamps
        if slot != self._slot:
            self._slot = slot
            self._pids[slot] = os.getpid()
        stamps[slot] = _monotonic()
        self._codes[slot] = _code(stage, _OTHER)

    def read(self) -> list[tuple[str, float, int]] | None:
        """Each slot's ``(stage, seconds in it, pid)`` now (pid 0: no process entered it);
        None if the board cannot be read."""
        if self._stamps is None and (self._opened or not self._open()):
            return None
        now = time.monotonic()
        out = []
        for slot in range(self.slots):
            code, stamp = self._codes[slot], self._stamps[slot]
            name = NAMES[code] if 0 <= code < len(NAMES) else "other"
            out.append((name, now - stamp if stamp else 0.0, self._pids[slot]))
        return out

    def close(self) -> None:
        """Unmap it in this process (the file stays)."""
        for name in ("_stamps", "_codes", "_pids"):
            view = getattr(self, name)
            if view is not None:
                view.release()
            setattr(self, name, None)
        if self._map is not None:
            self._map.close()
            self._map = None

    def remove(self) -> None:
        """Unmap it and remove its file (the training process, when the Loader closes)."""
        self.close()
        self._opened = True  # never mapped again here
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _remove_orphans(folder: str) -> None:
    """Remove the boards of training processes that are gone (killed before their Loader could
    remove its board): each board's name holds the pid of the process that made it. Only
    boards untouched for an hour: a process of another pid namespace sharing the folder looks
    gone from here, and its workers' writes keep its board's time recent."""
    for name in os.listdir(folder):
        if not (name.startswith("status-") and name.endswith(".board")):
            continue
        path = os.path.join(folder, name)
        try:
            os.kill(int(name.split("-")[1]), 0)
        except ProcessLookupError:
            try:
                if os.stat(path).st_mtime < time.time() - _ORPHAN_AFTER_S:
                    os.unlink(path)
            except FileNotFoundError:  # another Loader of the node removed it first
                pass
        except (ValueError, OSError):  # not a board of ours, or alive under another user
            pass


def describe(
    board: StatusBoard | None,
    slot: int,
    workers: int,
    names: Callable[[int], str],
    unseen: str = "has not started its stream",
) -> str:
    """Each worker's stage and how long it has been in it, the one holding the step first."""
    read = board.read() if board is not None else None
    parts = []
    for s in [slot] + [s for s in range(workers) if s != slot]:
        if read is None or s >= len(read):
            parts.append(f"{names(s)}: stage unknown")
            continue
        stage, seconds, pid = read[s]
        who = f"{names(s)} (pid {pid})" if pid else names(s)
        if stage == "not started":
            parts.append(f"{who}: {unseen}")
        else:
            parts.append(f"{who}: in {stage} for {seconds:.1f} s")
    return "; ".join(parts)


class Watchdog:
    """A thread that, while the consumer waits for a batch longer than ``after`` seconds, logs
    which worker holds the step and each worker's stage (again every ``after`` seconds).
    ``waiting()`` gives the start of the current wait (``perf_counter``, 0: not waiting) and
    the index of the batch waited for. Started once the iteration's workers are started (a
    thread running while a worker is forked could hold a lock the worker inherits: see
    ``workers.py``), stopped with the iteration."""

    def __init__(
        self,
        after: float,
        waiting: Callable[[], tuple[float, int]],
        board: StatusBoard | None,
        workers: int,
        names: Callable[[int], str],
        unseen: str = "",
    ):
        self.after = after
        self.waiting = waiting
        self.board = board
        self.workers = max(1, workers)
        self.names = names
        self.unseen = unseen or "has not started its stream"  # a worker never on the board
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="wdsvlm-watchdog", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        poll = max(0.05, min(self.after / 5, 5.0))
        told, due = 0.0, 0.0  # the wait last told about; how long it waits when told next
        while not self._stop.wait(poll):
            since, index = self.waiting()
            if not since:
                continue
            if since != told:
                told, due = since, self.after
            waited = time.perf_counter() - since
            if waited < due:
                continue
            due = waited + self.after
            slot = index % self.workers
            log.warning(
                "batch %d of the epoch has been waited for %.1f s; it comes from %s. %s "
                "(telemetry hang_after_s=%g)",
                index,
                waited,
                self.names(slot),
                describe(self.board, slot, self.workers, self.names, self.unseen),
                self.after,
            )

    def stop(self) -> None:
        self._stop.set()
        try:
            other = self._thread is not threading.current_thread()
        except (AttributeError, TypeError):  # at interpreter exit: the modules are torn down
            return
        if other:
            self._thread.join()


def removed_with(owner: object, board: StatusBoard) -> Any:
    """Remove ``board``'s file when ``owner`` is collected (or at exit) at the latest."""
    return weakref.finalize(owner, board.remove)
