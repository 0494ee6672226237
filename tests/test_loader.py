"""wdsvlm.Loader on shards_example: every sample once, fixed shapes, dense packs, epochs."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

import wdsvlm
from wdsvlm.pipeline import ImageConfig

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

    from wdsvlm.pipeline import Plan, ReadSamples, Tokenize, WorkerConfig

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
@pytest.mark.processes
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
    config = ImageConfig(SMALL["tile_size"], SMALL["max_image_side"])
    many_tiles = {
        f"{s['name']}/{e['key']}"
        for s in index["shards"]
        for e in s["entries"]
        if sum(wdsvlm.families.tiling.tile_count(w, h, config) for w, h in e["images"]) > 4
    }
    long = too_long(256, **SMALL)
    dropped = many_tiles | long
    assert many_tiles and long
    assert sorted(keys_of(batches, of_pass=0)) == sorted(set(example_keys()) - dropped)
    stats = loader.stats()
    assert stats["dropped"]["too_many_tokens"] > 0 and stats["dropped"]["too_many_vision_units"] > 0
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
    assert len(set(keys_of(batches, of_pass=0))) + stats["dropped"]["too_many_vision_units"] >= 320
    assert 0 < stats["tiles_per_batch_cv"] < 1
    with pytest.raises(ValueError, match="max_tiles_per_batch"):
        wdsvlm.Loader(EXAMPLE, TOKENIZER, batch_size=4, max_tiles_per_batch=3)


def write_short_and_long(folder, tmp_path) -> list[str]:
    """30 text-only samples: 20 whose answer is far past 256 tokens, 9 short, and one whose
    JSON member is spoiled after writing; the keys of the long ones."""
    from .conftest import write_jsonl

    records = []
    for i in range(30):
        answer = "word " * (400 if i % 3 else 2) if i != 0 else "Fine."
        records.append(
            {
                "id": f"r{i}",
                "conversations": [
                    {"from": "human", "value": f"Question {i}?"},
                    {"from": "gpt", "value": answer},
                ],
            }
        )
    path = write_jsonl(str(tmp_path / "in.jsonl"), records)
    wdsvlm.write_dataset(path, folder, progress=False)
    shard = os.path.join(folder, "data-000000.tar")
    data = bytearray(open(shard, "rb").read())
    at = data.index(b'{"id":"r3"')  # a short one: its JSON no longer parses
    data[at : at + 10] = b"#" * 10
    open(shard, "wb").write(bytes(data))
    return [f"data-000000.tar/{i:09d}" for i in range(30) if i % 3]


def test_a_sample_is_skipped_or_dropped_never_both_and_drops_never_trip_the_cap(tmp_path):
    data = str(tmp_path / "ds")
    long = write_short_and_long(data, tmp_path)
    # 20 of 30 samples are too long: some come two in a row, which a cap of 2 failures in a
    # row would stop at if drops counted as failures
    loader = wdsvlm.Loader(
        data, TOKENIZER, max_length=256, batch_size=1, max_consecutive_failures=2, seed=1
    )
    keys = keys_of(list(loader), of_pass=0)
    stats = loader.stats()
    # an epoch reads a pass and some of the next: the same samples may come more than once
    assert set(stats["skipped"]) == {"invalid_json"}
    assert set(stats["skipped_examples"]["invalid_json"]) == {"data-000000.tar/000000003"}
    assert (
        set(stats["dropped"]) == {"too_many_tokens"} and stats["dropped"]["too_many_tokens"] >= 20
    )
    assert set(stats["dropped_examples"]["too_many_tokens"]) <= set(long)
    assert len(keys) == 9 and not set(keys) & set(long)


@pytest.mark.parametrize("mode", ["raise", "skip"])
@pytest.mark.parametrize("change", ["vanished", "rewritten"])
def test_a_resume_whose_held_samples_cannot_be_read_again_says_so(tmp_path, mode, change):
    import shutil

    data = str(tmp_path / "ds")
    shutil.copytree(EXAMPLE, data)
    options = {**SMALL, "on_shard_error": mode}
    loader = wdsvlm.Loader(data, TOKENIZER, **options)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    place = state["workers"][0]["window"]["places"][0]  # a sample the saved window holds
    span = wdsvlm.pipeline.plan.Plan(data).locate(place[0], [place[1]])[0]
    shard, key = span["shard"], span["entries"][0]["key"]
    path = os.path.join(data, shard)
    if change == "vanished":
        os.remove(path)
    else:  # the same name, other samples at the offsets
        other = next(n for n in sorted(os.listdir(data)) if n.endswith(".tar") and n != shard)
        shutil.copy(os.path.join(data, other), path)
    resumed = wdsvlm.Loader(data, TOKENIZER, **options)
    resumed.load_state_dict(state)
    if mode == "raise":
        expected = (
            rf"{shard}.*FileNotFoundError"
            if change == "vanished"
            else rf"cannot resume: \d+ samples .* could not be read again: {shard}/"
        )
        with pytest.raises(wdsvlm.StorageError, match=expected):
            next(iter(resumed))
        return
    keys = keys_of(list(resumed))
    assert keys and f"{shard}/{key}" not in keys
    skipped = resumed.stats()["skipped"]
    reasons = {"unreadable_shard"} if change == "vanished" else {"corrupt_tar", "truncated_tar"}
    assert set(skipped) <= reasons and sum(skipped.values()) > 0


# One other value for every setting that shapes the batches: the test below fails when a
# setting is added to LoaderSettings without a value here, so none escapes the resume check.
OTHER_VALUES = {
    "max_length": 512,
    "batch_size": 3,
    "seed": 1,
    "shuffle_buffer": 10,
    "shuffle_bytes": 2**20,
    "span_bytes": 100_000,
    "span_samples": 2,
    "plan_version": 2,
    "tile_size": 64,
    "max_image_side": 512,
    "upscale": True,
    "tokens_per_tile": 8,
    "max_tiles_per_pack": 8,
    "max_tiles_per_batch": 16,
    "pack_window": 50,
    "truncate": True,
    "image_token": "<img>",
    "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
}


def test_each_setting_that_shapes_batches_changed_alone_is_refused_on_resume_naming_it():
    from wdsvlm.loader.settings import LoaderSettings, shapes_batches

    shaping = {f for f in LoaderSettings.__dataclass_fields__ if shapes_batches(f)}
    assert shaping == set(OTHER_VALUES), "a batch-shaping setting without a test value"
    base = {"max_length": 1024, "batch_size": 2, "batches_per_epoch": 2, **SMALL}
    tokenizer = wdsvlm.Loader(EXAMPLE, TOKENIZER, **base).tokenizer
    loader = wdsvlm.Loader(EXAMPLE, tokenizer, **base)
    next(iter(loader))
    state = loader.state_dict()
    wdsvlm.Loader(EXAMPLE, tokenizer, **base).load_state_dict(state)  # the same: fine
    for name, value in OTHER_VALUES.items():
        other = wdsvlm.Loader(EXAMPLE, tokenizer, **{**base, name: value})
        with pytest.raises(ValueError, match=rf"cannot resume: .*other settings: (.*, )?{name} "):
            other.load_state_dict(state)


def test_a_tokenizer_or_its_template_changed_under_the_same_settings_is_refused(tmp_path):
    import shutil

    base = {"max_length": 1024, "batch_size": 2, "batches_per_epoch": 2, **SMALL}
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, **base)
    next(iter(loader))
    state = loader.state_dict()
    changed = str(tmp_path / "tokenizer")
    shutil.copytree(TOKENIZER, changed)
    with open(os.path.join(changed, "chat_template.jinja"), "w") as f:
        f.write(OTHER_VALUES["chat_template"])
    with pytest.raises(ValueError, match="other settings: chat_template"):
        wdsvlm.Loader(EXAMPLE, changed, **base).load_state_dict(state)


def test_a_state_of_an_older_release_is_refused_with_what_to_do():
    base = {"max_length": 1024, "batch_size": 2, **SMALL}
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, **base)
    next(iter(loader))
    state = loader.state_dict()
    for version in (1, 2):
        with pytest.raises(ValueError, match=rf"version {version}: .*set_epoch"):
            loader.load_state_dict({**state, "version": version})
    with pytest.raises(ValueError, match="loader state version 7"):
        loader.load_state_dict({**state, "version": 7})


def test_a_state_of_before_span_bytes_was_recorded_resumes_with_the_8_mib_of_then():
    from .test_ddp import digest

    base = {"max_length": 1024, "batch_size": 2, "batches_per_epoch": 6, **SMALL}
    then = {**base, "span_bytes": 8 * 2**20}
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, **then)
    batches = [digest(b) for b in loader]
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, **then)
    next(iter(loader))
    state = loader.state_dict()
    del state["config"]["span_bytes"]  # as an older wdsvlm saved it
    with pytest.raises(ValueError, match=r"other settings: span_bytes 8388608 -> 1048576"):
        wdsvlm.Loader(EXAMPLE, TOKENIZER, **base).load_state_dict(state)
    resumed = wdsvlm.Loader(EXAMPLE, TOKENIZER, **then)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)
    assert [digest(b) for b in resumed] == batches[1:]


def test_a_state_of_before_chunks_were_capped_is_refused_where_the_cap_changes_the_order():
    """The example's samples (10 KB) fill 77 to a chunk without the cap of 32, and the
    default buffer holds 5136 of them: a state saved by a release without either default is
    refused naming both, and resumes exactly with the values of then."""
    from .test_ddp import digest

    base = {"max_length": 1024, "batch_size": 2, "batches_per_epoch": 6, **SMALL}
    then = {**base, "shuffle_buffer": 1000, "span_samples": None}
    batches = [digest(b) for b in wdsvlm.Loader(EXAMPLE, TOKENIZER, **then)]
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, **then)
    next(iter(loader))
    state = loader.state_dict()
    del state["config"]["span_samples"]  # as an older wdsvlm saved it
    with pytest.raises(
        ValueError, match=r"other settings: shuffle_buffer 1000 -> 5136, span_samples None -> 32"
    ):
        wdsvlm.Loader(EXAMPLE, TOKENIZER, **base).load_state_dict(state)
    resumed = wdsvlm.Loader(EXAMPLE, TOKENIZER, **then)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)
    assert [digest(b) for b in resumed] == batches[1:]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.processes
def test_small_chunks_read_several_at_once_resume_exactly_from_any_step(workers):
    """Chunks of a few samples (over 40 chunk visits a pass), four reads in flight and a
    small shuffle buffer: a state saved at any step, mid-visit and with reads in flight,
    gives the uninterrupted run's batches, bit for bit; each pass holds every sample once."""
    from .test_ddp import digest

    options = {
        "max_length": 1024,
        "batch_size": 2,
        "span_bytes": 60_000,
        "read_ahead": 4,
        "shuffle_buffer": 16,
        "num_workers": workers,
        **SMALL,
    }
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, **options)
    assert sum(1 for _ in loader.plan.read_spans(0, [[0, loader.plan.num_samples]], 0)) > 40
    digests, states, batches = [], [], []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            batches.append(batch)
            digests.append(digest(batch))
            states.append(loader.state_dict())
    assert sorted(keys_of(batches, of_pass=0)) == example_keys()
    for k in (1, len(loader) // 2 + 1, len(loader) + 3):
        resumed = wdsvlm.Loader(EXAMPLE, TOKENIZER, **options)
        resumed.load_state_dict(states[k - 1])
        got = []
        for epoch in range(states[k - 1]["epoch"], 2):
            resumed.set_epoch(epoch)
            got += [digest(b) for b in resumed]
        assert got == digests[k:], f"after step {k}"


def test_a_dataset_where_nothing_fits_is_an_error_not_an_endless_loop():
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, max_length=8, batch_size=1, **SMALL)
    with pytest.raises(wdsvlm.WdsvlmError, match=r"no batch can come: .*too_many_tokens"):
        next(iter(loader))


