"""wdsvlm.Loader on shards_example: every sample once, fixed shapes, dense packs, epochs."""

from __future__ import annotations

import json
import os

import pytest
import torch

import wdsvlm

from .conftest import EXAMPLE

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"tile_size": 128, "max_image_side": 256, "tokens_per_tile": 16}


def keys_of(batches, of_pass=None):
    """The keys in batches, in order; only those of pass ``of_pass`` when it is given."""
    return [
        k
        for b in batches
        for keys, passes in zip(b["sample_keys"], b["sample_passes"], strict=True)
        for k, p in zip(keys, passes, strict=True)
        if of_pass is None or p == of_pass
    ]


def two_epochs(loader):
    out = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        out += list(loader)
    return out


def example_keys():
    index = json.load(open(os.path.join(EXAMPLE, "index.json")))
    return sorted(f"{s['name']}/{e['key']}" for s in index["shards"] for e in s["entries"])


def too_long(max_length, **image):
    """Keys whose tokens pass max_length, tokenized here apart from the Loader."""
    import webdataset as wds

    from wdsvlm import ImageConfig, Plan, ReadSamples, Tokenize, WorkerConfig

    config = ImageConfig(image["tile_size"], image["max_image_side"])
    pipe = wds.DataPipeline(
        Plan(EXAMPLE, worker_config=WorkerConfig()),
        ReadSamples(),
        Tokenize(TOKENIZER, tokens_per_tile=image["tokens_per_tile"], image_config=config),
    )
    return {f"{s['__shard__']}/{s['__key__']}" for s in pipe if s["num_tokens"] > max_length}


def test_defaults_just_work_and_yield_every_sample_once_in_dense_fixed_batches():
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, max_length=2048, batch_size=2)
    batches = list(loader)
    assert len(batches) == len(loader)
    keys = keys_of(batches)
    assert sorted(keys_of(batches, of_pass=0)) == example_keys()  # the first pass, whole
    later = keys_of(batches, of_pass=1)  # and the start of the next: the epoch's carry
    assert len(later) == len(set(later)) == len(keys) - 320
    for b in batches:
        assert b["input_ids"].shape == b["labels"].shape == (2, 2048)
        assert b["pixel_values"].shape[1:] == (3, 512, 512)
        assert b["pixel_values"].shape[0] == int(b["image_tiles"].sum())
        image_tokens = int((b["input_ids"] == loader.tokenize.image_token_id).sum())
        assert image_tokens == 64 * b["pixel_values"].shape[0]
    stats = loader.stats()
    assert stats["samples"] == len(keys) and stats["fill"] > 0.95
    assert stats["skipped"] == {} and stats["dropped"] == {}
    # the estimate of one pass is close: the epoch took little of the next one
    assert len(keys) - 320 < 0.1 * 320


def test_same_epoch_same_batches_other_epoch_other_order():
    def run(epoch):
        loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, max_length=1024, batch_size=4, seed=5, **SMALL)
        loader.set_epoch(epoch)
        return keys_of(loader, of_pass=epoch)

    first = run(0)
    assert first == run(0)
    other = run(1)  # set_epoch(1) on a new loader starts pass 1 afresh, in another order
    assert first[:100] != other[:100]
    assert len(set(first)) == len(first) > 300 and len(set(other)) == len(other) > 300


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_split_the_data_and_follow_set_epoch(persistent):
    def run(persistent, epochs=3):
        loader = wdsvlm.Loader(
            EXAMPLE,
            TOKENIZER,
            max_length=1024,
            batch_size=4,
            num_workers=2,
            persistent_workers=persistent,
            **SMALL,
        )
        out = []
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            batches = list(loader)
            assert len(batches) == len(loader)
            out.append(batches)
        return loader, out

    loader, epochs = run(persistent)
    every = [keys_of(b) for b in epochs]
    for p in (0, 1):  # each pass whole and once, carried over the epochs' edges
        assert sorted(keys_of([b for e in epochs for b in e], of_pass=p)) == example_keys()
    assert keys_of(epochs[0], of_pass=0) != keys_of(epochs[1], of_pass=1)  # new order
    assert loader.stats()["samples"] == len(every[-1])  # both workers' reports merged
    if persistent:  # workers that keep their streams give what new workers each epoch give
        _, fresh = run(False)
        assert every == [keys_of(b) for b in fresh]
        for a, b in zip(epochs[-1], fresh[-1], strict=True):
            assert torch.equal(a["pixel_values"], b["pixel_values"])


def test_oversized_samples_are_dropped_and_reported():
    loader = wdsvlm.Loader(
        EXAMPLE, TOKENIZER, max_length=256, batch_size=4, max_tiles_per_pack=4, **SMALL
    )
    batches = two_epochs(loader)
    index = json.load(open(os.path.join(EXAMPLE, "index.json")))
    config = wdsvlm.ImageConfig(SMALL["tile_size"], SMALL["max_image_side"])
    many_tiles = {
        f"{s['name']}/{e['key']}"
        for s in index["shards"]
        for e in s["entries"]
        if sum(wdsvlm.images.tile_count(w, h, config) for w, h in e["images"]) > 4
    }
    long = too_long(256, **SMALL)
    dropped = many_tiles | long
    assert many_tiles and long
    assert sorted(keys_of(batches, of_pass=0)) == sorted(set(example_keys()) - dropped)
    stats = loader.stats()
    assert stats["dropped"]["too_many_tokens"] > 0 and stats["dropped"]["too_many_tiles"] > 0
    assert batches[0]["input_ids"].shape == (4, 256)
    assert all(torch.all(b["attention_mask"].sum(dim=1) <= 256) for b in batches)


def test_truncate_keeps_long_samples_whose_first_answer_fits():
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, max_length=160, batch_size=4, truncate=True, **SMALL)
    batches = two_epochs(loader)
    stats = loader.stats()
    assert stats["truncated"] > 0
    kept = keys_of(batches, of_pass=0)
    assert len(kept) == len(set(kept))
    assert set(kept) & too_long(160, **SMALL)  # long samples come, cut
    missing = set(example_keys()) - set(kept)
    assert missing <= too_long(160, **SMALL)  # only long ones are missing: no answer fits


def test_max_tiles_per_batch_bounds_every_batch_and_the_load_is_reported():
    loader = wdsvlm.Loader(
        EXAMPLE, TOKENIZER, max_length=1024, batch_size=4, max_tiles_per_batch=24, **SMALL
    )
    batches = two_epochs(loader)
    assert all(int(b["image_tiles"].sum()) <= 24 for b in batches)
    stats = loader.stats()
    assert len(set(keys_of(batches, of_pass=0))) + stats["dropped"]["too_many_tiles"] >= 320
    assert 0 < stats["tiles_per_batch_cv"] < 1
    with pytest.raises(ValueError, match="max_tiles_per_batch"):
        wdsvlm.Loader(EXAMPLE, TOKENIZER, batch_size=4, max_tiles_per_batch=3)
