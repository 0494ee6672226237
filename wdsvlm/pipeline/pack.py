"""The packing stages: ``Pack`` (tokenized samples -> packs filling one row of
``max_length``, by ``packer.Packer``) and ``BalanceBatches`` (packs -> batches of even vision
load). Each runs an iteration as a ``StageRun`` whose state is places (``places.py``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from .packer import Packed, Packer, PackStats
from .places import Fetch, Place, StageRun, copied, places_of, present


def tiles_cv(batches: int, total: int, squares: int) -> float:
    """Coefficient of variation from a count, a sum and a sum of squares."""
    if batches == 0 or total == 0:
        return 0.0
    mean = total / batches
    return math.sqrt(max(0.0, squares / batches - mean * mean)) / mean


def vision_units(sample: dict) -> int:
    """The sample's vision units against the pack's budget: its images' tiles or patches and
    its videos' patches."""
    return sum(sample["image_tiles"]) + sum(sample.get("video_units", ()))


def truncate_at_answer(sample: dict, max_length: int) -> dict | None:
    """The sample cut after its last whole answer (with its end-of-turn token) that fits in
    ``max_length``, dropping the images and videos whose tokens fall after the cut; None when
    not even the first answer fits. The cut is at the end of an answer, so never inside an
    image's or a video's tokens; ``image_at`` and ``video_at`` (set by ``Tokenize``) say where
    each one's tokens start.
    """
    from ..format.images import image_members
    from ..format.videos import video_members
    from .tokenize import IGNORE_INDEX

    supervised = sample["labels"] != IGNORE_INDEX
    run_ends = supervised & ~np.append(supervised[1:], False)
    ends = np.flatnonzero(run_ends[:max_length]) + 1
    if len(ends) == 0:
        return None
    cut = int(ends[-1])
    kept = sum(1 for at in sample["image_at"] if at < cut)
    out = {k: v for k, v in sample.items() if k not in image_members(sample)[kept:]}
    out["input_ids"] = sample["input_ids"][:cut]
    out["labels"] = sample["labels"][:cut]
    out["num_tokens"] = cut
    out["image_tiles"] = list(sample["image_tiles"][:kept])
    out["image_at"] = list(sample["image_at"][:kept])
    if "__meta__" in sample:
        out["__meta__"] = {**sample["__meta__"], "images": sample["__meta__"]["images"][:kept]}
    if "pixel_values" in sample:
        out["pixel_values"] = sample["pixel_values"][: sum(out["image_tiles"])]
    if "video_at" in sample:
        videos = sum(1 for at in sample["video_at"] if at < cut)
        for name in video_members(sample)[videos:]:
            out.pop(name, None)
        out["video_units"] = list(sample["video_units"][:videos])
        out["video_at"] = list(sample["video_at"][:videos])
        if "__meta__" in sample:
            out["__meta__"]["videos"] = sample["__meta__"]["videos"][:videos]
        if "video_values" in sample:
            out["video_values"] = sample["video_values"][: sum(out["video_units"])]
    return out


@dataclass
class WindowState:
    """Where a packing window stands: the ``places`` of the samples waiting in it (window
    order), when each ``came`` (in packs emitted), the count of packs ``emitted``, and the
    packs made but not yet handed on (``ready``, as places)."""

    places: list[Place] = field(default_factory=list)
    came: list[int] = field(default_factory=list)
    emitted: int = 0
    ready: list[list[Place]] = field(default_factory=list)

    def held_places(self) -> list[Place]:
        return list(self.places) + [p for pack in self.ready for p in pack]

    def saved(self) -> dict:
        return {
            "places": copied(self.places),
            "came": list(self.came),
            "emitted": self.emitted,
            "ready": [copied(pack) for pack in self.ready],
        }

    @classmethod
    def from_saved(cls, saved: dict) -> WindowState:
        return cls(
            copied(saved["places"]),
            list(saved["came"]),
            saved["emitted"],
            [copied(pack) for pack in saved["ready"]],
        )


