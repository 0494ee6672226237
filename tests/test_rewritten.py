"""A dataset rewritten in place with other content at the same shard names, sample counts and
sizes (tars are padded to 10 KiB records, so a small edit keeps the size): the shard cache
serves the new bytes, and a loader state of the old content is refused."""

from __future__ import annotations

import json
import logging
import os

import pytest
import webdataset as wds

import wdsvlm
from wdsvlm import load_index, write_dataset
from wdsvlm.errors import StorageError
from wdsvlm.format.builder import publish_root
from wdsvlm.pipeline.plan import Plan, WorkerConfig
from wdsvlm.pipeline.read import ReadSamples
from wdsvlm.storage.cache import ShardCache

from .conftest import EXAMPLE, write_jsonl

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
ONE = WorkerConfig(0, 1, 0)
SMALL = {"tile_size": 128, "max_image_side": 256, "tokens_per_tile": 16}


def shouted(records: list) -> list:
    """The same records with every answer in capitals: other bytes, the same lengths."""
    out = json.loads(json.dumps(records))
    for record in out:
        for turn in record["conversations"]:
            if turn["from"] == "gpt":
                turn["value"] = turn["value"].upper()
    return out


def write(records: list, image_root: str, output: str, **options) -> None:
    path = write_jsonl(os.path.join(os.path.dirname(output), "records.jsonl"), records)
    write_dataset(
        path, output, image_root=image_root, samples_per_shard=4, progress=False, **options
    )


@pytest.fixture
def rewritten(llava_input, tmp_path):
    """``(folder, rewrite)``: a dataset, and a function that rewrites it in place with its
    answers in capitals, the same shard names, counts and sizes, other sha256."""
    _, root, records = llava_input
    folder = str(tmp_path / "ds")
    write(records, root, folder)
    before = load_index(folder)["shards"]

    def rewrite() -> None:
        write(shouted(records), root, folder, overwrite=True)
        after = load_index(folder)["shards"]
        same = [(s["name"], s["samples"], s["bytes"]) for s in before]
        assert [(s["name"], s["samples"], s["bytes"]) for s in after] == same
        assert all(a["sha256"] != b["sha256"] for a, b in zip(after, before, strict=True))

    return folder, rewrite


def answers(folder: str, cache: ShardCache | None) -> dict[str, bytes]:
    """Each sample's JSON member, read through the cache."""
    read = ReadSamples(cache=cache, read_ahead=0)
    return {
        s["__key__"]: s["json"] for s in wds.DataPipeline(Plan(folder, worker_config=ONE), read)
    }


def test_a_shard_rewritten_at_the_same_size_is_read_anew_through_the_cache(rewritten, tmp_path):
    folder, rewrite = rewritten
    cache = ShardCache(str(tmp_path / "cache"))
    old = answers(folder, cache)
    assert cache.size() > 0, "the shards were cached"
    rewrite()
    new = answers(folder, cache)
    assert new == answers(folder, None)  # the bytes on disk now, not the cached ones
    assert new != old and b"A YELLOW DISC." in b"".join(new.values())
    # both versions are kept, each under the sha256 that names it
    both = {s["sha256"] for s in load_index(folder)["shards"]}
    assert {n.removesuffix(".tar") for n in os.listdir(tmp_path / "cache")} >= both


def test_a_shard_changed_under_a_readers_index_is_read_as_without_a_cache_and_refused_whole(
    rewritten, tmp_path
):
    """The cache keeps the ranges read as the store serves them (as a read without a cache
    gets them); once a shard is whole on disk it is checked against its index's sha256, and a
    shard changed under the index is refused there, named, and removed."""
    folder, rewrite = rewritten
    plan = Plan(folder, worker_config=ONE)
    list(wds.DataPipeline(plan, ReadSamples(read_ahead=0)))  # its index, entries and all
    old = load_index(folder)["shards"][0]
    rewrite()  # the shards change under the index the plan holds
    cache = ShardCache(str(tmp_path / "cache"))
    through = [s["json"] for s in wds.DataPipeline(plan, ReadSamples(cache=cache, read_ahead=0))]
    without = [s["json"] for s in wds.DataPipeline(plan, ReadSamples(read_ahead=0))]
    assert through == without and b"A YELLOW DISC." in b"".join(through)
    url, size = os.path.join(folder, old["name"]), old["bytes"]
    with pytest.raises(StorageError, match=r"the index says \d+ bytes, sha256 .*changed since"):
        cache.read(url, size, 0, size, None, None, sha256=old["sha256"])
    assert not os.path.exists(cache.path(old["sha256"])) and list(cache.bad) == [old["sha256"]]


def test_a_shard_whose_index_has_no_sha256_is_read_from_the_store_uncached(rewritten, tmp_path):
    folder, _ = rewritten
    index = load_index(folder)
    shards = [
        {**{k: v for k, v in s.items() if k != "entries"}, "sha256": None} for s in index["shards"]
    ]
    publish_root(folder, {**{k: v for k, v in index.items() if k != "table"}, "shards": shards})
    assert all(s["sha256"] is None for s in load_index(folder)["shards"])
    cache = ShardCache(str(tmp_path / "cache"))
    assert answers(folder, cache) == answers(folder, None)
    assert cache.size() == 0


def test_a_state_of_the_old_content_is_refused_after_a_same_size_rewrite(rewritten):
    folder, rewrite = rewritten
    base = {"max_length": 1024, "batch_size": 2, "batches_per_epoch": 2, **SMALL}
    loader = wdsvlm.Loader(folder, TOKENIZER, **base)
    next(iter(loader))
    state = loader.state_dict()
    wdsvlm.Loader(folder, TOKENIZER, **base).load_state_dict(state)  # unchanged: fine
    rewrite()
    with pytest.raises(ValueError, match=r"cannot resume: .*other settings: shards_sha256 "):
        wdsvlm.Loader(folder, TOKENIZER, **base).load_state_dict(state)


def test_a_state_saved_before_shards_sha256_were_recorded_still_resumes(rewritten, caplog):
    folder, _ = rewritten
    base = {"max_length": 1024, "batches_per_epoch": 3, **SMALL, "batch_size": 2}
    loader = wdsvlm.Loader(folder, TOKENIZER, **base)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    rest = [b["sample_keys"] for b in batches]
    del state["config"]["shards_sha256"]  # as an earlier wdsvlm saved it
    resumed = wdsvlm.Loader(folder, TOKENIZER, **base)
    with caplog.at_level(logging.WARNING, logger="wdsvlm"):
        resumed.load_state_dict(state)
    assert [b["sample_keys"] for b in resumed] == rest
    assert "does not record ['shards_sha256']" in caplog.text