def test_a_dataset_of_only_bad_samples_is_an_error_not_an_endless_loop(tmp_path):
    from .conftest import write_jsonl

    records = [
        {
            "id": f"r{i}",
            "conversations": [{"from": "human", "value": "Q?"}, {"from": "gpt", "value": "A."}],
        }
        for i in range(6)
    ]
    data = str(tmp_path / "ds")
    wdsvlm.write_dataset(write_jsonl(str(tmp_path / "in.jsonl"), records), data, progress=False)
    shard = os.path.join(data, "data-000000.tar")
    spoiled = open(shard, "rb").read().replace(b'{"id":"r', b'#{"id":"')  # no JSON parses
    open(shard, "wb").write(spoiled)
    # with the cap on failures in a row out of the way (6 bad samples a pass could be fewer
    # than the cap)
    loader = wdsvlm.Loader(
        data, TOKENIZER, max_length=256, batches_per_epoch=2, max_consecutive_failures=10**6
    )
    with pytest.raises(wdsvlm.WdsvlmError, match=r"no batch can come: .*invalid_json"):
        next(iter(loader))


def test_set_epoch_of_an_epoch_iterated_whole_is_refused_and_a_restored_end_yields_nothing():
    """``set_epoch(e)`` once epoch ``e`` was iterated whole would yield nothing: refused,
    naming the next epoch. Restored at an epoch's end (a checkpoint saved after its last
    batch), ``set_epoch(e)`` yields nothing and ``set_epoch(e + 1)`` goes on, as a resumed loop
    needs."""
    settings = dict(SMALL, max_length=512, batch_size=2, batches_per_epoch=3)
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, **settings)
    loader.set_epoch(0)
    first = list(loader)
    assert len(first) == 3
    with pytest.raises(wdsvlm.WdsvlmError, match=r"epoch 0 is whole already.*set_epoch\(1\)"):
        loader.set_epoch(0)
    state = loader.state_dict()
    loader.set_epoch(1)
    second = list(loader)

    resumed = wdsvlm.Loader(EXAMPLE, TOKENIZER, **settings)
    resumed.load_state_dict(state)
    resumed.set_epoch(0)
    assert list(resumed) == []
    resumed.set_epoch(1)
    assert [b["sample_keys"] for b in resumed] == [b["sample_keys"] for b in second]


