"""Mixture weights on a schedule: shares that follow the batch count within 2 points over any
window of 200 batches, passes that rotate through each source, exact and elastic resume, the
schedule part of the resume check, mixture files."""

from __future__ import annotations

import json
import os
import random
from collections import Counter

import pytest

import wdsvlm
from wdsvlm import Source
from wdsvlm.pipeline.plan import Plan, WorkerConfig
from wdsvlm.pipeline.schedule import Schedule, all_zero_at, weight_at
from wdsvlm.pipeline.shuffle import Shuffle

from .conftest import EXAMPLE
from .test_ddp import digest
from .test_plan import fake_index, source

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"tile_size": 128, "max_image_side": 256, "tokens_per_tile": 16}


def test_weights_between_the_points_are_linear_or_steps():
    points = ((0.0, 1.0), (100.0, 0.2), (200.0, 0.6))
    assert [weight_at(points, "linear", t) for t in (-5, 0, 50, 100, 150, 250)] == pytest.approx(
        [1.0, 1.0, 0.6, 0.2, 0.4, 0.6]
    )
    assert [weight_at(points, "step", t) for t in (0, 99, 100, 199, 200)] == [
        1.0, 1.0, 0.2, 0.2, 0.6,
    ]  # fmt: skip
    for weight, message in [
        ([(10, 1.0), (5, 0.5)], "rise from 0 or more"),
        ([(0, -1.0)], "finite numbers >= 0"),
        ([], "at least one"),
        ([(0, "x")], r"\[\(batch, weight\), ...\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            Source("d", weight=weight)
    with pytest.raises(ValueError, match="schedule must be one of"):
        Source("d", weight=[(0, 1.0)], schedule="cubic")
    with pytest.raises(ValueError, match="schedule= goes with weight="):
        Source("d", repeat=1.0, schedule="step")
    assert Source("d", weight=[[0, 1], [5, 2]]).schedule == "linear"


ALL_ZERO = [  # (source a's, source b's weights as (kind, points)), the first batch both are 0
    (("step", [(0, 1.0), (100, 0.0)]), ("step", [(0, 0.0), (150, 1.0)]), 100),
    # lines that reach 0 at the same batch only, from both sides
    (
        ("linear", [(0, 1.0), (100, 0.0), (200, 1.0)]),
        ("linear", [(50, 1.0), (100, 0.0), (300, 1.0)]),
        100,
    ),
    # a line that stays at 0 between two points, a step at 0 from a batch between them on
    (("linear", [(0, 1.0), (40, 0.0), (80, 0.0), (90, 2.0)]), ("step", [(0, 1.0), (60, 0.0)]), 60),
    # before the first point the first weight holds, after the last the last
    (("linear", [(10, 0.0), (20, 1.0)]), ("step", [(0, 0.0), (15, 1.0)]), 0),
    (("linear", [(0, 1.0), (30, 0.0)]), ("step", [(0, 1.0), (25.5, 0.0)]), 30),
    (("step", [(0, 1.0), (7, 0.0), (8, 1.0)]), ("linear", [(0, 1.0), (7, 0.0), (9, 0.0)]), 7),
]
NEVER_ZERO = [
    (("linear", [(0, 1.0), (100, 0.0)]), ("linear", [(0, 0.0), (100, 1.0)])),  # they cross
    (("step", [(0, 1.0), (100, 0.0)]), ("step", [(0, 0.0), (100, 1.0)])),  # b takes over
    (("linear", [(0, 1.0), (100, 0.0), (200, 1.0)]), ("step", [(0, 0.0), (99, 1.0), (101, 0.0)])),
    (("linear", [(0, 0.0), (1, 1.0)]), ("linear", [(0, 1.0), (1, 0.0)])),
]


@pytest.mark.parametrize("a, b, batch", ALL_ZERO)
def test_a_schedule_whose_weights_are_all_0_at_a_batch_is_refused_naming_it(a, b, batch):
    """Every weight 0 at some batch, at a point or between points, is found at the first such
    batch (checked against the weights on a fine grid), and a Loader with that schedule is
    refused when it is built, naming the batch (it used to fail in the workers once a pass
    got there)."""
    points = [tuple((float(t), float(w)) for t, w in p) for _, p in (a, b)]
    kinds = [a[0], b[0]]
    assert all_zero_at(points, kinds) == batch
    grid = [t / 4 for t in range(4 * 400)]
    zero = [
        t for t in grid if all(weight_at(p, k, t) == 0 for p, k in zip(points, kinds, strict=True))
    ]
    assert zero[0] == batch
    sources = [
        Source(EXAMPLE, name="a", weight=a[1], schedule=a[0]),
        Source(EXAMPLE, name="b", weight=b[1], schedule=b[0]),
    ]
    with pytest.raises(ValueError, match=rf"every source's weight is 0 at batch {batch}\b"):
        wdsvlm.Loader(sources, TOKENIZER, max_length=1024, batch_size=2, **SMALL)


@pytest.mark.parametrize("a, b", NEVER_ZERO)
def test_a_schedule_with_a_weight_above_0_at_every_batch_is_taken(a, b):
    points = [tuple((float(t), float(w)) for t, w in p) for _, p in (a, b)]
    assert all_zero_at(points, [a[0], b[0]]) is None
    for t in [x / 4 for x in range(4 * 400)]:
        assert sum(weight_at(p, k, t) for p, k in zip(points, [a[0], b[0]], strict=True)) > 0


def test_each_pass_holds_its_mean_shares_and_the_extras_rotate_through_each_source():
    schedule = Schedule([((0.0, 3.0), (10.0, 1.0)), ((0.0, 1.0),)], ["step", "step"], [7, 50], 20)
    schedule.set_clock(5)
    assert schedule.counts(0) == [15, 5] and schedule.counts(2) == [10, 10]
    assert all(sum(schedule.counts(p)) == 20 for p in range(6))
    # source 0 (7 samples): 15 a pass = twice each and one more, the one more rotating
    starts = [schedule.pass_counts(p)[0] for p in range(4)]
    assert starts[:2] == [(2, 1, 0), (2, 1, 1)]
    taken = [(start + i) % 7 for _, extra, start in starts for i in range(extra)]
    assert taken == [0, 1, 2, 3, 4, 5, 6, 0]  # every sample once more before any twice


def test_the_share_of_any_200_batches_is_within_2_points_of_the_schedule():
    """Two sources of 100,000 samples of 1 KB, one's weight from 1.0 to 0.2 over 1000 batches
    and the other's at 1.0, passes of 50 batches of 80 samples, through the Loader's plan and
    shuffle buffer: every window of 200 batches, sliding by 5, holds the first source's mean
    scheduled share over its batches within 2 points (worst: 1.3)."""
    a = source(fake_index([1000] * 100, sample_bytes=1000, prefix="a"), name="a")
    b = source(fake_index([1000] * 100, sample_bytes=1000, prefix="b"), name="b")
    per_batch, per_pass = 80, 4000
    schedule = Schedule(
        [((0.0, 1.0), (1000.0, 0.2)), ((0.0, 1.0),)], ["linear", "step"], [a.size, b.size], 0
    )
    plan = Plan([a, b], seed=0, worker_config=WorkerConfig(), span_bytes=2**20, schedule=schedule)
    plan.time_passes(per_pass, per_pass // per_batch)
    assert plan.num_samples == per_pass
    samples = (
        {"__shard__": span["source"], "__pass__": p, "__pos__": place, "__worker__": 0}
        for p in range(30)
        for span in plan.spans(p, 0)
        for place in span["positions"]
    )
    order = [s["__shard__"] for s in Shuffle(1000, 2**30, 0)(samples)]
    worst = 0.0
    for start in range(0, len(order) // per_batch - 200, 5):
        window = order[start * per_batch : (start + 200) * per_batch]
        want = sum(schedule.shares(t + 0.5)[0] for t in range(start, start + 200)) / 200
        worst = max(worst, abs(window.count("a") / len(window) - want))
    assert worst < 0.02, worst


WORDS = "the a cat dog sat on mat red blue green small large what where is are".split()


@pytest.fixture(scope="module")
def two_texts(tmp_path_factory):
    """Two text-only datasets of 3000 samples each, of similar size (8-12 words a turn)."""
    from wdsvlm.write.writer import write_dataset

    folder = tmp_path_factory.mktemp("texts")
    out = []
    for name in ("a", "b"):
        rng = random.Random(name)
        lines = [
            json.dumps(
                {
                    "id": f"{name}-{i}",
                    "conversations": [
                        {"from": who, "value": " ".join(rng.choices(WORDS, k=rng.randint(8, 12)))}
                        for who in ("human", "gpt")
                    ],
                }
            )
            for i in range(3000)
        ]
        (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        write_dataset(str(folder / f"{name}.jsonl"), str(folder / name), progress=False)
        out.append(str(folder / name))
    return out


def test_at_6_samples_a_batch_the_passes_keep_to_the_clock_and_any_200_batches_to_the_schedule(
    two_texts,
):
    """a's weight from 1.0 to 0.2 over 400 batches, b's at 1.0; rows of 240 tokens, one a
    batch: about 5.9 samples a batch, passes of about 290. The clock (a pass's batches of a
    rank, packed on the index's numbers) is within 2% of the batches the passes take, so
    they do not drift from the schedule, and every window of 200 batches (sliding by 10)
    holds a's mean scheduled share over it within 2 points. The clock used to be a bound
    of the epoch's length (52 batches for passes that took 49: by batch 800 the passes ran
    46 batches ahead of the schedule, and a window was 2.5 points off)."""
    sources = [
        Source(two_texts[0], name="a", weight=[(0, 1.0), (400, 0.2)]),
        Source(two_texts[1], name="b", weight=1.0),
    ]
    loader = wdsvlm.Loader(sources, TOKENIZER, max_length=240, batch_size=1)
    schedule, per_batch, passes = loader.plan.schedule, [], []
    for epoch in range(-(-800 // len(loader))):
        loader.set_epoch(epoch)
        for batch in loader:
            names = [s for row in batch["sample_sources"] for s in row]
            per_batch.append((names.count("a"), len(names)))
            passes.append(max(p for row in batch["sample_passes"] for p in row))
            if len(per_batch) == 800:
                break
    last = passes[-1]  # passes 0 .. last-1 took the batches before the first of pass `last`
    assert last >= 15 and passes.index(last) / last == pytest.approx(schedule.clock, rel=0.02)
    worst = 0.0
    for start in range(0, 800 - 200 + 1, 10):
        part = per_batch[start : start + 200]
        got = sum(a for a, _ in part) / sum(n for _, n in part)
        want = sum(schedule.shares(t + 0.5)[0] for t in range(start, start + 200)) / 200
        worst = max(worst, abs(got - want))
    assert worst < 0.02, worst


def scheduled(**extra):
    sources = [
        Source(EXAMPLE, name="a", weight=[(0, 1.0), (20, 0.1)]),
        Source(EXAMPLE, name="b", weight=1.0),
    ]
    options = {"max_length": 1024, "batch_size": 2, "samples_per_pass": 160, **SMALL, **extra}
    return wdsvlm.Loader(sources, TOKENIZER, **options)


def run(loader, epochs):
    digests, states, seen = [], [], []
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            digests.append(digest(batch))
            states.append(loader.state_dict())
            rows = zip(
                batch["sample_passes"], batch["sample_sources"], batch["sample_keys"], strict=True
            )
            seen += [s for row in rows for s in zip(*row, strict=True)]
    return digests, states, seen


def test_a_scheduled_mixture_resumes_exactly_and_its_passes_follow_the_schedule():
    loader = scheduled()
    clock = loader.plan.schedule.clock
    digests, states, seen = run(loader, 2)
    by_pass = Counter((p, s) for p, s, _ in seen)
    for p in range(2):  # the passes whole by now: each holds the counts of its shares
        assert [by_pass[(p, "a")], by_pass[(p, "b")]] == loader.plan.schedule.counts(p)
    assert by_pass[(0, "a")] > by_pass[(1, "a")]  # a's weight falls
    for k in (1, len(loader) // 2, len(loader) + 2):
        resumed = scheduled()
        resumed.load_state_dict(states[k - 1])
        assert resumed.plan.schedule.clock == clock
        assert run(resumed, 2)[0] == digests[k:], f"after step {k}"


def test_an_elastic_resume_keeps_the_passes_of_the_saved_run():
    """Two ranks' states after 3 batches, resumed on one rank: each pass's samples come once,
    whatever the new rank's estimate of a pass's batches would have been."""
    ranks = [scheduled(rank=r, world_size=2) for r in range(2)]
    taken, states = [], []
    for loader in ranks:
        got = []
        for batch in loader:
            rows = zip(
                batch["sample_passes"], batch["sample_sources"], batch["sample_keys"], strict=True
            )
            got += [[s for row in rows for s in zip(*row, strict=True)]]
            if len(got) == 3:
                break
        taken += [s for batch in got for s in batch]
        states.append(loader.state_dict())
    one = scheduled()
    one.load_state_dict(states)
    assert one.plan.schedule.clock == ranks[0].plan.schedule.clock
    after = run(one, 2)[2]
    pass_0 = Counter((s, k) for p, s, k in taken + after if p == 0)
    assert sorted(Counter(s for s, _ in pass_0.elements()).values()) == sorted(
        one.plan.schedule.counts(0)
    )
    assert max(pass_0.values()) <= -(-max(one.plan.schedule.counts(0)) // 320)


def test_a_changed_schedule_is_refused_on_resume_and_a_mixture_file_takes_one(tmp_path):
    loader = scheduled()
    next(iter(loader))
    state = loader.state_dict()
    changed = [
        Source(EXAMPLE, name="a", weight=[(0, 1.0), (30, 0.1)]),
        Source(EXAMPLE, name="b", weight=1.0),
    ]
    options = {"max_length": 1024, "batch_size": 2, "samples_per_pass": 160, **SMALL}
    other = wdsvlm.Loader(changed, TOKENIZER, **options)
    with pytest.raises(ValueError, match="other settings: schedule"):
        other.load_state_dict(state)
    spec = tmp_path / "mix.yaml"
    spec.write_text(
        f"samples_per_pass: 160\nsources:\n"
        f"  - {{path: {EXAMPLE}, name: a, weight: [[0, 1.0], [20, 0.1]], schedule: linear}}\n"
        f"  - {{path: {EXAMPLE}, name: b, weight: 1.0}}\n"
    )
    from_file = wdsvlm.Loader(str(spec), TOKENIZER, max_length=1024, batch_size=2, **SMALL)
    from_file.load_state_dict(state)  # the same mixture: accepted
    assert from_file.plan.schedule.counts(3) == loader.plan.schedule.counts(3)
