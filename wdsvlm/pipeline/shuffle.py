"""Shuffle buffer: bounded in samples and in bytes, seeded from explicit inputs only.

With ``by_tokens`` (a mixture weighed by tokens), the buffer keeps each source's share of the
supervised tokens it hands on to the share that came in: each draw is of the source furthest
behind (its estimated supervised tokens, from the index entry, that came in, scaled to what
went out, less what went out), then of a random sample of it. Drawn uniformly, a source with
few, long samples in the buffer (documents among captions) leaves it in bursts, and a window
of batches holds a random number of them; this way its samples leave as evenly as they came.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .places import Fetch, Place, StageRun, copied, places_of, present
from .token_weights import supervised_estimate


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
    ``(pass, place)`` of the last sample taken in (what was read up to); by tokens, each
    source's estimated supervised tokens that came ``in`` and went ``out``."""

    held: list[Place] = field(default_factory=list)
    draws: int = 0
    stream: str | None = None
    last: Any = None
    tokens: dict = field(default_factory=dict)  # source: [in, out]

    def held_places(self) -> list[Place]:
        return list(self.held)

    def saved(self) -> dict:
        last = None if self.last is None else list(self.last)
        out = {"held": copied(self.held), "draws": self.draws, "stream": self.stream, "last": last}
        if self.tokens:
            out["tokens"] = {k: [float(a), float(b)] for k, (a, b) in self.tokens.items()}
        return out

    @classmethod
    def from_saved(cls, saved: dict) -> ShuffleState:
        tokens = {str(k): [float(a), float(b)] for k, (a, b) in saved.get("tokens", {}).items()}
        return cls(copied(saved["held"]), saved["draws"], saved["stream"], saved["last"], tokens)


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

    def __init__(
        self,
        buffer_size: int = 1000,
        buffer_bytes: int = 256 * 2**20,
        seed: int = 0,
        by_tokens: bool = False,
    ):
        if buffer_size < 1 or buffer_bytes < 1:
            raise ValueError(
                f"buffer_size ({buffer_size}) and buffer_bytes ({buffer_bytes}) must be positive"
            )
        self.buffer_size = buffer_size
        self.buffer_bytes = buffer_bytes
        self.seed = seed
        self.by_tokens = by_tokens

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
        self.tokens = {k: list(v) for k, v in state.tokens.items()}  # source: [in, out]
        self.in_buffer = Counter(str(s.get("__source__")) for s, _ in self.buffer)
        self.peak_bytes = 0
        super().__init__(self._run(samples))

    def state(self) -> ShuffleState:
        return ShuffleState(
            places_of([s for s, _ in self.buffer]),
            self.draws,
            self.stream,
            self.last,
            {k: list(v) for k, v in self.tokens.items()},
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
            if self.stage.by_tokens:
                name = str(sample.get("__source__"))
                counts = self.tokens.setdefault(name, [0.0, 0.0])
                counts[0] += supervised_estimate(sample.get("__meta__", {}))
                self.in_buffer[name] += 1
            self.last = (sample.get("__pass__"), sample.get("__pos__"))
            held += size
            self.peak_bytes = max(self.peak_bytes, held)
        while buffer:
            yield self._pop()[0]

    def _pop(self) -> tuple[dict, int]:
        buffer = self.buffer
        key = f"wdsvlm-shuffle/{self.stage.seed}/{self.stream}/{self.draws}".encode()
        self.draws += 1
        draw = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
        if self.stage.by_tokens:
            i = self._behind(draw)
            name = str(buffer[i][0].get("__source__"))
            self.tokens.setdefault(name, [0.0, 0.0])[1] += supervised_estimate(
                buffer[i][0].get("__meta__", {})
            )
            self.in_buffer[name] -= 1
        else:
            i = draw % len(buffer)
        buffer[i], buffer[-1] = buffer[-1], buffer[i]
        return buffer.pop()

    def _behind(self, draw: int) -> int:
        """The place in the buffer of a sample of the source furthest behind: the first of
        it from place ``draw`` on (round the buffer)."""
        buffer = self.buffer
        came = sum(c[0] for c in self.tokens.values()) or 1.0
        went = sum(c[1] for c in self.tokens.values())

        def behind(source: str) -> float:
            came_in, went_out = self.tokens.get(source, (0.0, 0.0))
            return came_in / came * went - went_out

        source = max(sorted(s for s, n in self.in_buffer.items() if n), key=behind)
        start = draw % len(buffer)
        for k in range(len(buffer)):
            i = (start + k) % len(buffer)
            if str(buffer[i][0].get("__source__")) == source:
                return i
        return start
