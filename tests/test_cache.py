"""The shard cache against a store that counts what it serves (a real HTTP server on
127.0.0.1, ``testing.stores.RangeServer``): what a pass fetches through the cache at a tenth, a
half and twice the dataset's size, against the same pass without it; what each of two nodes
fetches, each reading half of every shard; two processes reading one shard at once; a missing
shard; a shard that does not match its index."""

from __future__ import annotations

import faulthandler
import json
import multiprocessing
import os
import signal
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

from .conftest import EXAMPLE
from .test_storage import counting_store

ONE = WorkerConfig(0, 1, 1)
QUICK = ReadPolicy(block_bytes=64 * 1024, attempts=3, backoff=0.01, timeout=10)
TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
LOADER = {
    "max_length": 2048,
    "batch_size": 2,
    "shuffle_buffer": 20,
    "pack_window": 20,
    "span_bytes": 16 * 1024,
    "read_ahead": 0,  # reads only what the epoch takes: the same bytes with a cache and without
    "read_policy": QUICK,
}


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
        cache = ShardCache(str(tmp_path / "cache"), 101_000)  # two shards and their block maps
        for url, _, size, sha256 in blobs[:2]:  # the cache full of good shards
            assert len(cache.read(url, size, 0, 100, None, QUICK, sha256=sha256)) == 100
        held = sorted(os.listdir(cache.folder))
        gone_url, gone_path, gone_size, gone_sha256 = blobs[2]
        os.remove(gone_path)
        assert len(held) == 3  # the two shards and the folder's lock
        for bound in (101_000, 10**9):  # full, and with room to spare
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
        for start in range(0, 75_000, 5_120):  # spans of it, all but its last block
            assert len(cache.read(url, size, start, start + 5_120, None, QUICK, sha256=wrong))
        # the span that brings its last block: the whole shard checked against its sha256
        with pytest.raises(StorageError, match=r"blob-00.tar: sha256 .*the index says .*changed"):
            cache.read(url, size, 75_000, size, None, QUICK, sha256=wrong)
        for start in range(0, 50_000, 5_000):  # and every later span of it, at once
            with pytest.raises(StorageError, match=r"blob-00.tar: .*the index says .*changed"):
                cache.read(url, size, start, start + 1000, None, QUICK, sha256=wrong)
        assert server.served == size  # downloaded once, not once a span
        assert list(cache.bad) == [wrong] and "blob-00.tar" in str(cache.bad[wrong])
        assert cache.size() == 0


def test_a_shard_of_another_size_than_its_index_says_is_asked_for_once(tmp_path):
    with counting_store(str(tmp_path / "store"), [80_000], 0.0) as (server, blobs):
        url, _, _, sha256 = blobs[0]
        cache = ShardCache(str(tmp_path / "cache"))
        for start in range(0, 50_000, 5_000):
            with pytest.raises(StorageError, match=r"blob-00.tar: 80000 bytes; the index says"):
                cache.read(url, 90_000, start, start + 1000, None, QUICK, sha256=sha256)
        assert server.heads == 1 and server.served == 0 and cache.size() == 0


def test_a_shard_whose_size_the_store_does_not_state_is_cached_all_the_same(tmp_path):
    """A HEAD without ``Content-Length`` (``object_size`` is None): the ranges are cached, the
    shard is checked against its sha256 once whole, and a second read fetches nothing."""
    with counting_store(str(tmp_path / "store"), [80_000], 0.0) as (server, blobs):
        url, path, size, sha256 = blobs[0]

        class Unsized(server.RequestHandlerClass):
            def do_HEAD(self):  # the headers of a file, without its length
                self.server.asked("HEAD", os.path.basename(self.path))
                self.send_response(200)
                self.end_headers()

            def do_GET(self):  # ranges as before; the whole file without its length
                if self.headers.get("Range"):
                    return super().do_GET()
                self.server.asked("GET", os.path.basename(self.path))
                self.send_response(200)
                self.end_headers()
                self.close_connection = True

        server.RequestHandlerClass = Unsized
        cache = ShardCache(str(tmp_path / "cache"))
        first = b"".join(
            cache.read(url, size, a, min(a + 5_120, size), None, QUICK, sha256=sha256)
            for a in range(0, size, 5_120)
        )
        served = server.served
        again = cache.read(url, size, 0, size, None, QUICK, sha256=sha256)
        with open(path, "rb") as f:
            assert first == again == f.read()
        assert server.served == served and not cache.bad  # the second read: from disk
        assert served == size  # each byte once, in the reads' ranges


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
        cache = ShardCache(str(tmp_path / "cache"), 101_000, idle_seconds=3600)
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
        other = ShardCache(cache.folder, 101_000, idle_seconds=3600)  # another reader
        assert other.read(url, size, 10, 20, None, QUICK, sha256=sha256) == data[10:20]
        assert not os.path.exists(first) and os.path.exists(second) and os.path.exists(third)


