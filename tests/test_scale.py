"""What lets a billion samples load: the keyed order of plan version 3 (a worker plans its own
block alone, from closed forms) and index version 3 (the shards in a binary table, mapped)."""

from __future__ import annotations

import json
import os
import pickle
import re
from collections import Counter

import numpy as np
import pytest

import wdsvlm
from wdsvlm import write_dataset
from wdsvlm.errors import ShardFormatError
from wdsvlm.format.table import ShardTable
from wdsvlm.pipeline.keyed import Bijection, KeyedOrder
from wdsvlm.pipeline.order import PassOrder
from wdsvlm.pipeline.plan import Plan, WorkerConfig

from .conftest import EXAMPLE, run_cli, write_jsonl
from .test_ddp import digest
from .test_plan import fake_index, source

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"max_length": 512, "batch_size": 2, "tile_size": 64, "max_image_side": 128}


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64, 1000, 4097])
def test_a_keyed_bijection_is_a_permutation_and_its_inverse_undoes_it(n):
    b = Bijection(n, "test", n)
    y = b(np.arange(n))
    assert sorted(y.tolist()) == list(range(n))
    assert (b.inverse(y) == np.arange(n)).all()
    assert [b(int(x)) for x in range(n)] == y.tolist()
    if n >= 64:  # keyed: another key, another order
        assert (Bijection(n, "other", n)(np.arange(n)) != y).any()


def listing(order):
    """Every ``(source, shard, entry)`` of a pass, visit after visit, checked against
    ``entry_at`` and each visit's bounds."""
    out = []
    for x in range(order.visits):
        a, b = order.bounds(x)
        got = [(s, shard, int(e)) for s, shard, entries in order.pieces(x) for e in entries]
        assert len(got) == b - a
        out += got
    assert len(out) == order.size
    for place in range(0, order.size, 7):
        assert order.entry_at(place) == out[place]
    return out


def test_every_sample_comes_copies_times_a_pass_and_the_extras_rotate_through_the_source():
    a = source(fake_index([100, 37, 1000, 5], sample_bytes=60_000), "a")
    b = source(fake_index([50] * 9, sample_bytes=1_000), "b", copies=2, extra=30)
    extras = Counter()
    for pass_ in range(15):  # 15 x 30 = 450 = b's size: each of b's samples gets one extra
        counts = Counter(listing(KeyedOrder([a, b], 0, pass_, 2**20, 32)))
        assert {k: v for k, v in counts.items() if k[0] == 0} == dict.fromkeys(
            ((0, s, e) for s, n in enumerate([100, 37, 1000, 5]) for e in range(n)), 1
        )
        of_b = {k: v for k, v in counts.items() if k[0] == 1}
        assert len(of_b) == 450 and set(of_b.values()) <= {2, 3}
        extras.update(k for k, v in of_b.items() if v == 3)
        assert sum(of_b.values()) == 930
    assert len(extras) == 450 and set(extras.values()) == {1}


def test_the_evaluation_order_is_the_indexes_order_as_before():
    """Where both plans apply (an evaluation pass: every sample once, in the indexes' order),
    version 3 gives version 2's order."""
    sources = [source(fake_index([100, 37, 5], 60_000), "a"), source(fake_index([50] * 9), "b")]
    new = listing(KeyedOrder(sources, 0, 0, 2**20, 32, ordered=True))
    old = PassOrder(sources, 0, 0, 2**20, 32, ordered=True)
    assert new == [old.entry_at(p) for p in range(old.size)]


@pytest.mark.parametrize("world, workers", [(1, 1), (2, 3), (3, 2), (4, 8)])
def test_the_workers_blocks_together_are_exactly_the_pass_on_any_topology(world, workers):
    sources = [
        source(fake_index([100, 37, 1000, 5], 60_000), "a"),
        source(fake_index([50] * 9, 1_000), "b", copies=1, extra=200),
    ]
    whole = None
    for pass_ in range(2):
        places, keys = [], []
        for rank in range(world):
            plan = Plan(sources, worker_config=WorkerConfig(rank, world, workers))
            for slot in range(plan.worker_config.workers_per_rank):
                for span in plan.spans(pass_, plan.worker_config.global_worker(slot)):
                    places += span["positions"]
                    keys += [f"{span['shard']}/{e['key']}" for e in span["entries"]]
        assert places == list(range(plan.num_samples))  # in order, each once
        alone = Plan(sources, worker_config=WorkerConfig(0, 1, 0))
        assert keys == [
            f"{sp['shard']}/{e['key']}" for sp in alone.spans(pass_, 0) for e in sp["entries"]
        ]
        whole = whole or keys
    assert keys != whole  # another pass, another order