@pytest.mark.processes
def test_a_loader_built_before_the_process_group_that_disagrees_with_it_is_refused(tmp_path):
    """A launcher that sets no ``RANK`` (``torch.multiprocessing.spawn``): a Loader built before
    ``init_process_group`` believes it is rank 0 of 1; its first iteration says so, naming both
    and the fix, instead of every rank reading the whole dataset."""
    import sys

    from .conftest import run_process

    script = tmp_path / "spawned.py"
    script.write_text(
        SPAWNED.format(example=EXAMPLE, tokenizer=TOKENIZER, store=tmp_path / "store")
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    run = run_process([sys.executable, str(script)], timeout=180, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("rank"))
    assert lines == [
        "rank 0: built as rank 0 of 1 (read from the environment when it was built), but "
        "torch.distributed says this process is rank 0 of 2",
        "rank 1: built as rank 0 of 1 (read from the environment when it was built), but "
        "torch.distributed says this process is rank 1 of 2",
    ], run.stdout


SPAWNED = """
import os

import torch.distributed as dist
import torch.multiprocessing as mp

import wdsvlm


def run(rank):
    loader = wdsvlm.Loader({example!r}, {tokenizer!r}, max_length=512, batch_size=2,
                           tile_size=128, max_image_side=256, tokens_per_tile=16)
    dist.init_process_group("gloo", init_method="file://{store}", rank=rank, world_size=2)
    try:
        next(iter(loader))
    except wdsvlm.WdsvlmError as e:
        assert "Build the Loader after init_process_group, or pass it rank=" in str(e), e
        said = str(e).split("this Loader was ")[1].split(":")[0]
        said = f"rank {{rank}}: {{said}}"
    else:
        said = f"rank {{rank}}: no error"
    os.write(1, (said + "\\n").encode())  # one write: the ranks' lines do not interleave
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, nprocs=2)
"""


@pytest.mark.parametrize("workers,persistent", [(0, False), (2, True)])
@pytest.mark.processes
def test_an_abandoned_iteration_collected_later_leaves_the_running_one_alone(workers, persistent):
    """An iteration given up after one batch and collected while a later one runs: its
    clean-up stops nothing of the later one's (its stream, its workers: with
    ``persistent_workers`` the same processes)."""
    settings = dict(
        SMALL,
        max_length=512,
        batch_size=2,
        batches_per_epoch=6,
        num_workers=workers,
        persistent_workers=persistent,
    )
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, **settings)
    abandoned = iter(loader)
    next(abandoned)
    loader.set_epoch(1)
    later = iter(loader)
    got = [next(later)]
    del abandoned  # collected now: its GeneratorExit runs its clean-up
    got += list(later)
    alone = wdsvlm.Loader(EXAMPLE, TOKENIZER, **settings)
    alone.set_epoch(1)
    assert [b["sample_keys"] for b in got] == [b["sample_keys"] for b in alone]


