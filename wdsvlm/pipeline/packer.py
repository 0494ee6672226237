"""Packing on numbers: ``(tokens, tiles)`` per sample in, packs (rows of ``max_length``) out.

A sliding window holds up to ``window`` samples. Each pack starts with the longest sample in
the window (or the oldest, once it has waited ``max_wait`` packs: nothing waits for ever),
then the rest of the row is filled by an exact subset-sum over the window's token counts (a
bitset knapsack: the best fill reachable, not the first that greedy finds), under both
budgets: ``max_length`` tokens and ``max_tiles_per_pack`` image tiles. A fill that takes the
largest sample that fits beside the first one is preferred when it is as good within
``_PARTNER_SLACK`` (``_FORCED_SHARE`` beside an oldest one): exact fills made of small samples
would otherwise leave the mid-sized ones to pile up in the window. Samples left out stay in the
window for later packs; none is dropped. At the end of a pass (and of the stream) the window
drains by best-fit-decreasing over all it holds, or pack by pack when that needs fewer packs:
one pack at a time would strand the long samples at the end without partners.

Packing needs only ``(tokens, tiles)`` per sample, so it is a pure function of the input order
and the settings: ``Packer`` works on those numbers; ``pack.Pack`` is the stage around it.
"""

from __future__ import annotations

import bisect
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .stats import tally

log = logging.getLogger("wdsvlm.pack")

# The share of max_length a fill may give up to take the largest sample that fits beside the
# seed (0.2% and 1% did worse on bench_packing.py), and beside a seed that waited max_wait
# the share of that sample's tokens: such a seed is mid-sized, and its exact fill would take
# the small samples later rows' gaps need (bench_documents.py: see the design notes).
_PARTNER_SLACK, _FORCED_SHARE = 0.005, 0.1

# When the best token fill breaks the tile budget, the chosen sample with the most tiles per
# token is set aside (the fewest tokens for the scarce tiles: 0.1 pp less padding than the one
# with the most tiles on bench_packing.py --family qwen2_5_vl --vision-budget 16384) and the
# fill searched again, at most this many times before filling greedily.
_TILE_RETRIES = 8

# A pack under this share of max_length that the vision budget ended counts as bound by it;
# when more than BOUND_SHARE of an epoch's packs are, the budget is worth raising.
FULL, BOUND_SHARE = 0.9, 0.25


def budget_advice(
    packing: dict, max_length: int, max_units: int | None, unit: str, measured: tuple = ()
) -> str | None:
    """What to tell a user whose vision budget ends more than ``BOUND_SHARE`` of the packs
    while their tokens are under ``FULL`` of ``max_length`` (None otherwise): the share, the
    padding it costs, and a budget that would not bind: ``measured`` ``(budget, padding)``
    where it was packed with, else estimated from the packs' units per token (a quarter above
    their mean at a full row). ``packing``: ``PackStats.as_dict`` figures (summed over
    workers)."""
    packs, bound = packing["packs"], packing["vision_bound"]
    if max_units is None or not packs or bound <= BOUND_SHARE * packs:
        return None
    capacity = packs * max_length
    padding = 1 - packing["tokens"] / capacity
    if measured:
        better = f"max_tiles_per_pack={measured[0]} does not bind (padding {measured[1]:.1%})"
    else:
        suggested = suggest_budget(packing["tokens"], packing["tiles"], max_length, max_units)
        better = (
            f"about max_tiles_per_pack={suggested} would not bind (`wdsvlm stats` with "
            "--max-tiles-per-pack measures it before training)"
        )
    return (
        f"the vision budget binds: {bound} of {packs} packs ({bound / packs:.0%}) ended at "
        f"max_tiles_per_pack={max_units} {unit} with under {FULL:.0%} of max_length="
        f"{max_length} tokens, leaving {packing['vision_bound_room'] / capacity:.1%} of the "
        f"rows' tokens empty (padding {padding:.1%} in all); {better}"
    )