def node_pass(server, cache_dir, rank: int, epoch: int) -> tuple[int, set]:
    """``(bytes, blocks)`` of tars the store serves while rank ``rank`` of 2 (a node: the only
    rank of its machine) takes epoch ``epoch`` through a cache in ``cache_dir`` (None: without
    one): the bytes, and the 512-byte blocks as ``(shard name, block number)``."""
    loader = wdsvlm.Loader(
        server.url, TOKENIZER, rank=rank, world_size=2, cache_dir=cache_dir, **LOADER
    )
    loader.set_epoch(epoch)
    batches = len(loader)  # estimated from a few samples, read apart (not through the cache)
    before, first = tars_served(server), len(server.sent_ranges)
    assert sum(1 for _ in loader) == batches
    blocks = {
        (name, block)
        for name, start, stop in server.sent_ranges[first:]
        if name.endswith(".tar")
        for block in range(start // 512, -(-stop // 512))
    }
    return tars_served(server) - before, blocks


def test_each_node_fetches_through_its_cache_no_more_than_without_it(twelve_shards, tmp_path):
    """Two nodes (ranks 0 and 1 of 2, each with its own cache): a pass's chunks of every shard
    are shared out between them, so each reads part of every shard (a cache of whole shards
    fetched every shard whole on both: 1.4 to 1.7 times the bytes of reading without it)."""
    caches = [str(tmp_path / f"node-{rank}") for rank in (0, 1)]
    with range_server(twelve_shards) as server:
        without = [node_pass(server, None, rank, 0)[0] for rank in (0, 1)]
        second_without, second_reads = node_pass(server, None, 0, 1)
        first_pass = [node_pass(server, caches[rank], rank, 0) for rank in (0, 1)]
        ratios = [first_pass[rank][0] / without[rank] for rank in (0, 1)]
        assert max(ratios) <= 1.1, f"{ratios}: times the bytes of reading without a cache"
        # an epoch on a node reads part of every shard (a pass's chunks shared out by the
        # nodes, and a part of the next pass's, the packing's own lag)
        assert max(without) < 0.75 * tar_bytes(twelve_shards)
        # node 0's second pass fetches only the blocks it reads that its first did not bring
        cached, fetched = node_pass(server, caches[0], 0, 1)
        assert fetched == second_reads - first_pass[0][1]
        assert cached == 512 * len(fetched) < second_without
        assert node_pass(server, caches[0], 0, 1) == (0, set())  # a repeat of it: nothing


def read_blocks_of(folder: str, url: str, size: int, sha256: str, order: int, barrier) -> None:
    """A reader process: the shard in spans of 4 KiB (as a tar's spans: whole 512-byte
    records) through a cache in ``folder``, from its first span on or from its last back."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's time limit: stacks
    cache = ShardCache(folder)
    starts = list(range(0, size, 4096))
    barrier.wait(timeout=60)
    for start in starts if order == 0 else starts[::-1]:
        assert len(cache.read(url, size, start, start + 4096, None, QUICK, sha256=sha256))


@pytest.mark.processes
def test_two_processes_reading_one_shard_at_once_fetch_each_block_once(tmp_path):
    folder = str(tmp_path / "cache")
    with counting_store(str(tmp_path / "store"), [400 * 1024], delay=0.005) as (server, blobs):
        url, path, size, sha256 = blobs[0]
        context = multiprocessing.get_context("fork")
        barrier = context.Barrier(2)
        readers = [
            context.Process(target=read_blocks_of, args=(folder, url, size, sha256, i, barrier))
            for i in (0, 1)
        ]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + 120
        for reader in readers:
            reader.join(timeout=max(0.0, deadline - time.monotonic()))
        late = [r.pid for r in readers if r.is_alive()]
        for pid in late:  # each prints its threads' stacks
            os.kill(pid, signal.SIGUSR1)
        time.sleep(1 if late else 0)
        for reader in readers:
            reader.kill()
            reader.join(timeout=10)
        assert not late, f"readers {late} still running after 120 s (their stacks above)"
        assert [r.exitcode for r in readers] == [0, 0]
        ranges = sorted((a, b) for _, a, b in server.sent_ranges)
    assert server.served == size  # every block once
    overlaps = [(r, s) for r, s in zip(ranges, ranges[1:], strict=False) if s[0] < r[1]]
    assert not overlaps, f"blocks fetched twice: {overlaps}"
    with open(path, "rb") as f, open(ShardCache(folder).path(sha256), "rb") as cached:
        assert cached.read(size) == f.read()
