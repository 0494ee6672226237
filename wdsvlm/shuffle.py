"""Shuffle buffer: bounded in samples and in bytes, seeded from explicit inputs only."""

from __future__ import annotations

import random
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

    Its random order follows from ``seed`` and the ``__epoch__`` and ``__worker__`` that the
    plan puts on every sample, never from global random state. Place it before image
    decoding: it then holds compressed bytes, not decoded pixels.
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

    def __call__(self, samples: Iterator[dict]) -> Iterator[dict]:
        buffer: list[tuple[dict, int]] = []
        held = 0
        rng = None
        for sample in samples:
            if rng is None:
                rng = random.Random(
                    f"wdsvlm-shuffle/{self.seed}/{sample.get('__epoch__', 0)}/"
                    f"{sample.get('__worker__', 0)}"
                )
            size = sample_nbytes(sample)
            while buffer and (len(buffer) >= self.buffer_size or held + size > self.buffer_bytes):
                out, out_size = _pop_random(buffer, rng)
                held -= out_size
                yield out
            buffer.append((sample, size))
            held += size
            self.peak_bytes = max(self.peak_bytes, held)
        while buffer:
            yield _pop_random(buffer, rng)[0]


def _pop_random(buffer: list, rng: random.Random):
    i = rng.randrange(len(buffer))
    buffer[i], buffer[-1] = buffer[-1], buffer[i]
    return buffer.pop()