def suggest_budget(tokens: int, units: int, max_length: int, max_units: int) -> int:
    """A vision budget a quarter above the units of a full row at the packs' mean units per
    token, in steps of 1024 (of 8 below 1024), and above ``max_units``."""
    wanted = 1.25 * max_length * units / max(1, tokens)
    step = 1024 if wanted >= 1024 else 8
    return max(int(-(-wanted // step) * step), max_units + step)


def best_fill(
    tokens: Sequence[int], tiles: Sequence[int], token_room: int, tile_room: int
) -> list[int]:
    """Indices of a subset with the largest token sum <= ``token_room`` and tile sum <=
    ``tile_room``; among equal sums, earlier indices are preferred.

    Exact for the token budget (a bitset subset-sum); the tile budget is met by setting aside
    the samples with the most tiles per token and searching again, then greedily if that does
    not settle it.
    """
    allowed = [i for i in range(len(tokens)) if tokens[i] <= token_room and tiles[i] <= tile_room]
    for _ in range(_TILE_RETRIES):
        chosen = _subset_sum(allowed, tokens, token_room)
        used_tiles = sum(tiles[i] for i in chosen)
        if used_tiles <= tile_room:
            return chosen
        allowed.remove(max(chosen, key=lambda i: (tiles[i] / max(tokens[i], 1), i)))
    return _greedy(allowed, tokens, tiles, token_room, tile_room)


def with_partner(
    tokens: Sequence[int],
    tiles: Sequence[int],
    token_room: int,
    tile_room: int,
    best: list[int],
    slack: int,
    share: float = 0.0,
) -> list[int]:
    """``best`` (a fill of the room), or the best fill that holds the largest sample that
    fits, if that one comes within ``slack`` tokens of it (or ``share`` of that sample's)."""
    fits = [j for j in range(len(tokens)) if tokens[j] <= token_room and tiles[j] <= tile_room]
    if not fits:
        return best
    partner = max(fits, key=lambda j: (tokens[j], -j))
    if any(tokens[i] == tokens[partner] for i in best):  # it holds one that large already
        return best
    others = [k for k in range(len(tokens)) if k != partner]
    fill = best_fill(
        [tokens[k] for k in others],
        [tiles[k] for k in others],
        token_room - tokens[partner],
        tile_room - tiles[partner],
    )
    alternative = sorted([partner] + [others[k] for k in fill])
    slack = max(slack, int(share * tokens[partner]))
    if sum(tokens[i] for i in alternative) >= sum(tokens[i] for i in best) - slack:
        return alternative
    return best


def _subset_sum(items: list[int], tokens: Sequence[int], room: int) -> list[int]:
    mask = (1 << (room + 1)) - 1
    reach = [1]  # reach[k]: bitset of token sums reachable with items[:k]
    for i in items:
        reach.append((reach[-1] | (reach[-1] << tokens[i])) & mask)
    best = reach[-1].bit_length() - 1
    chosen = []
    for k in range(len(items), 0, -1):  # walk back, leaving out later items when possible
        if not (reach[k - 1] >> best) & 1:
            chosen.append(items[k - 1])
            best -= tokens[items[k - 1]]
    return sorted(chosen)


def _greedy(items, tokens, tiles, token_room, tile_room) -> list[int]:
    chosen = []
    for i in sorted(items, key=lambda i: (-tokens[i], i)):
        if tokens[i] <= token_room and tiles[i] <= tile_room:
            chosen.append(i)
            token_room -= tokens[i]
            tile_room -= tiles[i]
    return sorted(chosen)


class Packed(list):
    """One pack's items, with its ``tokens``, ``tiles`` and ``bound_room`` (the tokens left empty
    where the vision budget ended it, else None): figures that go with it to the batch."""

    tokens: int = 0
    tiles: int = 0
    bound_room: int | None = None


@dataclass
class PackStats:
    """What packing did: fill, samples and tiles per pack, drops by reason."""

    packs: int = 0
    samples: int = 0
    tokens: int = 0
    tiles: int = 0
    capacity: int = 0
    truncated: int = 0
    vision_bound: int = 0
    """Packs the vision budget ended: under ``FULL`` of ``max_length`` tokens, while a sample
    left waiting would have fitted their token room but not their vision room."""
    vision_bound_room: int = 0
    """The tokens those packs left empty."""
    dropped: Counter = field(default_factory=Counter)
    dropped_examples: dict = field(default_factory=dict)
    """The first ``keep_examples`` ``"SHARD/KEY"`` dropped per reason."""
    keep_examples: int = 1000

    def drop(self, reason: str, sample: dict, detail: str) -> None:
        """Count one sample that cannot be packed (too long, too many tiles): good data
        outside the budgets, so it is not a failure and never trips the bad-data cap."""
        tally(
            self.dropped,
            self.dropped_examples,
            self.keep_examples,
            reason,
            sample,
            detail,
            "dropping",
            log,
        )

    @property
    def fill(self) -> float:
        """Real tokens over the tokens the packs could hold."""
        return self.tokens / self.capacity if self.capacity else 0.0

    def count(self, pack: Packed, capacity: int) -> None:
        """Count one pack of ``capacity`` tokens."""
        self.packs += 1
        self.samples += len(pack)
        self.tokens += pack.tokens
        self.tiles += pack.tiles
        self.capacity += capacity
        if pack.bound_room is not None:
            self.vision_bound += 1
            self.vision_bound_room += pack.bound_room

    def reset(self) -> None:
        """Count afresh (a new epoch)."""
        self.packs = self.samples = self.tokens = self.tiles = self.capacity = 0
        self.truncated = self.vision_bound = self.vision_bound_room = 0
        self.dropped.clear()
        self.dropped_examples.clear()

    def as_dict(self, examples: int | None = None, packs: PackStats | None = None) -> dict:
        """The figures; ``examples``: at most that many dropped keys per reason; ``packs``:
        whose packs to count (these by default; a stream's, those its batches hold)."""
        packs = packs or self
        return {
            "packs": packs.packs,
            "samples": packs.samples,
            "fill": packs.fill,
            "samples_per_pack": packs.samples / packs.packs if packs.packs else 0.0,
            "tiles_per_pack": packs.tiles / packs.packs if packs.packs else 0.0,
            "truncated": self.truncated,
            "tokens": packs.tokens,
            "tiles": packs.tiles,
            "vision_bound": packs.vision_bound,
            "vision_bound_room": packs.vision_bound_room,
            "dropped": dict(self.dropped),
            "dropped_examples": {k: v[:examples] for k, v in self.dropped_examples.items()},
        }


class Packer:
    """Streaming packer on numbers: feed ``(item, tokens, tiles)``, take packs of items.

    ``push`` returns the packs that became ready (at most one: a window that is full emits
    one pack before it takes the next sample); ``drain`` empties the window at the end.
    Oversized items are refused by ``push`` with the reason, never packed.

    Each pack starts with the longest sample (the hardest to place later, as best-fit-decreasing
    does), or the oldest once it has waited ``max_wait`` packs (default: the window size), which
    bounds how long any sample stays; the best fill of the room left follows.
    """

    def __init__(
        self,
        max_length: int,
        max_tiles_per_pack: int | None = None,
        window: int = 500,
        max_wait: int | None = None,
    ):
        if max_length < 1 or window < 1:
            raise ValueError(f"max_length ({max_length}) and window ({window}) must be positive")
        self.max_length = max_length
        self.max_tiles = max_tiles_per_pack if max_tiles_per_pack is not None else 1 << 62
        self.window = window
        self.max_wait = max_wait if max_wait is not None else window
        self.waiting: list[tuple] = []  # (item, tokens, tiles, packs emitted when it came in)
        self.emitted = 0
        self.stats = PackStats()

    def oversized(self, tokens: int, tiles: int) -> str | None:
        """Why a sample can never be packed, or None."""
        if tokens > self.max_length:
            return "too_many_tokens"
        if tiles > self.max_tiles:
            return "too_many_vision_units"
        return None

    def push(self, item, tokens: int, tiles: int) -> list[list]:
        reason = self.oversized(tokens, tiles)
        if reason:
            self.stats.dropped[reason] += 1
            return []
        ready = [self._emit()] if len(self.waiting) >= self.window else []
        self.waiting.append((item, tokens, tiles, self.emitted))
        return ready

    def drain(self) -> Iterator[list]:
        """Empty the window at the end of the stream: pack by pack as in the stream, or by
        best-fit-decreasing over all it holds, whichever needs fewer packs (one pack at a
        time strands the long samples at the end without partners; BFD places them first)."""
        waiting = self.waiting
        if not waiting:
            return
        tokens = [w[1] for w in waiting]
        tiles = [w[2] for w in waiting]
        one_by_one = self._one_by_one(tokens, tiles, [w[3] for w in waiting])
        bfd = best_fit_decreasing(tokens, tiles, self.max_length, self.max_tiles)
        chosen = bfd if len(bfd) < len(one_by_one) else one_by_one
        self.waiting = []
        for pack in chosen:
            yield self._take(waiting, pack)

    def _one_by_one(self, tokens: list[int], tiles: list[int], came: list[int]) -> list[list[int]]:
        """The packs ``_emit`` would make of the window, as index lists, window untouched."""
        left = list(range(len(tokens)))
        emitted = self.emitted
        packs = []
        while left:
            packs.append(
                [
                    left[i]
                    for i in self._choose(
                        [tokens[j] for j in left],
                        [tiles[j] for j in left],
                        emitted - came[left[0]] >= self.max_wait,
                    )
                ]
            )
            taken = set(packs[-1])
            left = [j for j in left if j not in taken]
            emitted += 1
        return packs

    def _emit(self) -> list:
        waiting = self.waiting
        chosen = self._choose(
            [w[1] for w in waiting],
            [w[2] for w in waiting],
            self.emitted - waiting[0][3] >= self.max_wait,
        )
        taken = set(chosen)
        self.waiting = [w for i, w in enumerate(waiting) if i not in taken]
        return self._take(waiting, chosen)

    def _choose(self, tokens: list[int], tiles: list[int], oldest_first: bool) -> list[int]:
        """One pack of the window (indices, sorted): its seed (the longest, or the oldest
        when ``oldest_first``) and the best fill of the room left."""
        seed = 0 if oldest_first else max(range(len(tokens)), key=lambda i: (tokens[i], -i))
        others = [i for i in range(len(tokens)) if i != seed]
        rest_tokens = [tokens[i] for i in others]
        rest_tiles = [tiles[i] for i in others]
        token_room = self.max_length - tokens[seed]
        tile_room = self.max_tiles - tiles[seed]
        rest = with_partner(
            rest_tokens,
            rest_tiles,
            token_room,
            tile_room,
            best_fill(rest_tokens, rest_tiles, token_room, tile_room),
            int(_PARTNER_SLACK * self.max_length),
            _FORCED_SHARE if oldest_first else 0.0,
        )
        return sorted([seed] + [others[i] for i in rest])

    def _take(self, waiting: list[tuple], chosen: list[int]) -> Packed:
        """The items at ``chosen`` of ``waiting`` as one emitted pack, counted."""
        pack = Packed(waiting[i][0] for i in chosen)
        pack.tokens = sum(waiting[i][1] for i in chosen)
        pack.tiles = sum(waiting[i][2] for i in chosen)
        self.emitted += 1
        if pack.tokens < FULL * self.max_length:
            room, tile_room = self.max_length - pack.tokens, self.max_tiles - pack.tiles
            taken = set(chosen)
            if any(
                w[1] <= room and w[2] > tile_room for i, w in enumerate(waiting) if i not in taken
            ):
                pack.bound_room = room
        self.stats.count(pack, self.max_length)
        return pack


def best_fit_decreasing(
    tokens: Sequence[int], tiles: Sequence[int], max_length: int, max_tiles: int
) -> list[list[int]]:
    """Offline best-fit-decreasing under both budgets: each item, longest first, goes into
    the open pack it leaves least token room in (among those with tile room for it), else
    into a new one. Packs as sorted index lists, in the order they were opened."""
    rooms: list[tuple[int, int]] = []  # (token room, pack number), sorted
    tile_rooms: list[int] = []
    packs: list[list[int]] = []
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], -tiles[i], i)):
        at = bisect.bisect_left(rooms, (tokens[i], -1))
        while at < len(rooms) and tile_rooms[rooms[at][1]] < tiles[i]:
            at += 1
        if at == len(rooms):
            number, room = len(packs), max_length
            packs.append([])
            tile_rooms.append(max_tiles)
        else:
            room, number = rooms.pop(at)
        packs[number].append(i)
        tile_rooms[number] -= tiles[i]
        bisect.insort(rooms, (room - tokens[i], number))
    return [sorted(p) for p in packs]
