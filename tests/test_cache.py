"""The shard cache against a store that counts what it serves (a real HTTP server on
127.0.0.1, ``testing.stores.RangeServer``): what a pass fetches through the cache at a tenth, a
half and twice the dataset's size, against the same pass without it; a missing shard; a
shard that does not match its index."""

from __future__ import annotations

import json
import os
import time

import pytest

import wdsvlm
from wdsvlm import write_dataset
from wdsvlm.errors import ObjectNotFoundError, StorageError
from wdsvlm.pipeline.plan import Plan, WorkerConfig
from wdsvlm.pipeline.read import ReadSamples
from wdsvlm.storage.cache import ShardCache
from wdsvlm.storage.fs import ReadPolicy
from wdsvlm.testing.stores import range_server

from .test_storage import counting_store

ONE = WorkerConfig(0, 1, 1)
QUICK = ReadPolicy(block_bytes=64 * 1024, attempts=3, backoff=0.01, timeout=10)


@pytest.fixture(scope="module")
def twelve_shards(tmp_path_factory):
    """A dataset of 12 shards of 20 text samples (about 60 kB a shard)."""
    folder = tmp_path_factory.mktemp("twelve")
    records = [
        {
            "id": f"r{i}",
            "conversations": [
                {"from": "human", "value": f"question {i} " + "word " * (200 + 37 * (i % 11))},
                {"from": "gpt", "value": f"answer {i} " + "text " * 300},
            ],
        }
        for i in range(240)
    ]
    path = folder / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = str(folder / "ds")
    write_dataset(str(path), out, samples_per_shard=20, progress=False)
    return out


def tar_bytes(folder: str) -> int:
    return sum(s["bytes"] for s in wdsvlm.load_index(folder)["shards"])


def pass_traffic(server, pass_: int, cache: ShardCache | None) -> int:
    """Bytes of tars the store serves while one worker reads pass ``pass_`` whole (chunks of
    about 16 kB: five visits a shard, spread over the pass)."""
    plan = Plan(server.url, worker_config=ONE, span_bytes=16 * 1024, epoch=pass_)
    before = tars_served(server)
    read = ReadSamples(policy=QUICK, cache=cache)
    assert sum(1 for _ in read(plan.spans(pass_, 0))) == 240
    return tars_served(server) - before


def tars_served(server) -> int:
    return sum(n for name, n in server.served_by_name.items() if name.endswith(".tar"))


@pytest.mark.parametrize("share", [0.1, 0.5, 2.0])
def test_a_pass_through_the_cache_fetches_no_more_than_without_it(twelve_shards, tmp_path, share):
    size = tar_bytes(twelve_shards)
    with range_server(twelve_shards) as server:
        without = [pass_traffic(server, p, None) for p in (0, 1)]
        cache = ShardCache(str(tmp_path / "cache"), int(share * size))
        cached = [pass_traffic(server, p, cache) for p in (0, 1)]
    for p in (0, 1):
        ratio = cached[p] / without[p]
        assert ratio <= 1.1, f"pass {p}, cache {share:.0%} of the data: {ratio:.2f}x the traffic"
    assert cache.size() <= share * size
    if share >= 1:  # the dataset fits: a later pass fetches nothing
        assert cache.size() == size and cached[1] == 0


def test_a_missing_shard_is_one_request_and_evicts_nothing(tmp_path):
    with counting_store(str(tmp_path / "store"), [50_000, 50_000, 60_000], 0.0) as (server, blobs):
        cache = ShardCache(str(tmp_path / "cache"), 100_000)
        for url, _, size, sha256 in blobs[:2]:  # the cache full of good shards
            assert len(cache.read(url, size, 0, 100, None, QUICK, sha256=sha256)) == 100
        held = sorted(os.listdir(cache.folder))
        gone_url, gone_path, gone_size, gone_sha256 = blobs[2]
        os.remove(gone_path)
        for bound in (100_000, 10**9):  # full, and with room to spare
            cache.max_bytes = bound
            asked = server.gets + server.heads
            with pytest.raises(ObjectNotFoundError, match="blob-02.tar"):
                cache.read(gone_url, gone_size, 0, 100, None, QUICK, sha256=gone_sha256)
            assert server.gets + server.heads - asked == 1  # one request, no retry
            assert sorted(os.listdir(cache.folder)) == held  # nothing evicted, nothing left


def test_a_shard_that_does_not_match_its_sha256_is_fetched_once_and_named(tmp_path):
    with counting_store(str(tmp_path / "store"), [80_000], 0.0) as (server, blobs):
        url, _, size, _ = blobs[0]
        wrong = "ab" * 32
        cache = ShardCache(str(tmp_path / "cache"))
        for start in range(0, 50_000, 5_000):  # ten spans of it
            with pytest.raises(StorageError, match=r"blob-00.tar: .*the index says .*changed"):
                cache.read(url, size, start, start + 1000, None, QUICK, sha256=wrong)
        assert server.served == size  # downloaded once, not once a span
        assert list(cache.bad) == [wrong] and "blob-00.tar" in str(cache.bad[wrong])
        assert cache.size() == 0


def test_a_missing_shard_in_a_loader_pass_is_asked_for_once(twelve_shards, tmp_path):
    """A Loader with a cache and ``on_shard_error="skip"``: the missing shard's samples are
    counted as skipped, the store asked for it once a pass."""
    folder = str(tmp_path / "ds")
    os.makedirs(folder)
    for name in os.listdir(twelve_shards):
        if name != "data-000003.tar":
            os.link(os.path.join(twelve_shards, name), os.path.join(folder, name))
    with range_server(folder) as server:
        plan = Plan(server.url, worker_config=ONE, span_bytes=16 * 1024)
        read = ReadSamples(
            policy=QUICK, cache=ShardCache(str(tmp_path / "cache")), on_shard_error="skip"
        )
        assert sum(1 for _ in read(plan.spans(0, 0))) == 220
        assert read.stats.counts["unreadable_shard"] == 20
    # once a pass: its size asked for before any room is made (fsspec's HTTP filesystem asks
    # with a HEAD, then a GET; S3's with a HEAD), and no span of it asked for again
    assert server.asked_by_name["data-000003.tar"] <= 2


def test_only_a_shard_gone_unread_for_idle_seconds_makes_room(tmp_path):
    with counting_store(str(tmp_path / "store"), [50_000, 50_000, 50_000], 0.0) as (_, blobs):
        cache = ShardCache(str(tmp_path / "cache"), 100_000, idle_seconds=3600)
        for url, _, size, sha256 in blobs[:2]:
            cache.read(url, size, 0, 100, None, QUICK, sha256=sha256)
        first, second, third = (cache.path(b[3]) for b in blobs)
        url, path, size, sha256 = blobs[2]
        with open(path, "rb") as f:
            data = f.read()
        assert cache.read(url, size, 10, 20, None, QUICK, sha256=sha256) == data[10:20]
        assert not os.path.exists(third)  # read by ranges: both cached shards are in use
        day_ago = time.time() - 86400
        os.utime(first, (day_ago, day_ago))  # unread for a day
        other = ShardCache(cache.folder, 100_000, idle_seconds=3600)  # another reader
        assert other.read(url, size, 10, 20, None, QUICK, sha256=sha256) == data[10:20]
        assert not os.path.exists(first) and os.path.exists(second) and os.path.exists(third)