def test_a_vision_budget_that_binds_is_logged_once_an_epoch_with_what_it_costs(caplog):
    """Eight tiles a row of 2048 tokens holds a few of the example's samples: the budget ends
    most packs, and rank 0 says so at the end of each epoch; without a budget it says
    nothing."""
    import logging

    options = {"max_length": 2048, "batch_size": 2, "batches_per_epoch": 4, "pack_window": 20}
    options.update(SMALL)  # a window of 20: each epoch packs its own (500 holds the pass)
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, max_tiles_per_pack=8, **options)
    with caplog.at_level(logging.WARNING, logger="wdsvlm.loader"):
        for epoch in range(2):
            loader.set_epoch(epoch)
            batches = list(loader)
            assert loader.stats()["vision_bound"] > len(batches)  # most of 8 packs
    said = [r.getMessage() for r in caplog.records if "vision budget binds" in r.getMessage()]
    assert [m.split(":")[0] for m in said] == ["epoch 0", "epoch 1"]
    assert "ended at max_tiles_per_pack=8 tiles with under 90% of max_length=2048" in said[0]
    assert re.search(r"about max_tiles_per_pack=\d+ would not bind", said[0])
    caplog.clear()
    unbounded = wdsvlm.Loader(EXAMPLE, TOKENIZER, **options)
    with caplog.at_level(logging.WARNING, logger="wdsvlm.loader"):
        list(unbounded)
    assert unbounded.stats()["vision_bound"] == 0
    assert not [r for r in caplog.records if "vision budget" in r.getMessage()]
