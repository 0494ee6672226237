"""Shuffle buffer: bounded in samples and in bytes, seeded from explicit inputs only."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .places import Fetch, Place, StageRun, copied, places_of, present


def sample_nbytes(sample: dict) -> int:
    """The bytes a sample holds in its payloads (tar members, arrays)."""
    total = 0
    for value in sample.values():
        if isinstance(value, (bytes, bytearray, memoryview)):
            total += len(value)
        elif hasattr(value, "nbytes"):
            total += value.nbytes
    return total


@dataclass
class ShuffleState:
    """Where a shuffle buffer stands: the places of the samples it ``held`` (buffer order),
    the count of ``draws`` and the ``stream`` name that seed the next draw, and ``last``, the
    ``(pass, place)`` of the last sample taken in (what was read up to)."""

    held: list[Place] = field(default_factory=list)
    draws: int = 0
    stream: str | None = None
    last: Any = None

    def held_places(self) -> list[Place]:
        return list(self.held)

    def saved(self) -> dict:
        last = None if self.last is None else list(self.last)
        return {"held": copied(self.held), "draws": self.draws, "stream": self.stream, "last": last}

    @classmethod
    def from_saved(cls, saved: dict) -> ShuffleState:
        return cls(copied(saved["held"]), saved["draws"], saved["stream"], saved["last"])


class Shuffle:
    """Pipeline stage: a shuffle buffer of at most ``buffer_size`` samples and ``buffer_bytes``
    bytes (a single sample larger than that passes through alone).

    Its random order follows from ``seed`` and the ``__pass__`` and ``__worker__`` that the
    plan puts on every sample, never from global random state; a sample of a new epoch first
    empties the buffer, so epochs do not mix. The n-th draw is a hash of those and n, so a
    run's whole state is its samples and the count of draws (``ShuffleRun.state``, which
    ``restore`` goes on from). Place it before image decoding: it then holds compressed
    bytes, not decoded pixels.
    """

    def __init__(self, buffer_size: int = 1000, buffer_bytes: int = 256 * 2**20, seed: int = 0):
        if buffer_size < 1 or buffer_bytes < 1:
            raise ValueError(
                f"buffer_size ({buffer_size}) and buffer_bytes ({buffer_bytes}) must be positive"
            )
        self.buffer_size = buffer_size
        self.buffer_bytes = buffer_bytes
        self.seed = seed

    def __call__(self, samples: Iterator[dict]) -> ShuffleRun:
        return ShuffleRun(self, samples, [], ShuffleState())

    def restore(self, state: ShuffleState, samples: Iterator[dict], fetch: Fetch) -> ShuffleRun:
        """A run that goes on from ``state``, its held samples taken back from ``fetch``."""
        return ShuffleRun(self, samples, present(fetch(state.held)), state)

    def again(self, samples: list[dict]) -> list[dict]:
        """Samples as this stage hands them on: unchanged."""
        return samples


class ShuffleRun(StageRun):
    """One iteration of a ``Shuffle``: its buffer and draws. ``peak_bytes`` is the most the
    buffer held (for tests and tuning)."""

    def __init__(self, stage: Shuffle, samples: Iterator[dict], held: list[dict], state):
        self.stage = stage
        self.buffer = [(s, sample_nbytes(s)) for s in held]
        self.draws: int = state.draws
        self.stream: str | None = state.stream
        self.last = state.last
        self.peak_bytes = 0
        super().__init__(self._run(samples))

    def state(self) -> ShuffleState:
        return ShuffleState(
            places_of([s for s, _ in self.buffer]), self.draws, self.stream, self.last
        )

    def _run(self, samples: Iterator[dict]) -> Iterator[dict]:
        buffer, stage = self.buffer, self.stage
        held = sum(size for _, size in buffer)
        for sample in samples:
            if self.stream is None:
                self.stream = f"{sample.get('__pass__', 0)}/{sample.get('__worker__', 0)}"
            size = sample_nbytes(sample)
            if buffer and sample.get("__pass__") != buffer[-1][0].get("__pass__"):
                while buffer:  # a new epoch begins: the last one's samples all go first
                    yield self._pop()[0]
                held = 0
            while buffer and (len(buffer) >= stage.buffer_size or held + size > stage.buffer_bytes):
                out, out_size = self._pop()
                held -= out_size
                yield out
            buffer.append((sample, size))
            self.last = (sample.get("__pass__"), sample.get("__pos__"))
            held += size
            self.peak_bytes = max(self.peak_bytes, held)
        while buffer:
            yield self._pop()[0]

    def _pop(self) -> tuple[dict, int]:
        buffer = self.buffer
        key = f"wdsvlm-shuffle/{self.stage.seed}/{self.stream}/{self.draws}".encode()
        self.draws += 1
        i = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % len(buffer)
        buffer[i], buffer[-1] = buffer[-1], buffer[i]
        return buffer.pop()
