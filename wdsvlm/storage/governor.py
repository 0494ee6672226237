"""The request governor: how fast the processes of one node send requests to a store.

Nothing is governed until it has to be: while no cap is set and no store has throttled, a
request goes out at once, at the cost of a clock reading (and, ten times a second, a ``stat``
of the node's budget file, to learn whether another process of the node was throttled).

- **Throttled** (``retry.is_throttling``: 429, 503 SlowDown, ...): the store's rate is
  governed from then on, for every process of the node, AIMD-style. The first throttling sets
  it to half of what this process was sending (the node's rate is not known: it then grows
  by half each second until the next throttling, which makes the rate throttled the store's
  ceiling and goes back to the last rate the store took, 1/1.5 of it). Later, a throttling
  at or above the ceiling (a probe that found the limit) makes the last rate the store took
  (one step less) the ceiling, and the rate 0.9 x that; one below it (the limit fell, or
  requests bunched by a busy CPU) takes a quarter off, and a tenth off the ceiling. No cut
  before the requests booked at the old rate have gone out, and a second more: their answers
  (and those of the second the store still counts them in) say nothing new. Each second in
  which the node sent at least ``USED`` of its rate without throttling adds some back:
  half-way to 0.9 x the ceiling (at least a fifth of it), then, after a few seconds there, a
  step that doubles each second (2% to 10% of the ceiling), probing whether the store now
  allows more.
- **Capped** (``ReadPolicy.requests_per_second``): the node's requests to all stores together
  are spaced ``1 / cap`` seconds apart.

A request takes its turn: the next free slot of its store's rate and of the node's cap, which
are kept in one small JSON file in the node folder (``ReadPolicy.node_dir``), under an
``fcntl`` lock, so that the node's processes (ranks, DataLoader workers, Ray actors, forked or
spawned) learn one rate together and share one cap. A store's entry no one used for a minute
is forgotten. Two jobs on one node share the file: they share the cap and what they learn of a
store, which is what the store sees of them.

``start_delay`` staggers the start of the ranks of a large job, so that a thousand ranks do
not fetch the dataset's index in the same second.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import threading
import time
from collections import deque

from .folders import node_folder

log = logging.getLogger("wdsvlm.storage")

FILE = "requests.json"
WINDOW = 1.0
"""Seconds of requests without throttling after which a governed rate grows."""
FORGET = 60.0
"""Seconds after which a store's rate that no request used is forgotten."""
MIN_RATE = 0.5
HOLD = 3
"""Windows spent at 0.9 x the ceiling before probing above it."""
USED = 0.8
"""The share of a window's rate the node must have sent for the rate to grow."""
LOOK = 0.1
"""Seconds between two looks of an ungoverned process at the node's budget file."""


def store_of(url: str) -> str:
    """The store a URL's requests go to, as its budget is kept: scheme and host or bucket."""
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.split('/', 1)[0]}" if rest else "file"


class Governor:
    """The budget of one node folder, as one process uses it (``governor_of``)."""

    def __init__(self, folder: str):
        self.path = os.path.join(folder, FILE)
        self.governed: set[str] = set()  # stores this process paces
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._looked = 0.0
        self._sent: deque[float] = deque(maxlen=4096)  # this process's recent requests

    def turn(self, store: str, cap: float | None) -> float:
        """Seconds to wait before sending a request to ``store`` (0: at once)."""
        now = time.monotonic()
        self._sent.append(now)
        if cap is None and store not in self.governed:
            if now - self._looked < LOOK:
                return 0.0
            self._looked = now
            if not self._learned(store):
                return 0.0
        return max(0.0, self._update(lambda state, wall: _take(state, store, cap, wall)))

    def throttled(self, store: str) -> None:
        """The store throttled one of this process's requests: lower its rate."""
        now = time.monotonic()
        recent = sum(1 for t in self._sent if now - t <= WINDOW)
        self.governed.add(store)
        self._update(lambda state, wall: _cut(state, store, max(MIN_RATE, recent), wall))

    def rate(self, store: str) -> float | None:
        """The store's governed rate on this node now (None: not governed)."""
        entry = self._update(lambda state, wall: state["stores"].get(store))
        return None if entry is None else entry["rate"]

    def _learned(self, store: str) -> bool:
        try:
            if time.time() - os.stat(self.path).st_mtime > FORGET:
                return False
        except FileNotFoundError:
            return False
        if self._update(lambda state, wall: store in state["stores"]):
            self.governed.add(store)
            return True
        return False

    def _update(self, change):
        """``change(state, now)`` applied to the node's budget file under its lock."""
        with self._lock:
            if self._fd is None:  # the folder made by the first that governs, not before
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._fd, 1 << 20, 0)
                try:
                    state = json.loads(raw) if raw else {}
                except ValueError:
                    state = {}  # a file cut short by a crash: start over
                state.setdefault("stores", {})
                wall = time.time()
                for name, entry in list(state["stores"].items()):
                    if wall - entry["seen"] > FORGET:
                        del state["stores"][name]
                result = change(state, wall)
                data = json.dumps(state).encode()
                os.pwrite(self._fd, data, 0)
                os.ftruncate(self._fd, len(data))
                return result
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)