class Pack:
    """Pipeline stage: tokenized samples -> packs (lists of samples, in pack order).

    Samples of one pass (``__pass__``) are packed together: the first sample of a new pass
    first empties the window of the last one's (``Packer.drain``: by best-fit-decreasing over
    all the window holds, so the end of a pass packs about as well as its middle). Letting
    the window run on into the next pass instead did worse on ``scripts/bench_packing.py``'s
    pass-end case (+0.82 pp against best-fit at 1024 tokens, against +0.17 pp).

    A sample longer than ``max_length`` or with more tiles than ``max_tiles_per_pack`` is
    dropped and counted (``too_many_tokens``, ``too_many_vision_units``, in the run's ``stats`` with
    its key): a drop is good data outside the budgets, not a failure, so it is not "skipped".
    With ``truncate=True`` a sample that is only too long is cut after its last whole answer
    that fits instead (``truncate_at_answer``; counted in ``stats.truncated``).
    ``unit`` names the vision units in messages: tiles, or a model family's patches.
    """

    def __init__(
        self,
        max_length: int,
        *,
        max_tiles_per_pack: int | None = None,
        window: int = 500,
        truncate: bool = False,
        unit: str = "tiles",
    ):
        self.truncate = truncate
        self.unit = unit
        self.max_length = max_length
        self.max_tiles_per_pack = max_tiles_per_pack
        self.window = window
        self._limits = Packer(max_length, max_tiles_per_pack)  # for fit(), made once

    def __call__(self, samples: Iterator[dict]) -> PackRun:
        return PackRun(self, samples, Packer(self.max_length, self.max_tiles_per_pack, self.window))

    def restore(self, state: WindowState, samples: Iterator[dict], fetch: Fetch) -> PackRun:
        """A run that goes on from ``state``: its window and ready packs taken back from
        ``fetch`` (tokenized), in their order; a sample ``fetch`` cannot have is left out."""
        packer = Packer(self.max_length, self.max_tiles_per_pack, self.window)
        packer.emitted = state.emitted
        for sample, came in zip(fetch(state.places), state.came, strict=True):
            if sample is not None:
                sample, tokens, tiles, _ = self.fit(sample)
                packer.waiting.append((sample, tokens, tiles, came))
        run = PackRun(self, samples, packer)
        for places in state.ready:
            pack = self.again(present(fetch(places)))
            if pack:
                run.ready.append(pack)
        return run

    def again(self, samples: list[dict]) -> list[dict]:
        """Samples as this stage hands them on (inside packs): as they go into the window."""
        return [self.fit(s)[0] for s in samples]

    def fit(
        self, sample: dict, stats: PackStats | None = None
    ) -> tuple[dict, int, int, str | None]:
        """The sample as it goes into the window (cut, if it is too long and ``truncate``:
        counted in ``stats`` when given), its tokens and tiles, and why it cannot be packed
        at all (or None)."""
        limits = self._limits
        tokens, tiles = sample["num_tokens"], vision_units(sample)
        reason = limits.oversized(tokens, tiles)
        if reason == "too_many_tokens" and self.truncate:
            cut = truncate_at_answer(sample, self.max_length)
            if cut is not None:
                if stats is not None:
                    stats.truncated += 1
                sample, tokens, tiles = cut, cut["num_tokens"], vision_units(cut)
                reason = limits.oversized(tokens, tiles)
        return sample, tokens, tiles, reason


class PackRun(StageRun):
    """One iteration of a ``Pack``: its ``packer`` (window and ``stats``), the packs made and
    not yet handed on (``ready``), and ``accepted``, the samples taken into the window so
    far (the stream's progress)."""

    def __init__(self, stage: Pack, samples: Iterator[dict], packer: Packer):
        self.stage = stage
        self.packer = packer
        self.stats: PackStats = packer.stats
        self.ready: deque[list[dict]] = deque()
        self.accepted = 0
        super().__init__(self._run(samples))

    def state(self) -> WindowState:
        waiting = self.packer.waiting
        return WindowState(
            places_of([w[0] for w in waiting]),
            [w[3] for w in waiting],
            self.packer.emitted,
            [places_of(pack) for pack in self.ready],
        )

    def _run(self, samples: Iterator[dict]) -> Iterator[list[dict]]:
        stage, packer, ready = self.stage, self.packer, self.ready
        while ready:
            yield ready.popleft()
        for sample in samples:
            sample, tokens, tiles, reason = stage.fit(sample, self.stats)
            if reason:  # dropped: good data that does not fit the budgets (never "skipped")
                self.stats.drop(
                    reason,
                    sample,
                    f"{tokens} tokens, {tiles} {stage.unit}; a pack holds {stage.max_length} "
                    "tokens"
                    + (
                        f" and {stage.max_tiles_per_pack} {stage.unit}"
                        if stage.max_tiles_per_pack is not None
                        else ""
                    ),
                )
                continue
            if packer.waiting and sample.get("__pass__") != packer.waiting[-1][0].get("__pass__"):
                ready.extend(packer.drain())  # a new pass begins: the last one's samples first
            # the sample goes into the window before any pack is handed on, and packs wait in
            # ``ready``: a state taken while a pack is out holds every sample
            self.accepted += 1
            ready.extend(packer.push(sample, tokens, tiles))
            while ready:
                yield ready.popleft()
        ready.extend(packer.drain())  # the end: the window's last packs, held until handed on
        while ready:
            yield ready.popleft()


def count_held(stats: PackStats, pack: list[dict], max_length: int) -> None:
    """Count ``pack`` in ``stats`` as one a batch holds, with the figures the packer gave it
    (``Packed``). A pack a resumed stream took back from a state is counted from its
    samples; whether the vision budget ended it is not known again, so it is not counted as
    bound."""
    if not isinstance(pack, Packed):
        pack = Packed(pack)
        pack.tokens, pack.tiles = sum(s["num_tokens"] for s in pack), _tiles_of(pack)
    stats.count(pack, max_length)


