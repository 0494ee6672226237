"""Mixture weights on a schedule: each source's share of a pass follows the training Loader's
batch count.

A source's ``weight`` may be points ``[(batch, weight), ...]`` with ``schedule="linear"``
(straight lines between the points) or ``"step"`` (each weight holds from its batch on); before
the first point the first weight holds, after the last the last. A source's share at batch
``t`` is its weight over the sources' weights at ``t``; a schedule under which every weight is
0 at some batch (``all_zero_at``) is refused when it is made.

Passes are then short (``samples_per_pass``) and each pass holds each source's share of it
at the mean share of the batches it is read in: pass ``p`` spans batches ``[p * clock,
(p + 1) * clock)`` of a rank, ``clock`` being the batches one pass packs into: a mean (its
error adds up pass after pass), worked out once by packing a pass's worth of the index's
numbers, the same on every rank (``loader/sizing.py``), and kept by a resume on another
topology. The passes' counts are whole numbers that add up to ``samples_per_pass`` (largest
remainders), and each source's extra samples rotate through it as with a fixed weight: pass
``p`` takes the next window after the ones of the passes before. So every pass is a pure
function of the sources, the seed, the pass and the clock, as without a schedule, and resume
and elastic resume stay exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

KINDS = ("linear", "step")
SAMPLES = 32  # points a pass's mean share is taken over


def weight_at(points: Sequence[tuple[float, float]], kind: str, t: float) -> float:
    """The weight of ``points`` (sorted by batch) at batch ``t``."""
    if t <= points[0][0]:
        return points[0][1]
    for (a, wa), (b, wb) in zip(points, points[1:], strict=False):
        if t < b:
            return wa if kind == "step" else wa + (wb - wa) * (t - a) / (b - a)
    return points[-1][1]


def check_points(weight, kind: str | None, where: str) -> tuple[tuple[float, float], ...]:
    """``weight``'s points as a sorted tuple, or a ValueError naming what is wrong."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"{where}: schedule must be one of {KINDS}, not {kind!r}")
    try:
        points = tuple((float(b), float(w)) for b, w in weight)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: a weight schedule is [(batch, weight), ...]: {e}") from e
    if not points:
        raise ValueError(f"{where}: a weight schedule needs at least one (batch, weight) point")
    batches = [b for b, _ in points]
    if batches != sorted(set(batches)) or batches[0] < 0:
        raise ValueError(f"{where}: the batches of a weight schedule rise from 0 or more")
    if any(not (w >= 0 and math.isfinite(w)) for _, w in points):
        raise ValueError(f"{where}: the weights of a schedule are finite numbers >= 0")
    return points


def all_zero_at(
    points: Sequence[Sequence[tuple[float, float]]], kinds: Sequence[str]
) -> float | None:
    """The first batch ``t >= 0`` at which every weight is 0, or None if there is none.

    Each weight is >= 0, so the sum is 0 exactly where every weight is. Where one weight is 0
    is a union of intervals closed at their left end: of a line, a point whose weight is 0,
    or the stretch between two such points (a line between weights above 0 never reaches
    0), or before the first point or after the last one when that weight is 0; of steps, a
    stretch ``[b, next b)`` whose weight is 0 (before the first point, ``[0, b]``). Intervals
    closed at their left ends meet, if at all, at the largest of those ends: batch 0 or a
    point of some schedule. So only those batches need looking at."""
    batches = sorted({0.0, *(b for p in points for b, _ in p)})
    for t in batches:
        if all(weight_at(p, k, t) == 0 for p, k in zip(points, kinds, strict=True)):
            return t
    return None


@dataclass
class Schedule:
    """The sources' weights over batches, and the passes' counts they give."""

    points: list[tuple[tuple[float, float], ...]]
    kinds: list[str]
    sizes: list[int]
    samples_per_pass: int
    clock: float = 1.0
    """Batches of a rank one pass spans (a mean: a pass packs into a whole number of them)."""
    given: bool = False
    """Whether ``samples_per_pass`` was given (else the Loader chooses short passes)."""
    _extras: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        t = all_zero_at(self.points, self.kinds)
        if t is not None:
            raise ValueError(
                f"every source's weight is 0 at batch {t:g} of the schedule: no source to draw "
                "from there; give one of them a weight above 0 at that batch"
            )

    def shares(self, t: float) -> list[float]:
        weights = [weight_at(p, k, t) for p, k in zip(self.points, self.kinds, strict=True)]
        total = sum(weights)
        if total <= 0:
            raise ValueError(f"every source's weight is 0 at batch {t:g}: nothing to read there")
        return [w / total for w in weights]

    def mean_shares(self, pass_: int) -> list[float]:
        """The sources' mean shares over the batches of pass ``pass_``."""
        ts = [(pass_ + (i + 0.5) / SAMPLES) * self.clock for i in range(SAMPLES)]
        per_t = [self.shares(t) for t in ts]
        return [sum(s[k] for s in per_t) / SAMPLES for k in range(len(self.sizes))]

    def counts(self, pass_: int) -> list[int]:
        """Samples of each source in pass ``pass_``: its mean share of ``samples_per_pass``,
        rounded to whole numbers that add up to it (largest remainders, then source order)."""
        wanted = [s * self.samples_per_pass for s in self.mean_shares(pass_)]
        counts = [math.floor(w) for w in wanted]
        left = self.samples_per_pass - sum(counts)
        order = sorted(range(len(wanted)), key=lambda k: (counts[k] - wanted[k], k))
        for k in order[:left]:
            counts[k] += 1
        return counts

    def pass_counts(self, pass_: int) -> list[tuple[int, int, int]]:
        """Per source, ``(copies, extra, start)`` of pass ``pass_``: every sample ``copies``
        times, and ``extra`` more from place ``start`` of its rotation (after the windows of
        the passes before)."""
        while len(self._extras) <= pass_:  # running totals of the extras, pass after pass
            p = len(self._extras)
            before = self._extras[-1] if self._extras else [0] * len(self.sizes)
            extras = [c % n if n else 0 for c, n in zip(self.counts(p), self.sizes, strict=True)]
            self._extras.append([a + b for a, b in zip(before, extras, strict=True)])
        out = []
        for k, (count, n) in enumerate(zip(self.counts(pass_), self.sizes, strict=True)):
            copies, extra = divmod(count, n) if n else (0, 0)
            start = (self._extras[pass_][k] - extra) % n if n else 0
            out.append((copies, extra, start))
        return out

    def set_clock(self, clock: float) -> None:
        if not (clock > 0 and math.isfinite(clock)):
            raise ValueError(f"a schedule's clock is batches of a rank a pass spans, not {clock}")
        self.clock, self._extras = float(clock), []

    def spec(self) -> list:
        """What a saved state records of it (the clock apart: see ``Plan.adopt_clock``)."""
        return [[list(map(list, p)), k] for p, k in zip(self.points, self.kinds, strict=True)] + [
            self.samples_per_pass
        ]
