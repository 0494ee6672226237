"""Shuffle buffer: bounded in samples and in bytes, seeded from explicit inputs only."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator


def sample_nbytes(sample: dict) -> int:
    """The bytes a sample holds in its payloads (tar members, arrays)."""
    total = 0
    for value in sample.values():
        if isinstance(value, (bytes, bytearray, memoryview)):
            total += len(value)
        elif hasattr(value, "nbytes"):
            total += value.nbytes
    return total


class Shuffle:
    """Pipeline stage: a shuffle buffer of at most ``buffer_size`` samples and ``buffer_bytes``
    bytes (a single sample larger than that passes through alone).

    Its random order follows from ``seed`` and the ``__pass__`` and ``__worker__`` that the
    plan puts on every sample, never from global random state; a sample of a new epoch first
    empties the buffer, so epochs do not mix. The n-th draw is a hash of
    those and n, so the buffer's whole state is its samples and the count of draws (``state``,
    which a resumed loader hands back to ``__call__``). Place it before image decoding: it
    then holds compressed bytes, not decoded pixels.
    """

    def __init__(self, buffer_size: int = 1000, buffer_bytes: int = 256 * 2**20, seed: int = 0):
        if buffer_size < 1 or buffer_bytes < 1:
            raise ValueError(
                f"buffer_size ({buffer_size}) and buffer_bytes ({buffer_bytes}) must be positive"
            )
        self.buffer_size = buffer_size
        self.buffer_bytes = buffer_bytes
        self.seed = seed
        self.peak_bytes = 0  # the most the buffer held, for tests and tuning
        self._live: dict | None = None

    def state(self) -> dict:
        """Where the running buffer stands: ``held`` (its samples, in buffer order), ``draws``
        and ``stream`` (what seeds the draws), ``last`` (``__pass__`` and ``__pos__`` of the last
        sample taken in)."""
        live = self._live
        return {
            "held": [sample for sample, _ in live["buffer"]],
            "draws": live["draws"],
            "stream": live["stream"],
            "last": live["last"],
        }

    def __call__(self, samples: Iterator[dict], *, resume: dict | None = None) -> Iterator[dict]:
        """``resume``: a ``state()`` whose ``held`` samples were read again."""
        buffer = [(s, sample_nbytes(s)) for s in resume["held"]] if resume else []
        self._live = {
            "buffer": buffer,
            "draws": resume["draws"] if resume else 0,
            "stream": resume["stream"] if resume else None,
            "last": resume["last"] if resume else None,
        }
        return self._run(samples, self._live)

    def _run(self, samples: Iterator[dict], live: dict) -> Iterator[dict]:
        buffer = live["buffer"]
        held = sum(size for _, size in buffer)
        for sample in samples:
            if live["stream"] is None:
                live["stream"] = f"{sample.get('__pass__', 0)}/{sample.get('__worker__', 0)}"
            size = sample_nbytes(sample)
            if buffer and sample.get("__pass__") != buffer[-1][0].get("__pass__"):
                while buffer:  # a new epoch begins: the last one's samples all go first
                    yield self._pop(live)[0]
                held = 0
            while buffer and (len(buffer) >= self.buffer_size or held + size > self.buffer_bytes):
                out, out_size = self._pop(live)
                held -= out_size
                yield out
            buffer.append((sample, size))
            live["last"] = (sample.get("__pass__"), sample.get("__pos__"))
            held += size
            self.peak_bytes = max(self.peak_bytes, held)
        while buffer:
            yield self._pop(live)[0]

    def _pop(self, live: dict):
        buffer = live["buffer"]
        key = f"wdsvlm-shuffle/{self.seed}/{live['stream']}/{live['draws']}".encode()
        live["draws"] += 1
        i = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % len(buffer)
        buffer[i], buffer[-1] = buffer[-1], buffer[i]
        return buffer.pop()
