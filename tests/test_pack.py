"""Packing: every sample in exactly one pack or the drop report, budgets never exceeded, a
pure function of input order and settings, and near-optimal fill."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from wdsvlm.pipeline.pack import Pack
from wdsvlm.pipeline.packer import Packer, best_fill, best_fit_decreasing

samples_strategy = st.lists(
    st.tuples(st.integers(1, 700), st.integers(0, 12)), min_size=0, max_size=150
)


def run(samples, max_length, max_tiles, window):
    packer = Packer(max_length, max_tiles, window)
    packs = []
    for i, (tokens, tiles) in enumerate(samples):
        packs += packer.push(i, tokens, tiles)
    packs += list(packer.drain())
    return packs, packer.stats


@settings(max_examples=200, deadline=None)
@given(samples_strategy, st.integers(64, 1024), st.integers(1, 20), st.integers(1, 40))
def test_every_sample_lands_in_one_pack_or_the_drop_report(samples, max_length, max_tiles, window):
    packs, stats = run(samples, max_length, max_tiles, window)
    packed = [i for pack in packs for i in pack]
    assert len(packed) == len(set(packed))  # nobody twice
    dropped = [i for i, (t, k) in enumerate(samples) if t > max_length or k > max_tiles]
    assert sorted(packed + dropped) == list(range(len(samples)))
    assert sum(stats.dropped.values()) == len(dropped)
    for pack in packs:
        assert pack, "no empty packs"
        assert sum(samples[i][0] for i in pack) <= max_length
        assert sum(samples[i][1] for i in pack) <= max_tiles


@settings(max_examples=50, deadline=None)
@given(samples_strategy, st.integers(64, 1024), st.integers(1, 20), st.integers(1, 40))
def test_packing_depends_only_on_input_order_and_settings(samples, max_length, max_tiles, window):
    assert (
        run(samples, max_length, max_tiles, window)[0]
        == run(list(samples), max_length, max_tiles, window)[0]
    )


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), max_size=12), st.integers(1, 900))
def test_best_fill_finds_the_optimal_token_sum(tokens, room):
    from itertools import combinations

    chosen = best_fill(tokens, [0] * len(tokens), room, 0)
    best = max(
        (sum(c) for r in range(len(tokens) + 1) for c in combinations(tokens, r) if sum(c) <= room),
        default=0,
    )
    assert sum(tokens[i] for i in chosen) == best


def test_tile_budget_is_kept_even_when_the_best_token_fill_breaks_it():
    tokens = [500, 500, 300, 200]
    tiles = [10, 10, 0, 0]
    chosen = best_fill(tokens, tiles, 1000, 12)
    assert sum(tiles[i] for i in chosen) <= 12
    assert sum(tokens[i] for i in chosen) == 1000  # 500 + 300 + 200


def test_a_sample_that_never_fits_best_is_still_packed_within_max_wait():
    # 30 never belongs to a best fill (50 + 50 fills the row), so only its age gets it out
    packer = Packer(100, None, window=4, max_wait=3)
    packs = []
    for i, tokens in enumerate([30] + [50] * 40):
        packs += packer.push(i, tokens, 0)
    first = next(n for n, pack in enumerate(packs) if 0 in pack)
    assert first <= 4
    assert all(sum(50 for i in p if i) + (30 if 0 in p else 0) == 100 for p in packs[:first])


def test_pack_stage_counts_oversized_samples_as_dropped_by_key():
    stage = Pack(100, max_tiles_per_pack=5, window=10)
    samples = [
        {"__key__": "ok", "__shard__": "s", "num_tokens": 50, "image_tiles": [2]},
        {"__key__": "long", "__shard__": "s", "num_tokens": 101, "image_tiles": []},
        {"__key__": "wide", "__shard__": "s", "num_tokens": 10, "image_tiles": [3, 3]},
        {"__key__": "ok2", "__shard__": "s", "num_tokens": 50, "image_tiles": [1]},
    ]
    run = stage(iter(samples))
    packs = list(run)
    assert [[s["__key__"] for s in p] for p in packs] == [["ok", "ok2"]]
    figures = run.stats.as_dict()
    assert run.stats.fill == 1.0
    assert figures["dropped"] == {"too_many_tokens": 1, "too_many_vision_units": 1}
    assert figures["dropped_examples"] == {
        "too_many_tokens": ["s/long"],
        "too_many_vision_units": ["s/wide"],
    }


def _tokenized(key, parts, image_token=9, per_tile=2):
    """A sample from ("q", n) text, ("a", n) answer (last token = end of turn), ("img", tiles)."""
    import numpy as np

    ids, labels, tiles = [], [], []
    for kind, n in parts:
        if kind == "img":
            ids += [image_token] * (n * per_tile)
            labels += [-100] * (n * per_tile)
            tiles.append(n)
        else:
            ids += [5] * n
            labels += [5 if kind == "a" else -100] * n
    images = {f"{i}.jpg": b"x" for i in range(len(tiles))}
    return {
        "__key__": key,
        "__shard__": "s",
        "image_at": [i for i, t in enumerate(ids) if t == 9 and (i == 0 or ids[i - 1] != 9)],
        "input_ids": np.array(ids),
        "num_tokens": len(ids),
        "labels": np.array(labels),
        "image_tiles": tiles,
        "__meta__": {"images": [[1, 1]] * len(tiles)},
        **images,
    }


def test_truncate_cuts_after_the_last_whole_answer_and_drops_later_images():
    from wdsvlm.pipeline.pack import truncate_at_answer

    sample = _tokenized("k", [("q", 3), ("img", 1), ("a", 4), ("q", 2), ("img", 2), ("a", 5)])
    cut = truncate_at_answer(sample, 14)
    assert cut["num_tokens"] == 9 and len(cut["input_ids"]) == len(cut["labels"]) == 9
    assert cut["image_tiles"] == [1] and cut["__meta__"]["images"] == [[1, 1]]
    assert "0.jpg" in cut and "1.jpg" not in cut
    assert truncate_at_answer(sample, 8) is None
    whole = truncate_at_answer(sample, 100)
    assert whole["num_tokens"] == sample["num_tokens"]


def test_pack_stage_truncates_instead_of_dropping_when_asked():
    stage = Pack(10, truncate=True)
    long = _tokenized("long", [("q", 2), ("a", 3), ("q", 4), ("a", 4)])  # 13 tokens
    hopeless = _tokenized("hopeless", [("q", 9), ("a", 3)])
    run = stage(iter([long, hopeless]))
    packs = list(run)
    assert [[s["__key__"] for s in p] for p in packs] == [["long"]]
    assert packs[0][0]["num_tokens"] == 5
    assert run.stats.truncated == 1
    assert run.stats.dropped == {"too_many_tokens": 1}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 30), max_size=120), st.integers(1, 8))
def test_balanced_batches_hold_every_pack_once(tiles, batch_size):
    from wdsvlm.pipeline.pack import BalanceBatches

    packs = [[{"id": i, "image_tiles": [t]}] for i, t in enumerate(tiles)]
    batches = list(BalanceBatches(batch_size)(iter(packs)))
    ids = [p[0]["id"] for b in batches for p in b]
    assert sorted(ids) == list(range(len(tiles)))
    assert all(len(b) == batch_size for b in batches[: len(tiles) // batch_size])
    assert all(1 <= len(b) <= batch_size for b in batches)


def test_balanced_batches_even_out_the_vision_load():
    import random

    from wdsvlm.pipeline.pack import BalanceBatches, tiles_cv

    rng = random.Random(0)
    tiles = [rng.choice([0, 0, 1, 3, 5, 10, 20]) for _ in range(800)]
    run = BalanceBatches(8)(iter([[{"image_tiles": [t]}] for t in tiles]))
    list(run)
    in_order = [sum(tiles[i : i + 8]) for i in range(0, 800, 8)]
    assert run.cv < 0.6 * tiles_cv(len(in_order), sum(in_order), sum(x * x for x in in_order))


def test_a_fill_holding_the_largest_sample_is_preferred_when_nearly_as_full():
    from wdsvlm.pipeline.packer import best_fill, with_partner

    tokens, tiles = [5, 5, 5, 5, 19], [0] * 5
    best = best_fill(tokens, tiles, 20, 10)
    assert best == [0, 1, 2, 3]  # exactly full, of small samples
    assert with_partner(tokens, tiles, 20, 10, best, slack=1) == [4]  # 19 of 20, the large one
    assert with_partner(tokens, tiles, 20, 10, best, slack=0) == best  # not within the slack
    # the partner must fit the tile budget too
    assert with_partner(tokens, [0, 0, 0, 0, 11], 20, 10, best, slack=1) == best
    # a fill that holds a sample as large already stays (no swap for nothing)
    assert with_partner([5, 5, 5], [1, 0, 0], 10, 1, [1, 2], slack=0) == [1, 2]


def _drained(samples, max_length, max_tiles):
    packer = Packer(max_length, max_tiles, window=len(samples) + 1)
    for i, (tokens, tiles) in enumerate(samples):
        assert packer.push(i, tokens, tiles) == []
    one_by_one = packer._one_by_one(
        [t for t, _ in samples], [k for _, k in samples], [0] * len(samples)
    )
    return list(packer.drain()), one_by_one


@settings(max_examples=200, deadline=None)
@given(samples_strategy, st.integers(700, 1024), st.integers(12, 40))
def test_the_end_of_a_pass_drains_in_no_more_packs_than_best_fit_or_pack_by_pack(
    samples, max_length, max_tiles
):
    packs, one_by_one = _drained(samples, max_length, max_tiles)
    bfd = best_fit_decreasing(
        [t for t, _ in samples], [k for _, k in samples], max_length, max_tiles
    )
    assert len(packs) == min(len(bfd), len(one_by_one))
    assert sorted(i for pack in packs for i in pack) == list(range(len(samples)))
    for pack in packs:
        assert sum(samples[i][0] for i in pack) <= max_length
        assert sum(samples[i][1] for i in pack) <= max_tiles


def test_a_drain_by_best_fit_leaves_no_long_sample_stranded():
    # one pack at a time takes the longest and the best fill of its room: 85 + 5 + ... leaves
    # the mid-sized samples without partners (6 rows); best-fit-decreasing needs 5
    samples = [(t, 0) for t in (85, 85, 50, 40, 40, 35, 35, 35, 25, 25, 5)]
    packs, one_by_one = _drained(samples, 100, 10)
    assert len(one_by_one) == 6
    assert len(packs) == 5
    assert sorted(i for pack in packs for i in pack) == list(range(len(samples)))


def test_packs_the_vision_budget_ends_are_counted_and_advised_on():
    """Samples of 100 tokens and 4 tiles under 1000 tokens and 8 tiles a row: two to a pack
    where ten would fit, so every pack is the vision budget's, and the advice says so with
    the padding and a budget that would let the tokens bind."""
    from wdsvlm.pipeline.packer import budget_advice

    packs, stats = run([(100, 4)] * 40, 1000, 8, 10)
    assert [len(p) for p in packs] == [2] * 20
    assert stats.vision_bound == 20 and stats.vision_bound_room == 20 * 800
    advice = budget_advice(stats.as_dict(), 1000, 8, "tiles")
    assert "20 of 20 packs (100%) ended at max_tiles_per_pack=8 tiles" in advice
    assert "leaving 80.0% of the rows' tokens empty (padding 80.0% in all)" in advice
    assert "about max_tiles_per_pack=56 would not bind" in advice  # 1.25 x 1000 x 4/100
    measured = budget_advice(stats.as_dict(), 1000, 8, "tiles", (48, 0.0))
    assert measured.endswith("max_tiles_per_pack=48 does not bind (padding 0.0%)")
    # the tokens bind: no advice
    packs, stats = run([(100, 0)] * 40, 1000, 8, 10)
    assert stats.vision_bound == 0 and budget_advice(stats.as_dict(), 1000, 8, "tiles") is None
    # packs that are full enough are not the budget's, however many tiles wait
    packs, stats = run([(450, 4)] * 40, 1000, 8, 10)
    assert stats.vision_bound == 0
    assert budget_advice(stats.as_dict(), 1000, None, "tiles") is None  # no budget at all


def test_the_vision_budget_advice_is_logged_every_epoch_for_the_packs_its_batches_hold(caplog):
    """Eight tiles a row of 2048 tokens, the default window (500 samples: the whole pass):
    the window drains at the end of the pass into far more packs than an epoch of 4 batches
    of 2 takes, and the batches of the epochs after it hold packs made then. Rank 0 logs the
    advice at the end of every epoch, counting the 8 packs that epoch's batches held (it
    used to count the packs made in the epoch: 187 in epoch 0, none after, so no advice)."""
    import logging
    import os
    import re

    import wdsvlm

    from .conftest import EXAMPLE

    options = {"max_length": 2048, "batch_size": 2, "batches_per_epoch": 4}
    small = {"tile_size": 128, "max_image_side": 256, "tokens_per_tile": 16}
    tokenizer = os.path.join(EXAMPLE, "tokenizer")
    loader = wdsvlm.Loader(EXAMPLE, tokenizer, max_tiles_per_pack=8, **options, **small)
    said, stats = [], []
    for epoch in range(3):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="wdsvlm.loader"):
            loader.set_epoch(epoch)
            list(loader)
        said += [r.getMessage() for r in caplog.records if "vision budget binds" in r.getMessage()]
        stats.append(loader.stats())
    assert [m.split(":")[0] for m in said] == ["epoch 0", "epoch 1", "epoch 2"]
    for message, figures in zip(said, stats, strict=True):
        bound, packs = map(int, re.search(r"binds: (\d+) of (\d+) packs", message).groups())
        assert packs == figures["packs"] == 8  # the packs the epoch's 4 batches of 2 held
        assert bound == figures["vision_bound"] > 8 / 4