def test_a_worker_plans_its_block_without_the_pass():
    """A billion samples in a million shards: a worker's first spans come from its own block,
    in little time and memory (the pass itself would be 59 million chunk visits)."""
    shards = {"samples": 1000, "bytes": 60_000_000}
    index = {"shards": [{"name": f"d-{i:07d}.tar", **shards} for i in range(1_000_000)]}
    big = source(index, "big")
    big.__dict__["sample_ends"] = np.arange(0, 1_000_000_001, 1000, dtype=np.int64)
    big.__dict__["bytes"] = 60_000_000 * 1_000_000
    order = KeyedOrder([big], 0, 0, 2**20, 32)
    assert order.size == 10**9 and order.visits == -(-(10**9) // 17)  # chunks of 17
    start = 7 * 10**9 // 8192
    x = order.visit_at(start)
    a, b = order.bounds(x)
    assert a <= start < b and b - a <= 17
    assert order.entry_at(start)[1] < 1_000_000
    # and in a mixture with a small source read 2.5 times a pass
    small = source(fake_index([1000] * 1000, sample_bytes=1_000), "small", copies=2, extra=500_000)
    mixed = KeyedOrder([big, small], 0, 3, 2**20, 32)
    assert mixed.size == 10**9 + 2_500_000
    for first in (0, 123_456_789, mixed.size - 200_000):  # any 200,000 places hold its share
        x, shares = mixed.visit_at(first), Counter()
        while mixed.bounds(x)[0] < first + 200_000:
            a, b = mixed.bounds(x)
            shares[mixed.interleave.source_of(x)[0]] += b - a
            x += 1
        assert abs(shares[1] / sum(shares.values()) - 2_500_000 / mixed.size) < 0.0005


def test_a_state_saved_under_plan_version_2_is_refused_naming_it_and_resumes_with_it():
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, batches_per_epoch=6, plan_version=2, **SMALL)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    following = digest(next(batches))
    del state["config"]["plan_version"]  # as a wdsvlm before version 3 saved it
    new = wdsvlm.Loader(EXAMPLE, TOKENIZER, batches_per_epoch=6, **SMALL)
    with pytest.raises(ValueError, match=r"plan_version 2 -> 3.*plan_version=2"):
        new.load_state_dict(state)
    old = wdsvlm.Loader(EXAMPLE, TOKENIZER, batches_per_epoch=6, plan_version=2, **SMALL)
    old.load_state_dict(state)
    assert digest(next(iter(old))) == following


@pytest.fixture
def version_2(tmp_path, llava_input):
    path, root, _ = llava_input
    out = str(tmp_path / "ds")
    write_dataset(path, out, image_root=root, samples_per_shard=4, progress=False, index_version=2)
    assert wdsvlm.load_index(out)["version"] == 2
    return out


def test_a_version_2_dataset_upgrades_in_place_and_loads_alike(version_2, tmp_path):
    before = wdsvlm.load_index(version_2)
    settings = dict(batches_per_epoch=4, max_length=1024, batch_size=2, tile_size=64)
    expected = [digest(b) for b in wdsvlm.Loader(version_2, TOKENIZER, **settings)]
    loader = wdsvlm.Loader(version_2, TOKENIZER, **settings)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    run = run_cli("index", version_2, "--upgrade")
    assert run.returncode == 0 and "index version 2 -> 3" in run.stdout, run.stderr
    after = wdsvlm.load_index(version_2)
    assert isinstance(after["shards"], ShardTable) and len(after["shards"]) == 3
    for a, b in zip(before["shards"], after["shards"], strict=True):
        assert {k: v for k, v in a.items() if k != "entries"} == {
            k: v for k, v in b.items() if k != "entries"
        }
        assert list(a["entries"]) == list(b["entries"])
    assert wdsvlm.verify_dataset(version_2)["version"] == 3
    upgraded = wdsvlm.Loader(version_2, TOKENIZER, **settings)
    assert [digest(b) for b in upgraded] == expected
    resumed = wdsvlm.Loader(version_2, TOKENIZER, **settings)
    resumed.load_state_dict(state)  # a state saved on version 2 goes on on version 3
    assert [digest(b) for b in resumed] == expected[1:]
    table = pickle.loads(pickle.dumps(after["shards"]))  # the address, not the data
    assert len(pickle.dumps(after["shards"])) < 1000
    same = [{k: v for k, v in t[2].items() if k != "entries"} for t in (table, after["shards"])]
    assert same[0] == same[1] and list(table[2]["entries"]) == list(after["shards"][2]["entries"])