def _take(state: dict, store: str, cap: float | None, now: float) -> float:
    """Book the next free slot for a request to ``store``: seconds from ``now`` to it."""
    entry = state["stores"].get(store)
    at = max(now, entry["next"] if entry else now, state.get("node_next", now) if cap else now)
    if cap:
        state["node_next"] = at + 1.0 / cap
    if entry is not None:
        entry["next"] = at + 1.0 / entry["rate"]
        entry["seen"] = now
        entry["sent"] += 1
        elapsed = now - entry["changed"]
        if elapsed >= WINDOW:
            # grown only where the node used its rate: a rate its readers do not reach says
            # nothing of the store's limit, and grown unused it lets the next burst through
            if entry["sent"] >= USED * entry["rate"] * elapsed:
                _grow(entry)
            entry["changed"], entry["sent"] = now, 0
    return at - now


def _grow(entry: dict) -> None:
    if entry["ceiling"] is None:  # the node's limit not found yet: half as much again
        entry["rate"] *= 1.5
        return
    target = 0.9 * entry["ceiling"]
    if entry["rate"] < target:
        gap = target - entry["rate"]
        entry["rate"] = min(target, entry["rate"] + max(gap / 2, 0.2 * target))
        entry["held"], entry["step"] = 0, 0.0
    elif entry["held"] < HOLD:
        entry["held"] += 1
    else:
        ceiling = entry["ceiling"]  # a step that doubles, from 2% to at most 10% of it
        entry["step"] = min(max(MIN_RATE, 0.02 * ceiling, 2 * entry["step"]), 0.1 * ceiling)
        entry["rate"] += entry["step"]


def _cut(state: dict, store: str, sending: float, now: float) -> None:
    entry = state["stores"].get(store)
    if entry is None:  # what this process sent, not the node: no ceiling yet
        entry = state["stores"][store] = {"rate": sending, "next": now, "booked": 0.0}
        entry["ceiling"] = None
    entry.update(seen=now, changed=now, sent=0)
    if now < entry["booked"] + WINDOW:
        # already lowered: the answers to requests booked at the old rate, and those the
        # store still counts against the second they went out in, say nothing new
        return
    log.info("%s throttles: %.1f requests/s on this node, now %.1f", store, *_lower(entry))
    entry["booked"] = max(now, entry["next"])


def _lower(entry: dict) -> tuple[float, float]:
    before, ceiling = entry["rate"], entry.get("ceiling")
    if ceiling is None and "held" not in entry:  # the first cut: this process's rate halved
        entry.update(rate=before / 2)
    elif ceiling is None:  # the end of the climb: the store's limit found, below this rate;
        entry.update(ceiling=before, rate=before / 1.5)  # back to the last rate it took
    elif before >= ceiling:  # a probe found the limit: the last rate it took is the ceiling
        entry.update(ceiling=before - entry["step"], rate=0.9 * (before - entry["step"]))
    else:  # below the ceiling (the limit fell, or requests bunched by a busy CPU): a
        # quarter off, and the ceiling a tenth lower
        entry.update(ceiling=0.9 * ceiling, rate=0.75 * before)
    entry.update(rate=max(MIN_RATE, entry["rate"]), held=0, step=0.0)
    return before, entry["rate"]


_GOVERNORS: dict[str, Governor] = {}
_GOVERNORS_LOCK = threading.Lock()


def _forget_governors() -> None:  # a forked child opens its own file and lock
    global _GOVERNORS_LOCK
    _GOVERNORS.clear()
    _GOVERNORS_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_forget_governors)


def governor_of(node_dir: str | None) -> Governor:
    """This process's ``Governor`` of the node folder ``node_dir`` (None: the default one,
    looked up each time: ``$WDSVLM_LOCAL_DIR`` may name another)."""
    key = node_dir or node_folder(make=False)
    found = _GOVERNORS.get(key)
    if found is None:
        with _GOVERNORS_LOCK:
            if key not in _GOVERNORS:
                _GOVERNORS[key] = Governor(key)
            found = _GOVERNORS[key]
    return found


def turn(
    url: str,
    node_dir: str | None,
    cap: float | None,
    cancel: threading.Event | None = None,
    most: float | None = None,
) -> bool:
    """Wait for the turn of a request to ``url`` in the budget of the node folder of
    ``node_dir`` with at most ``cap`` requests a second (at once when nothing is governed);
    False, at once, where the turn is more than ``most`` seconds away."""
    wait = governor_of(node_dir).turn(store_of(url), cap)
    if most is not None and wait > most:
        return False
    if wait > 0:
        if cancel is not None:
            cancel.wait(wait)
        else:
            time.sleep(wait)
    return True


def throttled(url: str, node_dir: str | None) -> None:
    """A request to ``url`` was throttled: lower the node's rate for its store."""
    governor_of(node_dir).throttled(store_of(url))


def start_delay(rank: int, world_size: int, ranks_per_second: float = 100.0) -> float:
    """Seconds rank ``rank`` waits before its first read, so that the ranks of a job start
    about ``ranks_per_second`` a second: none in a job of up to 64 ranks, at most 15 s."""
    if world_size <= 64:
        return 0.0
    return min(15.0, world_size / ranks_per_second) * rank / world_size


def stagger_start(rank: int, world_size: int) -> None:
    """Wait ``start_delay(rank, world_size)`` seconds."""
    delay = start_delay(rank, world_size)
    if delay > 0:
        log.info("rank %d of %d: first read in %.2f s (staggered start)", rank, world_size, delay)
        time.sleep(delay)
