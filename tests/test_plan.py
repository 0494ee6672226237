"""Plan: one global order per pass from (sources, seed, pass) only, every planned sample once
across all global workers of any topology, exact mixture counts per pass."""

from __future__ import annotations

from collections import Counter

import pytest

from wdsvlm.pipeline.plan import Plan, WorkerConfig, worker_share
from wdsvlm.pipeline.sources import DataSource, Source, pass_counts

from .conftest import EXAMPLE

SHARD_SIZES = [3, 10, 1, 7, 5, 12, 2]  # 7 shards, uneven


def fake_index(sizes=SHARD_SIZES, sample_bytes=1000, prefix="d"):
    shards = []
    for s, n in enumerate(sizes):
        entries = [
            {"key": f"{prefix}{s}-{e}", "offset": e * sample_bytes, "size": sample_bytes}
            for e in range(n)
        ]
        shards.append(
            {"name": f"d-{s:06d}.tar", "samples": n, "bytes": n * sample_bytes, "entries": entries}
        )
    return {"shards": shards, "totals": {"samples": sum(sizes)}}


def source(index, name="d", copies=1, extra=0):
    urls = [f"memory://{name}/{s['name']}" for s in index["shards"]]
    return DataSource(name, index, urls, copies=copies, extra=extra)


def plan_of(
    sources, world=1, workers=0, rank=0, seed=5, span_bytes=4000, span_samples=32, version=3
):
    return Plan(
        sources,
        mixture=len(sources) > 1,
        seed=seed,
        worker_config=WorkerConfig(rank, world, workers),
        span_bytes=span_bytes,
        span_samples=span_samples,
        version=version,
    )


def keys_of(spans):
    return [f"{sp['shard']}/{e['key']}" for sp in spans for e in sp["entries"]]


def read_by_all(sources, world, workers, pass_=0, seed=5):
    """Keys each global worker reads in a pass, in global-worker order."""
    out = []
    for rank in range(world):
        plan = plan_of(sources, world, workers, rank, seed)
        for w in range(plan.worker_config.workers_per_rank):
            out.append(keys_of(plan.spans(pass_, plan.worker_config.global_worker(w))))
    return out


@pytest.mark.parametrize(
    "sizes, world, workers",
    [(SHARD_SIZES, 2, 3), (SHARD_SIZES, 2, 2), ([9], 1, 4), ([1, 1], 2, 3), (SHARD_SIZES, 1, 1)],
)
def test_global_workers_together_read_every_sample_once(sizes, world, workers):
    index = fake_index(sizes)
    shares = read_by_all([source(index)], world, workers)
    seen = [k for share in shares for k in share]
    every = sorted(f"{s['name']}/{e['key']}" for s in index["shards"] for e in s["entries"])
    assert sorted(seen) == every  # the union is the index, nobody twice
    assert max(map(len, shares)) - min(map(len, shares)) <= 1  # shares differ by at most one


def test_the_global_order_of_a_pass_is_the_same_on_every_topology():
    index = fake_index()
    orders = {
        (world, workers): [
            k for share in read_by_all([source(index)], world, workers, 3) for k in share
        ]
        for world, workers in [(1, 0), (1, 3), (2, 2), (3, 1), (5, 2)]
    }
    assert len({tuple(o) for o in orders.values()}) == 1


def test_order_depends_on_seed_and_pass_only():
    index = fake_index()

    def order(seed, pass_):
        return read_by_all([source(index)], 1, 0, pass_, seed)[0]

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1)
    assert order(1, 0) != order(2, 0)
    # chunks and samples inside them are shuffled: the first shard varies
    assert len({order(0, p)[0].split("/")[0] for p in range(20)}) > 2


