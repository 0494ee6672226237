"""The buffering stages' state as places: a run's ``state()`` restored into a fresh stage goes
on with exactly what the uninterrupted run yields; one stage instance serves several
iterators at once; the typed worker state reads and writes the saved form of before."""

from __future__ import annotations

import copy
import itertools
import os
import random

import pytest
import webdataset as wds

from wdsvlm.loader.state import LoaderState, ReadCursor, WorkerState
from wdsvlm.pipeline.pack import BalanceBatches, Pack
from wdsvlm.pipeline.plan import Plan, WorkerConfig
from wdsvlm.pipeline.read import ReadSamples
from wdsvlm.pipeline.shuffle import Shuffle
from wdsvlm.pipeline.tokenize import Tokenize

from .conftest import EXAMPLE

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")


def shuffle_inputs():
    """Two passes of 60 small samples."""
    return [
        {"__key__": f"{p}-{i}", "__pass__": p, "__pos__": i, "__worker__": 0, "x": b"ab" * i}
        for p in range(2)
        for i in range(60)
    ]


def sourced_inputs():
    """``shuffle_inputs`` of two sources: every tenth sample long (its index entry says 2000
    characters of answer), the others short."""
    out = shuffle_inputs()
    for s in out:
        long = s["__pos__"] % 10 == 0
        s["__source__"] = "long" if long else "short"
        s["__meta__"] = {"chars": [30, 2000 if long else 20]}
    return out


def pack_inputs():
    """Two passes of 80 tokenized samples (only the numbers packing needs)."""
    rng = random.Random(0)
    return [
        {
            "__key__": f"{p}-{i}",
            "__shard__": "s",
            "__pass__": p,
            "__pos__": i,
            "num_tokens": rng.randint(5, 120 if i % 17 else 130),  # a few too long: dropped
            "image_tiles": [rng.choice([0, 1, 2, 4])],
        }
        for p in range(2)
        for i in range(80)
    ]


def balance_inputs():
    """Packs of one or two samples over two passes, of uneven tiles."""
    rng = random.Random(1)
    packs = []
    for p in range(2):
        positions = list(range(90))
        while positions:
            take, positions = positions[: rng.randint(1, 2)], positions[2:]
            packs.append(
                [
                    {"__key__": f"{p}-{i}", "__pass__": p, "__pos__": i, "image_tiles": [i % 7]}
                    for i in take
                ]
            )
    return packs


@pytest.fixture(scope="module")
def example_samples():
    """Samples of shards_example as read (``__pass__`` and ``__pos__`` from the plan), one
    of them with JSON that does not parse (skipped by Tokenize, never held)."""
    plan = Plan(EXAMPLE, worker_config=WorkerConfig(0, 1, 0))
    samples = list(itertools.islice(wds.DataPipeline(plan, ReadSamples()), 40))
    samples[9]["json"] = b"{not json"
    return samples


def identity(value):
    """What a stage yields, as comparable plain values."""
    if isinstance(value, list):
        return [identity(v) for v in value]
    if "input_ids" in value:
        return (value["__key__"], value["input_ids"].tolist(), value["labels"].tolist())
    return value["__key__"]


def samples_in(item):
    """The samples an input item (a sample, or a pack of them) holds."""
    return item if isinstance(item, list) else [item]


def stage_case(name, example_samples):
    """``(make the stage, the inputs)`` for the stage called ``name``."""
    if name == "shuffle":
        return lambda: Shuffle(buffer_size=10, seed=5), shuffle_inputs()
    if name == "shuffle-by-tokens":
        return lambda: Shuffle(buffer_size=10, seed=5, by_tokens=True), sourced_inputs()
    if name == "tokenize":
        return lambda: Tokenize(TOKENIZER, tokens_per_tile=2, batch_size=4), example_samples
    if name == "pack":
        return lambda: Pack(128, max_tiles_per_pack=6, window=9), pack_inputs()
    return lambda: BalanceBatches(3, spread=2), balance_inputs()


STAGES = ["shuffle", "shuffle-by-tokens", "tokenize", "pack", "balance"]


def upstream_after(inputs, state, consumed):
    """Copies of the inputs a restored run reads: after the shuffle's last sample taken in
    (what the stream's read cursor follows), else those the interrupted run did not pull."""
    if not hasattr(state, "last"):
        return iter(copy.deepcopy(inputs[consumed:]))
    last = (-1, -1) if state.last is None else tuple(state.last)
    return iter([copy.deepcopy(s) for s in inputs if (s["__pass__"], s["__pos__"]) > last])


