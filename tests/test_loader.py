"""wdsvlm.Loader on shards_example: every sample once, fixed shapes, dense packs, epochs."""

from __future__ import annotations

import os

import pytest
import torch

import wdsvlm

from .conftest import EXAMPLE

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"tile_size": 128, "max_image_side": 256, "tokens_per_tile": 16}


def keys_of(batches):
    return [k for b in batches for row in b["sample_keys"] for k in row]


def test_defaults_just_work_and_yield_every_sample_once_in_dense_fixed_batches():
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, max_length=2048, batch_size=2)
    batches = list(loader)
    keys = keys_of(batches)
    assert len(keys) == len(set(keys)) == 320
    for b in batches:
        assert b["input_ids"].shape == b["labels"].shape == (2, 2048)
        assert b["pixel_values"].shape[1:] == (3, 512, 512)
        assert b["pixel_values"].shape[0] == int(b["image_tiles"].sum())
        image_tokens = int((b["input_ids"] == loader.tokenize.image_token_id).sum())
        assert image_tokens == 64 * b["pixel_values"].shape[0]
    stats = loader.stats()
    assert stats["samples"] == 320 and stats["fill"] > 0.95
    assert stats["skipped"] == {} and stats["dropped"] == {}
    assert abs(len(loader) - len(batches)) <= 0.25 * len(batches)  # an estimate, for now


def test_same_epoch_same_batches_other_epoch_other_order():
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, max_length=1024, batch_size=4, seed=5, **SMALL)
    first = keys_of(loader)
    again = keys_of(loader)
    loader.set_epoch(1)
    other = keys_of(loader)
    assert first == again
    assert first != other and sorted(first) == sorted(other)


@pytest.mark.parametrize("persistent", [False, True])
def test_workers_split_the_data_and_follow_set_epoch(persistent):
    loader = wdsvlm.Loader(
        EXAMPLE,
        TOKENIZER,
        max_length=1024,
        batch_size=4,
        num_workers=2,
        persistent_workers=persistent,
        **SMALL,
    )
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        keys = keys_of(loader)
        assert len(keys) == len(set(keys)) == 320
        epochs.append(keys)
    assert epochs[0] != epochs[1]
    assert loader.stats()["samples"] == 320  # both workers' reports merged


def test_oversized_samples_are_dropped_and_reported():
    loader = wdsvlm.Loader(
        EXAMPLE, TOKENIZER, max_length=256, batch_size=4, max_tiles_per_pack=4, **SMALL
    )
    keys = keys_of(loader)
    stats = loader.stats()
    assert len(keys) + sum(stats["dropped"].values()) == 320
    assert stats["dropped"].get("too_many_tokens", 0) > 0
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (4, 256)
    assert torch.all(batch["attention_mask"].sum(dim=1) <= 256)


def test_truncate_keeps_long_samples_whose_first_answer_fits():
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, max_length=160, batch_size=4, truncate=True, **SMALL)
    keys = keys_of(loader)
    stats = loader.stats()
    assert stats["truncated"] > 0
    assert (
        len(keys) + sum(stats["dropped"].values())
        == 320
        == len(set(keys)) + sum(stats["dropped"].values())
    )


def test_max_tiles_per_batch_bounds_every_batch_and_the_load_is_reported():
    loader = wdsvlm.Loader(
        EXAMPLE, TOKENIZER, max_length=1024, batch_size=4, max_tiles_per_batch=24, **SMALL
    )
    batches = list(loader)
    assert all(int(b["image_tiles"].sum()) <= 24 for b in batches)
    stats = loader.stats()
    assert len(keys_of(batches)) + sum(stats["dropped"].values()) == 320
    assert 0 < stats["tiles_per_batch_cv"] < 1
    with pytest.raises(ValueError, match="max_tiles_per_batch"):
        wdsvlm.Loader(EXAMPLE, TOKENIZER, batch_size=4, max_tiles_per_batch=3)