def test_worker_shares_are_contiguous_and_near_equal():
    assert [worker_share(10, w, 4) for w in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [worker_share(2, w, 4) for w in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_spans_are_ranged_reads_of_one_chunk():
    index = fake_index([40], sample_bytes=1000)
    plan = plan_of([source(index)], span_bytes=8000)
    spans = list(plan.spans(0, 0))
    assert len(spans) == 5  # 40 adjacent samples of 1000 bytes, chunks of 8
    entries = index["shards"][0]["entries"]
    for span in spans:
        assert span["stop"] - span["start"] <= 8000
        for e in span["entries"]:
            assert span["start"] <= e["offset"] and e["offset"] + e["size"] <= span["stop"]
    assert sorted(e["key"] for sp in spans for e in sp["entries"]) == sorted(
        e["key"] for e in entries
    )
    # places are the pass's global order, consecutive in reading order
    assert [p for sp in spans for p in sp["positions"]] == list(range(40))


def test_a_visit_is_one_ranged_read_in_its_shuffled_order_and_a_sparse_part_is_cut():
    index = fake_index([80], sample_bytes=200_000)  # photos: chunks of 40, 8 MB
    plan = plan_of([source(index)], span_bytes=8_000_000, span_samples=None)
    spans = list(plan.spans(0, 0))
    assert [len(sp["entries"]) for sp in spans] == [40, 40]
    assert all(sp["stop"] - sp["start"] == 8_000_000 for sp in spans)
    assert [p for sp in spans for p in sp["positions"]] == list(range(80))  # reading order
    first = spans[0]["entries"]
    assert [e["offset"] for e in first] != sorted(e["offset"] for e in first)  # shuffled
    # the two samples at the ends of a chunk fill a twentieth of it: two reads
    by_offset = sorted(zip(first, spans[0]["positions"], strict=True), key=lambda f: f[0]["offset"])
    ends = sorted([by_offset[0][1], by_offset[-1][1]])
    parts = list(plan.read_spans(0, [[p, p + 1] for p in ends], 0))
    assert [len(sp["entries"]) for sp in parts] == [1, 1]


@pytest.mark.parametrize(
    "shards, per_shard, sample_bytes, workers, buffer",
    [
        (300, 400, 120_000, 2, 1000),  # photos (chunks of 8 MiB gave 3.5%)
        (1000, 100, 64_000, 8, 1000),  # small images
        (1000, 100, 1_000, 8, 8192),  # text only, 100 a shard (5.1% before chunks were capped)
        (1000, 100, 20_000, 8, 3000),  # text and images (2.7% before)
    ],
)
def test_after_the_default_shuffle_buffer_few_samples_of_a_batch_share_a_shard(
    shards, per_shard, sample_bytes, workers, buffer
):
    """A worker's samples leave the Loader's default shuffle buffer mixed: under 1% of
    neighbours, and of the pairs in a batch-sized window, from one shard, for photos, small
    images, text only and a mix. The buffer grows only for samples under 60 KB."""
    from wdsvlm.loader.build import shuffle_buffer
    from wdsvlm.loader.settings import LoaderSettings
    from wdsvlm.pipeline.shuffle import Shuffle

    defaults = LoaderSettings()
    index = fake_index([per_shard] * shards, sample_bytes=sample_bytes)
    plan = Plan(
        [source(index)],
        seed=defaults.seed,
        worker_config=WorkerConfig(0, 1, workers),
        span_bytes=defaults.span_bytes,
        span_samples=defaults.span_samples,
    )
    assert shuffle_buffer(plan, defaults) == buffer
    samples = (
        {"__shard__": sp["shard"], "__pass__": 0, "__pos__": p, "__worker__": 0}
        for sp in plan.spans(0, 0)
        for p in sp["positions"]
    )
    shuffle = Shuffle(buffer, defaults.shuffle_bytes, defaults.seed)
    order = [s["__shard__"] for s in shuffle(samples)]
    assert len(order) == shards * per_shard // workers
    neighbours = sum(a == b for a, b in zip(order, order[1:], strict=False)) / (len(order) - 1)
    windows = [Counter(order[i : i + 64]) for i in range(0, len(order) - 63, 64)]
    pairs = sum(n * (n - 1) for w in windows for n in w.values()) / (len(windows) * 64 * 63)
    assert neighbours < 0.01 and pairs < 0.01, (neighbours, pairs)


@pytest.mark.parametrize("version", [2, 3])
def test_chunks_hold_at_most_span_samples_and_image_sized_samples_keep_theirs(version):
    """Text-sized samples are cut into chunks of at most ``span_samples``; samples of 60 KB and
    more fill fewer than that into ``span_bytes``, so their reads are the same with the cap
    as without it. Under plan version 3 a chunk may end in the next shard: one read of each."""
    from wdsvlm.pipeline.order import caps_chunks

    text = [source(fake_index([100] * 20, sample_bytes=1_000))]
    spans = list(plan_of(text, span_bytes=2**20, version=version).spans(0, 0))
    assert max(len(sp["entries"]) for sp in spans) == 32
    if version == 2:
        assert len(spans) == 20 * 4  # 32 + 32 + 32 + 4 a shard
    else:  # 63 chunks of 32 of 2000 samples: 17 of them reach the next shard (800, 1600 do not)
        assert len(spans) == 63 + 17
        for sp in spans:  # a read of one shard
            assert {e["key"].split("-")[0] for e in sp["entries"]} == {f"d{int(sp['shard'][2:8])}"}
    assert caps_chunks(text, 2**20, 32) and not caps_chunks(text, 2**20, None)
    uncapped = Plan(
        text, seed=5, span_bytes=2**20, span_samples=None, version=version
    )  # at most a shard's samples (version 3: the mean shard's)
    assert [len(sp["entries"]) for sp in uncapped.spans(0, 0)] == [100] * 20
    images = [source(fake_index([500] * 4, sample_bytes=60_000))]
    assert not caps_chunks(images, 2**20, 32)
    capped = [
        sp["entries"] for sp in plan_of(images, span_bytes=2**20, version=version).spans(0, 0)
    ]
    as_before = Plan(images, seed=5, span_bytes=2**20, span_samples=None, version=version)
    assert capped == [sp["entries"] for sp in as_before.spans(0, 0)]


def test_repeat_and_choose_give_exact_counts_per_pass_and_rotate_the_extra_copies():
    sizes = [10, 7, 3]  # n = 20
    assert pass_counts([20], [Source("a", repeat=0.5)]) == [(0, 10)]
    assert pass_counts([20], [Source("a", repeat=2.25)]) == [(2, 5)]
    assert pass_counts([20], [Source("a", choose=30)]) == [(1, 10)]
    assert pass_counts([20], [Source("a", repeat=0.125)]) == [(0, 3)]  # 2.5 rounds up
    index = fake_index(sizes)
    for spec, copies, extra in [(Source("a", repeat=0.5), 0, 10), (Source("a", repeat=2.25), 2, 5)]:
        assert pass_counts([20], [spec]) == [(copies, extra)]
        plan = plan_of([source(index, copies=copies, extra=extra)])
        extras = Counter()
        for pass_ in range(4):
            counts = Counter(keys_of(plan.spans(pass_, 0)))
            assert sum(counts.values()) == copies * 20 + extra
            assert set(counts.values()) <= {copies, copies + 1}
            extras.update(k for k, c in counts.items() if c == copies + 1)
            if (pass_ + 1) * extra % 20 == 0:  # a whole rotation: every sample once more
                assert set(extras.values()) == {(pass_ + 1) * extra // 20}
                assert len(extras) == 20


def test_weights_split_samples_per_pass_and_mixing_forms_is_refused():
    sources = [Source("a", weight=3), Source("b", weight=1)]
    assert pass_counts([10, 30], sources) == [(3, 0), (0, 10)]
    assert pass_counts([10, 30], sources, samples_per_pass=100) == [(7, 5), (0, 25)]
    with pytest.raises(ValueError, match="weight= for every source or for none"):
        pass_counts([10, 30], [Source("a", weight=1), Source("b", repeat=2)])
    with pytest.raises(ValueError, match="one of repeat, choose and weight"):
        Source("a", repeat=1, choose=3)


def test_a_mixture_names_its_keys_and_the_same_dataset_twice_gets_two_orders():
    index = fake_index([6, 6])
    plan = plan_of([source(index, "vqa"), source(index, "vqa-2")])
    keys = keys_of(plan.spans(0, 0))
    assert len(keys) == len(set(keys)) == 24
    first = [k.split("/", 1)[1] for k in keys if k.startswith("vqa/")]
    second = [k.split("/", 1)[1] for k in keys if k.startswith("vqa-2/")]
    assert sorted(first) == sorted(second) and first != second


def test_worker_config_from_torchrun_environment(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = WorkerConfig.from_environment(num_workers=2)
    assert (config.rank, config.world_size, config.global_workers) == (3, 4, 8)
    assert config.global_worker(1) == 7
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert WorkerConfig.from_environment() == WorkerConfig(0, 1, 0)
    with pytest.raises(ValueError, match="rank 4 is not in"):
        WorkerConfig(4, 4)


@pytest.mark.processes
def test_plan_refuses_a_dataloader_with_other_worker_count():
    from torch.utils.data import DataLoader

    plan = Plan(EXAMPLE, worker_config=WorkerConfig(0, 1, 3))
    batches = iter(DataLoader(plan, batch_size=None, num_workers=2))
    with pytest.raises(ValueError, match="2 workers but the plan was made for 3"):
        next(batches)
    batches._shutdown_workers()  # now, not when the cycle collector frees it (10 s later)


@pytest.mark.processes
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_two_ranks_of_three_dataloader_workers_read_seven_shards_once(tmp_path):
    """Real worker processes: each rank's DataLoader with 3 workers, over 7 uneven shards."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    from wdsvlm import write_dataset
    from wdsvlm.pipeline.read import ReadSamples

    from .conftest import write_jsonl

    records = [
        {
            "id": f"t{i}",
            "conversations": [
                {"from": "human", "value": f"Q{i}" * (i + 1)},
                {"from": "gpt", "value": "A"},
            ],
        }
        for i in range(20)
    ]
    out = str(tmp_path / "ds")
    write_dataset(
        write_jsonl(str(tmp_path / "in.jsonl"), records), out, samples_per_shard=3, progress=False
    )
    plan_index = Plan(out, worker_config=ONE_RANK).index
    assert len(plan_index["shards"]) == 7
    seen, per_epoch = [], {}
    for epoch in (0, 1):
        keys = []
        for rank in range(2):
            pipe = wds.DataPipeline(
                Plan(out, epoch=epoch, seed=9, worker_config=WorkerConfig(rank, 2, 3)),
                ReadSamples(),
                wds.map(lambda s: s["__key__"]),
            )
            keys += list(DataLoader(pipe, batch_size=None, num_workers=3))
        per_epoch[epoch] = keys
        seen.append(sorted(keys))
    every = sorted(e["key"] for s in plan_index["shards"] for e in s["entries"])
    assert seen[0] == seen[1] == every  # every key once per epoch, across 2 x 3 workers
    assert per_epoch[0] != per_epoch[1]  # and a new order each epoch


ONE_RANK = WorkerConfig(0, 1, 0)