@pytest.mark.parametrize("name", STAGES)
def test_a_stage_restored_from_its_state_mid_stream_yields_what_the_run_would_have(
    name, example_samples
):
    make, inputs = stage_case(name, example_samples)
    whole = identity(list(make()(iter(copy.deepcopy(inputs)))))
    assert len(whole) > 10
    by_place = {(s["__pass__"], s["__pos__"]): s for item in inputs for s in samples_in(item)}

    def fetch(places):  # fresh copies, as the stream reads them again
        return [copy.deepcopy(by_place.get(tuple(p))) for p in places]

    held_any = False
    for k in sorted({0, 1, 3, 7, len(whole) // 2, len(whole) - 2, len(whole) - 1}):
        pulled = []
        upstream = iter(copy.deepcopy(inputs))
        run = make()(pulled.append(x) or x for x in upstream)
        first = identity(list(itertools.islice(run, k)))
        state = type(run.state()).from_saved(run.state().saved())  # as a checkpoint holds it
        held = state.held_places()
        held_any = held_any or bool(held)
        assert all(isinstance(p, list) and len(p) == 2 for p in held)
        restored = make().restore(state, upstream_after(inputs, state, len(pulled)), fetch)
        assert first + identity(list(restored)) == whole, f"interrupted after {k}"
    assert held_any  # the states held samples: the restore was not trivial


@pytest.mark.parametrize("name", STAGES)
def test_one_stage_serves_two_iterators_at_once_as_two_stages_would(name, example_samples):
    make, inputs = stage_case(name, example_samples)
    half = len(inputs) // 2
    parts = [inputs[:half], inputs[half:]]
    alone = [make()(iter(copy.deepcopy(part))) for part in parts]
    shared_stage = make()
    shared = [shared_stage(iter(copy.deepcopy(part))) for part in parts]
    outputs: list[list[list]] = [[[], []], [[], []]]
    for step in range(200):  # interleaved, unevenly
        for i in (0, 1) if step % 3 else (1, 0, 1):
            for runs, out in ((alone, outputs[0]), (shared, outputs[1])):
                item = next(runs[i], None)
                if item is not None:
                    out[i].append(identity(item))
            assert alone[i].state() == shared[i].state()
    assert outputs[0] == outputs[1]
    assert all(outputs[0]) and outputs[0][0] != outputs[0][1]


def test_a_worker_state_reads_and_writes_the_saved_form_of_before():
    saved = {  # as a state_dict() of the previous release holds it
        "read": {"segments": [[0, [[4, 9], [12, 15]]]], "next": 1},
        "shuffle": {"held": [[0, 3], [1, 2]], "draws": 17, "stream": "1/0", "last": [1, 2]},
        "tokenize": [[1, 0]],
        "window": {"places": [[0, 1], [0, 2]], "came": [3, 4], "emitted": 6, "ready": [[[0, 5]]]},
        "balance": [[[0, 6], [0, 7]], [[0, 8]]],
    }
    state = WorkerState.from_saved(saved)
    assert state.saved() == saved
    assert sorted(state.held_places()) == sorted(
        [[0, 3], [1, 2], [1, 0], [0, 1], [0, 2], [0, 5], [0, 6], [0, 7], [0, 8]]
    )
    assert state.saved()["shuffle"]["held"] is not saved["shuffle"]["held"]  # not shared
    assert WorkerState.fresh(3).saved() == {
        "read": {"segments": [], "next": 3},
        "shuffle": {"held": [], "draws": 0, "stream": None, "last": None},
        "tokenize": [],
        "window": {"places": [], "came": [], "emitted": 0, "ready": []},
        "balance": [],
    }
    broken = {k: v for k, v in saved.items() if k != "window"}
    with pytest.raises(ValueError, match="worker state .* malformed .*window"):
        WorkerState.from_saved(broken)
    with pytest.raises(ValueError, match="lacks \\['workers'\\]"):
        LoaderState.from_saved({"epoch": 0, "done": 0, "topology": {}, "config": {}})


def test_the_read_cursor_goes_on_after_the_last_sample_taken_in():
    own = ReadCursor([], 2)
    assert own.after([2, 4], (0, 10)) == ReadCursor([[2, [[5, 10]]]], 3)
    assert own.after([2, 9], (0, 10)) == ReadCursor([], 3)
    handed = ReadCursor([[0, [[3, 6], [8, 9]]], [1, [[0, 2]]]], 2)
    assert handed.after([0, 4], (0, 10)) == ReadCursor([[0, [[5, 6], [8, 9]]], [1, [[0, 2]]]], 2)
    assert handed.after(None, (0, 10)) == handed
