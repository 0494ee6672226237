"""The keyed order of a pass (plan version 3): computed place by place, never materialised.

A worker finds its block of a pass and the samples in it from closed forms, in time and memory
that grow with its block, not with the dataset (``PassOrder`` of version 2 builds the whole
pass's list of chunk visits in every worker: 1.4 GB at a billion samples).

- A source's samples are numbered shard after shard. Its **chunks** are runs of ``m``
  consecutive samples (the last one shorter), ``m`` from the source's mean sample size
  (``span_bytes``, at most ``span_samples`` and the mean shard's samples). A chunk may run on
  into the next shards (into several where shards are much smaller than the mean): it is then
  read with one ranged read of each shard it touches (``KeyedOrder.pieces``).
- A source's share of a pass is ``copies`` **laps** (every chunk once, in the order of a keyed
  bijection of the chunks, ``Bijection``) and ``extra`` samples: the window ``[start, start +
  extra)`` of a rotation (a keyed bijection fixed for the source), moved on pass by pass.
- The sources' visits are interleaved evenly (``_Interleave``): among the first ``x`` visits of
  the pass, each source has its share of them, rounded the same way on every topology.
- The samples of a visit come in a keyed order of their own, shard by shard.

Where a visit begins is a sum over the sources of closed forms, so the visit holding a place is
found by bisection. ``ordered=True`` (evaluation) is the same with identity bijections and the
sources one after another: the sources, their shards and samples as the indexes list them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from .order import seeded_rng
from .sources import DataSource

_ROUNDS = 4
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """A 64-bit finaliser (splitmix64's): every input bit reaches every output bit."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class Bijection:
    """A keyed permutation of ``range(n)``: a Feistel network of ``_ROUNDS`` rounds on the
    smallest domain of an even number of bits that holds ``n``, walked in cycles back into
    ``range(n)``. Any element in constant time and memory; ``identity=True``: no permutation."""

    def __init__(self, n: int, *key: object, identity: bool = False):
        self.n, self.identity = int(n), identity
        bits = max(2, (max(1, self.n) - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        rng = seeded_rng("wdsvlm-bijection", *key)
        self.keys = [np.uint64(k) for k in rng.integers(0, 2**63, _ROUNDS, dtype=np.int64)]

    def __call__(self, x):
        return self._walk(x, self._forward)

    def inverse(self, y):
        return self._walk(y, self._backward)

    def _walk(self, x, rounds):
        scalar = np.isscalar(x)
        x = np.atleast_1d(np.asarray(x, dtype=np.int64))
        if self.identity:
            out = x
        else:
            out = rounds(x.astype(np.uint64))
            outside = out >= self.n
            while outside.any():  # cycle walking: a bijection of range(n) again
                out[outside] = rounds(out[outside])
                outside = out >= self.n
            out = out.astype(np.int64)
        return int(out[0]) if scalar else out

    def _forward(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def _backward(self, y: np.ndarray) -> np.ndarray:
        left, right = y >> self.half, y & self.mask
        for key in reversed(self.keys):
            left, right = right ^ (_mix(left ^ key) & self.mask), left
        return (left << self.half) | right


def chunk_size(source: DataSource, span_bytes: int, span_samples: int | None) -> int:
    """Samples per chunk of a source: about ``span_bytes`` of its mean sample, at most
    ``span_samples`` and the mean shard's samples, at least 1. Where shards hold about the same
    number of samples a chunk lies in one shard or two; a shard much smaller than the mean
    (a short last shard, tars of other writers) can put a chunk across three or more: each
    part is its own ranged read (``KeyedOrder.pieces``), so nothing depends on the count."""
    shards = max(1, len(source.sample_ends) - 1)
    m = max(1, span_bytes * source.size // max(1, source.bytes))
    span_samples = source.chunk_cap(span_samples)  # smaller for a source heavy in tokens
    if span_samples is not None:
        m = min(m, span_samples)
    return max(1, min(m, source.size // shards))


class _Chunks:
    """A bijection's order of a source's chunks as a run of samples: position ``i`` holds chunk
    ``order(i)``; the short last chunk sits at position ``q``."""

    def __init__(self, n: int, m: int, order: Bijection):
        self.n, self.m, self.order = n, m, order
        self.count = -(-n // m)
        self.short = n - (self.count - 1) * m
        self.q = order.inverse(self.count - 1)

    def begin(self, i: int) -> int:
        """Where position ``i`` (0 ..count) begins in the run."""
        return i * self.m - (self.m - self.short) * (i > self.q)

    def position(self, x: int) -> int:
        """The position that holds sample ``x`` (0 ..n-1) of the run."""
        qm = self.q * self.m
        if x < qm:
            return x // self.m
        if x < qm + self.short:
            return self.q
        return self.q + 1 + (x - qm - self.short) // self.m

    def samples(self, i: int, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """The source's samples ``[a, b)`` of position ``i``, from ``lo`` to ``hi`` into it."""
        chunk = self.order(i)
        size = self.short if chunk == self.count - 1 else self.m
        return chunk * self.m + lo, chunk * self.m + (size if hi is None else hi)


class _SourcePass:
    """One source's samples in a pass: ``copies`` laps, then ``extra`` samples from place
    ``start`` of its rotation; ``visits`` of them, visit ``j`` beginning at ``begin(j)``."""

    def __init__(self, number, source, seed, pass_, m, copies, extra, start, ordered):
        self.number, self.n, self.m, self.ordered = number, source.size, m, ordered
        self.copies, self.extra, self.start = copies, extra, start
        if not self.n:  # a bijection of nothing would walk for ever
            raise ValueError(f"{source.name}: the dataset has no samples")
        self._key = (seed, pass_, number)
        self._laps: OrderedDict[int, _Chunks] = OrderedDict()
        self.count = c = -(-self.n // m)  # chunks
        rotation = Bijection(c, "extra", seed, number, source.name, identity=ordered)
        self.rotation = _Chunks(self.n, m, rotation)
        if extra:
            self.first = self.rotation.position(start)  # unwrapped positions of the window
            last = start + extra - 1
            self.last_visit = c * (last // self.n) + self.rotation.position(last % self.n)
            self.visits = copies * c + self.last_visit - self.first + 1
        else:
            self.visits = copies * c

    def lap(self, k: int) -> _Chunks:
        chunks = self._laps.get(k)
        if chunks is None:
            order = Bijection(self.count, "lap", *self._key, k, identity=self.ordered)
            chunks = self._laps[k] = _Chunks(self.n, self.m, order)
            while len(self._laps) > 4:
                self._laps.popitem(last=False)
        return chunks

    def _unwrapped(self, i: int) -> int:
        c = self.count
        return self.n * (i // c) + self.rotation.begin(i % c)

    def begin(self, j: int) -> int:
        """Samples of this source before its visit ``j`` (0 ..visits)."""
        c = self.count
        if j <= self.copies * c:
            k, i = divmod(j, c)
            return k * self.n + (self.lap(k).begin(i) if i else 0)
        i = j - self.copies * c
        if i >= self.visits - self.copies * c:
            return self.copies * self.n + self.extra
        return self.copies * self.n + self._unwrapped(self.first + i) - self.start

    def samples(self, j: int) -> tuple[int, int]:
        """The source's samples ``[a, b)`` of visit ``j`` (a chunk, or part of one)."""
        c = self.count
        if j < self.copies * c:
            return self.lap(j // c).samples(j % c)
        i = self.first + j - self.copies * c
        lo = max(self.start, self._unwrapped(i))
        hi = min(self.start + self.extra, self._unwrapped(i + 1))
        base = self._unwrapped(i)
        return self.rotation.samples(i % c, lo - base, hi - base)


class _Interleave:
    """Which source each visit of the pass comes from: a binary tree over the sources, each
    node splitting its visits between its halves as evenly as their counts allow (``x`` visits
    of a node hold ``x * left // total`` of its left half's), or one after another
    (``ordered``). Every source's count is non-decreasing in ``x``, on every topology."""

    def __init__(self, counts: Sequence[int], ordered: bool):
        self.counts, self.ordered = list(counts), ordered
        self.ends = np.cumsum([0, *self.counts])

    def _left(self, lo: int, mid: int, hi: int, x: int) -> int:
        left = int(self.ends[mid] - self.ends[lo])
        if self.ordered:
            return min(x, left)
        return x * left // max(1, int(self.ends[hi] - self.ends[lo]))

    def split(self, x: int) -> list[int]:
        """Each source's visits among the first ``x`` of the pass."""
        out = [0] * len(self.counts)

        def down(lo, hi, x):
            if hi - lo == 1:
                out[lo] = x
                return
            mid = (lo + hi) // 2
            left = self._left(lo, mid, hi, x)
            down(lo, mid, left)
            down(mid, hi, x - left)

        down(0, len(self.counts), x)
        return out

    def source_of(self, x: int) -> tuple[int, int]:
        """``(source, its visit number)`` of the pass's visit ``x``."""
        lo, hi = 0, len(self.counts)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            left = self._left(lo, mid, hi, x)
            if self._left(lo, mid, hi, x + 1) > left:
                hi, x = mid, left
            else:
                lo, x = mid, x - left
        return lo, x


class KeyedOrder:
    """The order of one pass under plan version 3, with the interface ``Plan`` reads
    (``size``, ``visit_at``, ``bounds``, ``pieces``, ``entry_at``)."""

    def __init__(
        self,
        sources: Sequence[DataSource],
        seed: int,
        pass_: int,
        span_bytes: int,
        span_samples: int | None = None,
        ordered: bool = False,
        counts: Sequence[tuple[int, int, int]] | None = None,
    ):
        self.sources, self.ordered, self._seed, self._pass = sources, ordered, seed, pass_
        self.parts = []
        for number, source in enumerate(sources):
            copies, extra, start = (
                counts[number]
                if counts is not None
                else (source.copies, source.extra, (pass_ * source.extra) % max(1, source.size))
            )
            m = chunk_size(source, span_bytes, span_samples)
            part = _SourcePass(number, source, seed, pass_, m, copies, extra, start, ordered)
            self.parts.append(part)
        self.interleave = _Interleave([p.visits for p in self.parts], ordered)
        self.visits = int(self.interleave.ends[-1])
        self.size = self.begin(self.visits)
        self._pieces: OrderedDict[int, list] = OrderedDict()

    def begin(self, x: int) -> int:
        """The place where the pass's visit ``x`` begins (``size`` at ``visits``)."""
        split = self.interleave.split(x)
        return sum(part.begin(j) for part, j in zip(self.parts, split, strict=True))

    def visit_at(self, place: int) -> int:
        lo, hi = 0, self.visits  # begin(lo) <= place < begin(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.begin(mid) <= place:
                lo = mid
            else:
                hi = mid
        return lo

    def bounds(self, x: int) -> tuple[int, int]:
        """Places ``[a, b)`` of visit ``x``."""
        return self.begin(x), self.begin(x + 1)

    def pieces(self, x: int) -> list[tuple[int, int, np.ndarray]]:
        """``(source, shard, entry numbers)`` of visit ``x`` in its order: shard after shard,
        the samples of each in a keyed order (none for ``ordered``)."""
        found = self._pieces.get(x)
        if found is None:
            s, j = self.interleave.source_of(x)
            a, b = self.parts[s].samples(j)
            ends = self.sources[s].sample_ends
            rng = None if self.ordered else seeded_rng("wdsvlm-visit", self._seed, self._pass, x)
            found = []
            while a < b:
                shard = int(np.searchsorted(ends, a, side="right")) - 1
                stop = min(b, int(ends[shard + 1]))
                entries = np.arange(a - int(ends[shard]), stop - int(ends[shard]))
                found.append((s, shard, entries if rng is None else rng.permutation(entries)))
                a = stop
            self._pieces[x] = found
            while len(self._pieces) > 8:
                self._pieces.popitem(last=False)
        return found

    def entry_at(self, place: int) -> tuple[int, int, int]:
        """``(source, shard, entry)`` at ``place``."""
        x = self.visit_at(place)
        k = place - self.begin(x)
        for s, shard, entries in self.pieces(x):
            if k < len(entries):
                return s, shard, int(entries[k])
            k -= len(entries)
        raise IndexError(f"place {place} is outside the pass of {self.size} samples")
