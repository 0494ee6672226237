"""What a Loader's reads ask of the stores, per source, in ``loader.stats()["requests"]``:
checked against the range server's own counts of what it was asked and what it sent."""

from __future__ import annotations

import os
import random
import shutil

import pytest
from PIL import Image

import wdsvlm
from wdsvlm import Source
from wdsvlm.loader.ray_workers import carried_over
from wdsvlm.storage.cache import ShardCache
from wdsvlm.storage.fs import RequestCounts
from wdsvlm.testing.stores import range_server

from .conftest import EXAMPLE, write_jsonl
from .test_ddp import SETTINGS as DDP_SETTINGS

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
# no read runs past the epoch's last batch: the figures are exact
SETTINGS = {**DDP_SETTINGS, "read_ahead": 0}


def write(folder: str, name: str, samples: int, per_shard: int) -> str:
    """A dataset of ``samples`` LLaVA samples, ``per_shard`` a shard, its shards named
    ``name-*.tar`` (with their sidecars, index version 2)."""
    rng = random.Random(name)
    images = os.path.join(folder, f"{name}-images")
    os.makedirs(images)
    records = []
    for n in range(samples):
        image = os.path.join(images, f"{n}.png")
        Image.effect_noise((rng.randint(8, 120), rng.randint(8, 120)), 60).convert("RGB").save(
            image
        )
        question = "<image>\n" + "Why? " * rng.randint(1, 10)
        answer = "Because. " * rng.randint(1, 12)
        records.append(
            {
                "id": f"{name}{n}",
                "image": image,
                "conversations": [
                    {"from": "human", "value": question},
                    {"from": "gpt", "value": answer},
                ],
            }
        )
    jsonl = write_jsonl(os.path.join(folder, f"{name}.jsonl"), records)
    out = os.path.join(folder, "store", name)
    wdsvlm.write_dataset(
        jsonl, out, prefix=name, samples_per_shard=per_shard, progress=False, index_version=2
    )
    return out


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The folder a range server serves: datasets ``coco`` (5 shards) and ``ocr`` (4)."""
    tmp = str(tmp_path_factory.mktemp("requests"))
    write(tmp, "coco", 40, 8)
    write(tmp, "ocr", 24, 6)
    return os.path.join(tmp, "store")


def served(server, since: dict, prefix: str) -> dict[str, int]:
    """What the server was asked for and sent of the files named ``prefix*`` (shards and
    sidecars) since ``since`` (an earlier ``snapshot``)."""
    now = snapshot(server)
    names = [n for n in now["asked"] if n.startswith(prefix)]
    return {
        "requests": sum(now["asked"][n] - since["asked"].get(n, 0) for n in names),
        "bytes": sum(now["served"].get(n, 0) - since["served"].get(n, 0) for n in names),
        "throttled": 0,
        "retries": 0,
    }


def snapshot(server) -> dict:
    return {"asked": dict(server.asked_by_name), "served": dict(server.served_by_name)}


def test_stats_give_the_requests_and_bytes_the_store_served_each_epoch(store):
    """One dataset, no workers: each epoch's figures are the server's own for the shards and
    sidecars, exactly, under the dataset's name."""
    with range_server(store) as server:
        loader = wdsvlm.Loader(f"{server.url}/coco", TOKENIZER, **SETTINGS)
        for epoch in range(2):
            loader.set_epoch(epoch)
            before = snapshot(server)
            batches = sum(1 for _ in loader)
            expected = served(server, before, "coco")
            assert batches and expected["requests"] > 0
            assert loader.stats()["requests"] == {"coco": expected}


def test_the_figures_at_each_batch_do_not_depend_on_how_far_the_reads_ran_ahead(store):
    """Reads ahead (four at once) count once their span is taken: after each batch the
    figures are the same on a store that answers at once and on one that answers late, and
    never more than the store served."""
    figures = {}
    for delay in (0.0, 0.02):
        with range_server(store, delay=delay) as server:
            settings = {**SETTINGS, "read_ahead": 4}
            loader = wdsvlm.Loader(f"{server.url}/coco", TOKENIZER, **settings)
            before = snapshot(server)
            figures[delay] = []
            for _ in loader:
                figures[delay].append(loader.stats()["requests"]["coco"])
                store_figures = served(server, before, "coco")
                assert figures[delay][-1]["bytes"] <= store_figures["bytes"]
    assert figures[0.0] == figures[0.02] and figures[0.0][-1]["requests"] > 0


@pytest.mark.processes
def test_stats_give_each_sources_requests_from_all_workers(store):
    """A mixture of two sources read by two DataLoader workers: per source, what both
    workers asked of the store and received, the server's own counts."""
    with range_server(store) as server:
        sources = [
            Source(f"{server.url}/coco", name="coco"),
            Source(f"{server.url}/ocr", name="ocr"),
        ]
        loader = wdsvlm.Loader(sources, TOKENIZER, num_workers=2, **SETTINGS)
        before = snapshot(server)
        batches = sum(1 for _ in loader)
        requests = loader.stats()["requests"]
        del loader
    expected = {name: served(server, before, name) for name in ("coco", "ocr")}
    assert batches and all(figures["requests"] for figures in expected.values())
    assert requests == expected


