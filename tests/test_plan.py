"""Plan: every sample once across all global workers, order from (seed, epoch) only."""

from __future__ import annotations

import pytest

from wdsvlm.plan import Plan, WorkerConfig, epoch_order, worker_share, worker_spans

from .conftest import EXAMPLE

SHARD_SIZES = [3, 10, 1, 7, 5, 12, 2]  # 7 shards, uneven


def fake_index(sizes=SHARD_SIZES, sample_bytes=1000):
    shards = []
    for s, n in enumerate(sizes):
        entries = [
            {"key": f"{s}-{e}", "offset": e * sample_bytes, "size": sample_bytes} for e in range(n)
        ]
        shards.append({"name": f"d-{s:06d}.tar", "samples": n, "entries": entries})
    return {"shards": shards, "totals": {"samples": sum(sizes)}}


def keys_of(index, spans):
    return [
        index["shards"][sp["shard"]]["entries"][e]["key"] for sp in spans for e in sp["entries"]
    ]


def all_keys(index):
    return sorted(e["key"] for s in index["shards"] for e in s["entries"])


@pytest.mark.parametrize(
    "sizes, world, workers",
    [(SHARD_SIZES, 2, 3), (SHARD_SIZES, 2, 2), ([9], 1, 4), ([1, 1], 2, 3), (SHARD_SIZES, 1, 1)],
)
def test_global_workers_together_read_every_sample_once(sizes, world, workers):
    index = fake_index(sizes)
    seen = []
    counts = []
    for rank in range(world):
        config = WorkerConfig(rank, world, workers)
        for w in range(config.workers_per_rank):
            got = keys_of(
                index, worker_spans(index, 5, 0, config.global_worker(w), config.global_workers)
            )
            counts.append(len(got))
            seen += got
    assert sorted(seen) == all_keys(index)  # the union is the index, nobody twice
    assert max(counts) - min(counts) <= 1  # shares differ by at most one sample


def test_order_depends_on_seed_and_epoch_only():
    index = fake_index()
    assert epoch_order(index, 1, 0) == epoch_order(index, 1, 0)
    assert epoch_order(index, 1, 0) != epoch_order(index, 1, 1)
    assert epoch_order(index, 1, 0) != epoch_order(index, 2, 0)
    a = keys_of(index, worker_spans(index, 1, 3, 2, 6))
    assert a == keys_of(index, worker_spans(index, 1, 3, 2, 6))
    assert a != keys_of(index, worker_spans(index, 1, 4, 2, 6))
    # shuffled at shard and sample level: the first shard and the order inside it vary
    firsts = {epoch_order(index, 0, e)[0][0] for e in range(20)}
    assert len(firsts) > 2
    inside = {tuple(e for s, e in epoch_order(index, 0, ep) if s == 5) for ep in range(5)}
    assert len(inside) > 1


def test_worker_shares_are_contiguous_and_near_equal():
    assert [worker_share(10, w, 4) for w in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert [worker_share(2, w, 4) for w in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


def test_spans_are_single_ranged_reads_within_the_byte_bound():
    index = fake_index([40], sample_bytes=1000)
    spans = worker_spans(index, 0, 0, 0, 1, span_bytes=8000)
    assert len(spans) == 5  # 40 adjacent samples of 1000 bytes, 8 per span
    entries = index["shards"][0]["entries"]
    for span in spans:
        assert span["stop"] - span["start"] <= 8000
        for e in span["entries"]:
            assert span["start"] <= entries[e]["offset"]
            assert entries[e]["offset"] + entries[e]["size"] <= span["stop"]
    # a far-apart pair (another worker's samples between) is two reads, not one
    half = worker_spans(index, 0, 0, 0, 2, span_bytes=10**9)
    assert sum(len(s["entries"]) for s in half) == 20


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
    from wdsvlm.read import ReadSamples

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