def _pass_of(pack: list[dict]):
    return pack[0].get("__pass__") if pack else None


def _tiles_of(pack: list[dict]) -> int:
    return sum(vision_units(s) for s in pack)


def choose_batch(tiles: Sequence[int], batch_size: int, target: float) -> list[int]:
    """Indices of ``batch_size`` packs (of those waiting, oldest first) whose tiles add up
    close to ``target``: the oldest pack, then each time the pack that brings the running sum
    closest to its share of the target. Fewer than ``batch_size`` waiting: all of them."""
    if len(tiles) <= batch_size:
        return list(range(len(tiles)))
    chosen = [0]
    total = tiles[0]
    left = set(range(1, len(tiles)))
    while len(chosen) < batch_size:
        goal = target * (len(chosen) + 1) / batch_size
        best = min(left, key=lambda i: (abs(total + tiles[i] - goal), i))
        chosen.append(best)
        left.remove(best)
        total += tiles[best]
    return sorted(chosen)


@dataclass
class BalanceState:
    """The packs waiting for a batch, oldest first, as places."""

    packs: list[list[Place]] = field(default_factory=list)

    def held_places(self) -> list[Place]:
        return [p for pack in self.packs for p in pack]

    def saved(self) -> list[list[Place]]:
        return [copied(pack) for pack in self.packs]

    @classmethod
    def from_saved(cls, saved: list) -> BalanceState:
        return cls([copied(pack) for pack in saved])


class BalanceBatches:
    """Pipeline stage: packs -> batches (lists of ``batch_size`` packs) of even vision load.

    Holds up to ``spread * batch_size`` packs and forms each batch around the mean tiles of
    what it holds (``choose_batch``); packs keep their fill, only their grouping changes. The
    oldest pack always goes into the next batch, so no pack waits long. When packs of a new
    pass (``__pass__``) arrive, the last pass's packs are batched among themselves first
    (fewer than ``batch_size`` left over join the new pass's batches). A run's ``cv`` is the
    coefficient of variation of tiles per full batch so far.
    """

    def __init__(self, batch_size: int, spread: int = 4):
        if batch_size < 1 or spread < 1:
            raise ValueError(f"batch_size ({batch_size}) and spread ({spread}) must be positive")
        self.batch_size = batch_size
        self.spread = spread

    def __call__(self, packs: Iterator[list[dict]]) -> BalanceRun:
        return BalanceRun(self, packs, [])

    def restore(self, state: BalanceState, packs: Iterator[list[dict]], fetch: Fetch) -> BalanceRun:
        """A run that goes on from ``state``: the packs it held, their samples taken back
        from ``fetch`` (as packed); a pack none of whose samples ``fetch`` can have is gone."""
        held = [pack for pack in (present(fetch(p)) for p in state.packs) if pack]
        return BalanceRun(self, packs, held)

    def again(self, samples: list[dict]) -> list[dict]:
        """Samples as this stage hands them on (inside batches): unchanged."""
        return samples


class BalanceRun(StageRun):
    """One iteration of a ``BalanceBatches``: the packs it holds, with their tiles, and
    ``figures``: full batches, the sum of their tiles and of its squares."""

    def __init__(self, stage: BalanceBatches, packs: Iterator[list[dict]], held: list):
        self.stage = stage
        self.held = [(pack, _tiles_of(pack)) for pack in held]
        self.figures = [0, 0, 0]
        super().__init__(self._run(packs))

    @property
    def cv(self) -> float:
        return tiles_cv(*self.figures)

    def state(self) -> BalanceState:
        return BalanceState([places_of(pack) for pack, _ in self.held])

    def _run(self, packs: Iterator[list[dict]]) -> Iterator[list[list[dict]]]:
        # Decided afresh before each pull from what is held, so a resumed stage that holds
        # the same packs goes on the same way.
        held, batch_size = self.held, self.stage.batch_size
        while True:
            newest = _pass_of(held[-1][0]) if held else None
            older = [i for i, (pack, _) in enumerate(held) if _pass_of(pack) != newest]
            if len(older) >= batch_size:  # a new pass began: batch the last one's first
                yield self._take(older)
            elif len(held) >= self.stage.spread * batch_size:
                yield self._take(range(len(held)))
            else:
                pack = next(packs, None)
                if pack is None:
                    break
                held.append((pack, _tiles_of(pack)))
        while held:
            yield self._take(range(len(held)))

    def _take(self, among: Sequence[int]) -> list[list[dict]]:
        held, batch_size = self.held, self.stage.batch_size
        among = list(among)
        tiles = [held[i][1] for i in among]
        target = sum(tiles) / len(tiles) * batch_size
        chosen = sorted(among[i] for i in choose_batch(tiles, batch_size, target))
        if len(chosen) == batch_size:
            total = sum(held[i][1] for i in chosen)
            self.figures[0] += 1
            self.figures[1] += total
            self.figures[2] += total * total
        batch = [held[i][0] for i in chosen]
        for i in reversed(chosen):
            del held[i]
        return batch