def test_cache_hits_are_no_requests(store, tmp_path):
    """Through the shard cache, a range's first read asks the store for the shard's size and
    its blocks; the same range read again asks nothing: it is counted as a cache hit."""
    index = wdsvlm.load_index(os.path.join(store, "coco"))
    shard = index["shards"][0]
    cache = ShardCache(str(tmp_path / "cache"))
    with range_server(store) as server:
        url = f"{server.url}/coco/{shard['name']}"
        first, again = RequestCounts(), RequestCounts()
        data = cache.read(url, shard["bytes"], 0, 2048, sha256=shard["sha256"], counts=first)
        assert (server.heads, server.gets, server.served) == (1, 1, 2048)
        assert cache.read(url, shard["bytes"], 0, 2048, sha256=shard["sha256"], counts=again) == (
            data
        )
        assert (server.heads, server.gets) == (1, 1)
    assert first.as_dict() == {"requests": 2, "bytes": 2048, "throttled": 0, "retries": 0}
    assert again.as_dict() == {"requests": 0, "bytes": 0, "throttled": 0, "retries": 0}
    # the telemetry's figures: the first read's requests took time, the second was a hit
    assert (first.cache_hits, again.cache_hits) == (0, 1) and first.seconds > 0
    assert again.figures() == {**again.as_dict(), "cache_hits": 1, "seconds": 0.0}


def test_a_restarted_ray_workers_requests_add_to_its_predecessors():
    before = {"slot": 1, "skips": {"requests": {"coco": {"requests": 3, "bytes": 10}}}}
    after = {"slot": 1, "skips": {"requests": {"coco": {"requests": 2, "bytes": 5}, "ocr": {}}}}
    added = carried_over(before, after)["skips"]["requests"]
    assert added == {"coco": {"requests": 5, "bytes": 15}, "ocr": {}}


def evaluation_batches(url: str, coalesce: bool, server) -> tuple[list, dict, dict]:
    """An evaluation loader's batches over ``url`` (chunks of 2 samples, 4 reads at once),
    reading with or without coalescing; what the server counted of the shards while it
    iterated, and the loader's ``stats()["requests"]``."""
    settings = {**SETTINGS, "read_ahead": 4, "span_samples": 2}
    loader = wdsvlm.Loader(url, TOKENIZER, evaluation=True, **settings)
    loader.stream.read.coalesce = coalesce
    len(loader)  # counted (by reading the pass) before the figures start
    before = snapshot(server)
    batches = list(loader)
    return batches, served(server, before, "coco"), loader.stats()["requests"]


def test_an_evaluation_pass_reads_neighbouring_chunks_with_one_request(store):
    """An evaluation loader reads each shard's chunks one after the other: four neighbouring
    chunks (the read-ahead window) are fetched with one request, 4x fewer, the same bytes
    served (at most 1.25x), and batches identical to reading each chunk alone."""
    with range_server(store) as server:
        url = f"{server.url}/coco"
        alone, read_alone, _ = evaluation_batches(url, False, server)
        joined, read_joined, stats = evaluation_batches(url, True, server)
    assert len(joined) == len(alone) > 0
    for a, b in zip(alone, joined, strict=True):
        assert a.keys() == b.keys()
        for key, value in a.items():
            same = value.equal(b[key]) if hasattr(value, "equal") else value == b[key]
            assert same, key
    # 5 shards of 8 samples: 20 chunks of 2, read 20 times alone, 5 times joined
    assert (read_alone["requests"], read_joined["requests"]) == (20, 5)
    assert read_joined["bytes"] <= 1.25 * read_alone["bytes"]
    assert stats == {"coco": read_joined}


def test_a_failed_joined_read_gives_each_span_what_its_own_read_would(store, tmp_path):
    """A shard cut short and a shard gone: read with and without coalescing, the same
    samples come out and the same ones are counted skipped, by reason."""
    from wdsvlm.pipeline.plan import Plan, WorkerConfig
    from wdsvlm.pipeline.read import ReadSamples
    from wdsvlm.pipeline.stats import SkipStats

    folder = tmp_path / "broken"
    shutil.copytree(os.path.join(store, "coco"), folder)
    shards = wdsvlm.load_index(str(folder))["shards"]
    with open(folder / shards[1]["name"], "r+b") as f:
        f.truncate(shards[1]["bytes"] // 2)
    os.remove(folder / shards[3]["name"])
    got = {}
    with range_server(str(folder)) as server:
        one = WorkerConfig(0, 1, 0)
        plan = Plan(server.url, worker_config=one, evaluation=True, span_samples=2)
        spans = list(plan.spans(0, 0))
        assert len(spans) == 20  # 5 shards of 8 samples, in chunks of 2
        for coalesce in (False, True):
            stats = SkipStats()
            reader = ReadSamples(
                stats=stats, read_ahead=4, on_shard_error="skip", coalesce=coalesce
            )
            samples = [(s["__key__"], s["json"]) for s in reader(iter(spans))]
            got[coalesce] = (samples, dict(stats.counts))
    assert got[True] == got[False]
    samples, skipped = got[True]
    assert set(skipped) == {"unreadable_shard", "truncated_tar"}
    assert skipped["unreadable_shard"] == 8 and len(samples) + sum(skipped.values()) == 40