def test_a_damaged_shard_table_is_named(version_2):
    run_cli("index", version_2, "--upgrade")
    name = json.load(open(os.path.join(version_2, "index.json")))["table"]["name"]
    assert re.fullmatch(r"index-[0-9a-f]{16}\.shards", name)  # named by its digest
    path = os.path.join(version_2, name)
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ShardFormatError, match=rf"{name}: its column .* ends past the file"):
        wdsvlm.load_index(version_2)
    with open(path, "wb") as f:
        f.write(b"not a table at all")
    with pytest.raises(ShardFormatError, match=f"{name}: not a wdsvlm shard table"):
        wdsvlm.load_index(version_2)
    os.remove(path)
    with pytest.raises(ShardFormatError, match=f"{name}: the shard table is missing"):
        wdsvlm.load_index(version_2)


@pytest.fixture
def parts(tmp_path, llava_input):
    """Two datasets written apart (as two writers would) inside one folder."""
    path, root, records = llava_input
    out = tmp_path / "out"
    halves = [records[:6], records[6:]]
    for k, half in enumerate(halves):
        jsonl = write_jsonl(str(tmp_path / f"half{k}.jsonl"), half)
        write_dataset(
            jsonl, str(out / f"part-{k}"), image_root=root, samples_per_shard=4, progress=False
        )
    return str(out), records


def test_datasets_written_apart_merge_into_one_index_that_reads_every_sample_once(parts):
    out, records = parts
    run = run_cli("index", out, "--merge", "part-0", os.path.join(out, "part-1"))
    assert run.returncode == 0, run.stderr
    assert "2 datasets merged into one index (shards=4 samples=12" in run.stdout
    index = wdsvlm.load_index(out)
    names = [index["shards"].name(i) for i in range(len(index["shards"]))]
    assert names == [f"part-{k}/data-00000{s}.tar" for k in (0, 1) for s in (0, 1)]
    assert index["totals"]["samples"] == 12 and wdsvlm.verify_dataset(out)["checked"] == 4
    loader = wdsvlm.Loader(out, TOKENIZER, evaluation=True, max_length=4096, batch_size=2)
    keys = [k for batch in loader for row in batch["sample_keys"] for k in row]
    parts_keys = [
        f"part-{k}/{s['name']}/{e['key']}"
        for k in (0, 1)
        for s in wdsvlm.load_index(os.path.join(out, f"part-{k}"))["shards"]
        for e in s["entries"]
    ]
    assert sorted(keys) == sorted(parts_keys) and len(keys) == 12  # each once
    for part in ("part-0", "part-1"):  # each part still loads alone
        assert wdsvlm.load_index(os.path.join(out, part))["totals"]["samples"] == 6


def test_a_merge_that_fails_leaves_the_index_there_as_it_was(parts, tmp_path):
    out, _ = parts
    assert run_cli("index", out, "--merge", "part-0").returncode == 0
    before = open(os.path.join(out, "index.json"), "rb").read()
    os.remove(os.path.join(out, "part-1", "index.json"))
    run = run_cli("index", out, "--merge", "part-0", "part-1")
    assert run.returncode != 0 and "part-1/index.json not found" in run.stderr
    twice = run_cli("index", out, "--merge", "part-0", "part-0")
    assert twice.returncode != 0 and "named twice: ['part-0']" in twice.stderr
    outside = run_cli("index", out, "--merge", str(tmp_path))
    assert outside.returncode != 0 and "does not lie inside" in outside.stderr
    assert open(os.path.join(out, "index.json"), "rb").read() == before


def test_verify_can_check_shards_drawn_at_random(parts):
    out, _ = parts
    part = os.path.join(out, "part-0")
    run = run_cli("verify", part, "--sample", "1")
    assert run.returncode == 0 and "1 shards drawn at random match the index" in run.stdout
    shard = os.path.join(part, "data-000001.tar")
    data = bytearray(open(shard, "rb").read())
    data[700] ^= 1
    open(shard, "wb").write(bytes(data))
    drawn = run_cli("verify", part, "--sample", "2")  # both shards of the part
    assert drawn.returncode != 0 and "data-000001.tar" in drawn.stderr
    whole = run_cli("verify", part)
    assert whole.returncode != 0 and "data-000001.tar" in whole.stderr


def test_a_chunk_across_several_small_shards_is_read_one_shard_at_a_time():
    """Shards of very different sizes: a chunk of the mean shard's size runs across several
    small shards; its pieces are one per shard, and every sample comes once a pass."""
    index = fake_index([40, 1, 1, 1, 1, 40])  # mean shard: 14 samples
    order = KeyedOrder([source(index)], seed=3, pass_=0, span_bytes=10**9, span_samples=None)
    widest = max((order.pieces(x) for x in range(order.visits)), key=len)
    assert len(widest) >= 3  # one chunk, three shards or more
    shards = [shard for _, shard, _ in widest]
    assert shards == sorted(set(shards))  # one piece a shard, in shard order
    places = [order.entry_at(p) for p in range(order.size)]
    assert sorted(places) == sorted(
        {(0, s, e) for s, n in enumerate([40, 1, 1, 1, 1, 40]) for e in range(n)}
    )
