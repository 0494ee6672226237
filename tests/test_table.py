"""The shard table of index version 3 against the ``index.json`` that names it: a dataset
rewritten in place while a Loader (and its worker processes, which open the table again by its
path) holds the old one; and a process that holds the old table open (no workers, forked or
persistent workers), whose shards are checked through their sidecars."""

from __future__ import annotations

import faulthandler
import hashlib
import json
import multiprocessing
import os
import re
import shutil
import time

import pytest

import wdsvlm
from wdsvlm import write_dataset
from wdsvlm.errors import ShardFormatError
from wdsvlm.format import sidecar
from wdsvlm.format.builder import remove_tables

from .conftest import EXAMPLE

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"max_length": 1024, "batch_size": 2, "tile_size": 64, "max_image_side": 128}
TIME_LIMIT = 240  # seconds; past it every thread's stack is printed and the run ends


def write(llava_input, out: str, per_shard: int) -> None:
    path, root, _ = llava_input
    write_dataset(
        path, out, image_root=root, samples_per_shard=per_shard, progress=False, overwrite=True
    )


def keys_of(loader) -> list[str]:
    return [k for batch in loader for row in batch["sample_keys"] for k in row]


def table_of(folder: str) -> dict:
    return json.load(open(os.path.join(folder, "index.json")))["table"]


@pytest.mark.processes
def test_a_dataset_rewritten_in_place_is_named_to_the_loader_that_holds_the_old_one(
    tmp_path, llava_input
):
    out = str(tmp_path / "ds")
    write(llava_input, out, per_shard=6)  # 2 shards
    old_table = table_of(out)
    old = wdsvlm.Loader(out, TOKENIZER, num_workers=2, **SMALL)
    write(llava_input, out, per_shard=3)  # 4 shards, in place
    new_table = table_of(out)
    assert new_table["name"] != old_table["name"] and new_table["rows"] == 4
    # the new table came under its own name; the old one went once the new index.json was there
    tables = sorted(n for n in os.listdir(out) if n.endswith(".shards"))
    assert tables == [new_table["name"]]
    faulthandler.dump_traceback_later(TIME_LIMIT, exit=True)
    try:
        with pytest.raises(ShardFormatError) as raised:
            keys_of(old)  # its workers open the table its index.json named
        message = str(raised.value)
        assert old_table["name"] in message and "the shard table is missing" in message
        assert f"now names {new_table['name']}" in message and "rewritten in place" in message
        new = wdsvlm.Loader(out, TOKENIZER, num_workers=2, **SMALL)
        assert len(new.plan.sources[0].index["shards"]) == 4
        shards = {k.split("/")[0] for k in keys_of(new)}
        assert len(shards) == 4  # the new dataset whole, none of the old
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.mark.processes
def test_a_loader_built_before_a_rewrite_that_is_under_way_is_told(tmp_path, llava_input):
    """A writer replacing a dataset removes its index.json and its table before it writes the
    new shards: a worker of a Loader built on the old one cannot pair them with new shards."""
    out = str(tmp_path / "ds")
    write(llava_input, out, per_shard=6)
    loader = wdsvlm.Loader(out, TOKENIZER, num_workers=2, **SMALL)
    os.remove(os.path.join(out, "index.json"))  # as the writer does first
    remove_tables(out)
    assert not [n for n in os.listdir(out) if n.endswith(".shards")]
    faulthandler.dump_traceback_later(TIME_LIMIT, exit=True)
    try:
        with pytest.raises(ShardFormatError, match="is gone too: the dataset is being rewritten"):
            keys_of(loader)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.mark.processes
def test_a_table_replaced_under_its_old_name_is_refused_by_size_and_rows(tmp_path, llava_input):
    """A dataset of the fixed table name ``index.shards`` (as written before tables were named
    by their digest): a table of another dataset put there under the same name is refused on
    open, in the workers too, naming both sizes and row counts."""
    old, other = str(tmp_path / "old"), str(tmp_path / "other")
    write(llava_input, old, per_shard=6)
    write(llava_input, other, per_shard=3)
    for folder in (old, other):  # as a writer of fixed names left them
        index = json.load(open(os.path.join(folder, "index.json")))
        os.rename(os.path.join(folder, index["table"].pop("name")), f"{folder}/index.shards")
        index["table"]["name"] = "index.shards"
        del index["table"]["rows"]  # not recorded then: the shard total stands for it
        with open(os.path.join(folder, "index.json"), "w") as f:
            json.dump(index, f)
    size = table_of(old)["bytes"]
    loader = wdsvlm.Loader(old, TOKENIZER, num_workers=2, **SMALL)
    shutil.copyfile(f"{other}/index.shards", f"{old}/index.shards")  # rewritten under it
    other_size = os.path.getsize(f"{old}/index.shards")
    faulthandler.dump_traceback_later(TIME_LIMIT, exit=True)
    try:
        with pytest.raises(ShardFormatError) as raised:
            keys_of(loader)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert (
        f"index.shards: {other_size} bytes and 4 shards, but the index.json that names it says "
        f"{size} bytes and 2 shards" in str(raised.value)
    )
    with pytest.raises(ShardFormatError, match="rewritten in place"):
        wdsvlm.load_index(old)  # in this process too, on every open


def test_opening_a_table_checks_two_numbers_not_its_digest(tmp_path, llava_input):
    """The check on open is the size and the row count (O(1)); ``verify`` reads the digest."""
    out = str(tmp_path / "ds")
    write(llava_input, out, per_shard=6)
    path = os.path.join(out, table_of(out)["name"])
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 0xFF  # a damaged byte at the same size: opens, but verify names it
    open(path, "wb").write(bytes(data))
    assert len(wdsvlm.load_index(out)["shards"]) == 2
    with pytest.raises(ShardFormatError, match="shards: .* bytes, sha256 .*changed or truncated"):
        wdsvlm.verify_dataset(out)


def old_sidecars(folder: str) -> dict[str, tuple[str, int]]:
    """Each shard's sidecar and its bytes, as the dataset's index records them now."""
    shards = wdsvlm.load_index(folder)["shards"]
    return {s["name"]: (s["sidecar"]["name"], s["sidecar"]["bytes"]) for s in shards}


def batches_until_refused(loader) -> tuple[list, str]:
    """The batches a loader gives before it raises ``ShardFormatError``, and its message."""
    got = []
    faulthandler.dump_traceback_later(TIME_LIMIT, exit=True)
    try:
        with pytest.raises(ShardFormatError) as raised:
            for batch in loader:
                got.append(batch)
    finally:
        faulthandler.cancel_dump_traceback_later()
    return got, str(raised.value)


def assert_names_the_rewrite(message: str, folder: str, old: dict) -> None:
    """The message names a shard, its sidecar, the sidecar's size now and as the old index
    recorded it, and says what happened."""
    found = re.search(
        r"shard (\S+): its sidecar (\S+) is (\d+) bytes, sha256 \w+\.\.\., but "
        r"the index this Loader read records (\d+) bytes",
        message,
    )
    assert found, message
    shard, url, now, said = found.groups()
    assert url == os.path.join(folder, old[shard][0])
    assert int(said) == old[shard][1] and int(now) == os.path.getsize(url) != int(said)
    assert "rewritten in place since the Loader was built" in message


def assert_a_new_loader_reads_the_new_dataset(folder: str, **settings) -> None:
    new = wdsvlm.Loader(folder, TOKENIZER, **SMALL, **settings)
    try:
        assert len(new.plan.sources[0].index["shards"]) == 4
        faulthandler.dump_traceback_later(TIME_LIMIT, exit=True)
        try:
            keys = keys_of(new)
        finally:
            faulthandler.cancel_dump_traceback_later()
        assert {k.split("/")[0] for k in keys} == {f"data-00000{i}.tar" for i in range(4)}
        assert len(keys) >= 4
        assert not new.stats()["skipped"]
    finally:
        new.close()


def test_a_loader_without_workers_is_told_of_a_rewrite_in_place(tmp_path, llava_input):
    """The Loader's own process mapped the old table and read the old sidecars when it was
    built: the next span of a shard finds the sidecar replaced and is refused, before any new
    shard is read with the old offsets."""
    out = str(tmp_path / "ds")
    write(llava_input, out, per_shard=6)  # 2 shards
    old = wdsvlm.Loader(out, TOKENIZER, num_workers=0, **SMALL)
    recorded = old_sidecars(out)
    write(llava_input, out, per_shard=3)  # 4 shards, in place
    got, message = batches_until_refused(old)
    assert got == []  # not a batch of old offsets in new shards
    assert_names_the_rewrite(message, out, recorded)
    assert old.stats()["skipped"] == {}
    assert_a_new_loader_reads_the_new_dataset(out, num_workers=0)


def write_copies(llava_input, out: str, per_shard: int, copies: int) -> None:
    """``copies`` times the records of ``llava_input`` (each copy with its own ids)."""
    path, root, records = llava_input
    more = os.path.join(os.path.dirname(path), f"copies-{copies}.jsonl")
    with open(more, "w") as f:
        for k in range(copies):
            for r in records:
                f.write(json.dumps({**r, "id": f"{r['id']}-{k}"}) + "\n")
    write_dataset(
        more, out, image_root=root, samples_per_shard=per_shard, progress=False, overwrite=True
    )


@pytest.mark.processes
def test_persistent_workers_are_told_of_a_rewrite_between_epochs(tmp_path, llava_input):
    """Workers that mapped the old table and read the old sidecars in epoch 0 are still
    running when epoch 1 starts after the dataset was rewritten in place: refused, naming the
    sidecar. Their buffers are small, so that epoch 1 reads shards again (what they read
    before the rewrite is the old dataset whole, and may come first)."""
    out = str(tmp_path / "ds")
    write_copies(llava_input, out, per_shard=120, copies=20)  # 2 shards of 120
    small = dict(pack_window=4, shuffle_buffer=4, read_ahead=0, span_samples=4)
    old = wdsvlm.Loader(
        out,
        TOKENIZER,
        num_workers=2,
        persistent_workers=True,
        batches_per_epoch=4,
        **small,
        **SMALL,
    )
    recorded = old_sidecars(out)
    before = {p.pid for p in multiprocessing.active_children()}
    try:
        faulthandler.dump_traceback_later(TIME_LIMIT, exit=True)
        try:
            first = keys_of(old)
        finally:
            faulthandler.cancel_dump_traceback_later()
        assert {k.split("/")[0] for k in first} <= {"data-000000.tar", "data-000001.tar"}
        workers = {p.pid for p in multiprocessing.active_children()} - before
        assert len(workers) == 2
        write_copies(llava_input, out, per_shard=60, copies=20)  # 4 shards of 60, in place
        assert workers <= {p.pid for p in multiprocessing.active_children()}  # still running
        old.set_epoch(1)
        got, message = batches_until_refused(old)
        assert_names_the_rewrite(message, out, recorded)
        assert len(got) < 4  # the epoch did not end: it read a shard again
    finally:
        old.close()
    assert_a_new_loader_reads_the_new_dataset(out, num_workers=2, batches_per_epoch=8)


@pytest.mark.processes
def test_forked_workers_are_told_of_a_rewrite_in_place(tmp_path, llava_input):
    """Workers forked after the rewrite inherit the map of the old table and the old
    sidecars the Loader's process read when it was built: refused, naming the sidecar."""
    out = str(tmp_path / "ds")
    write(llava_input, out, per_shard=6)
    settings = dict(num_workers=2, multiprocessing_context="fork")
    old = wdsvlm.Loader(out, TOKENIZER, **settings, **SMALL)
    recorded = old_sidecars(out)
    write(llava_input, out, per_shard=3)
    got, message = batches_until_refused(old)
    assert got == []
    assert_names_the_rewrite(message, out, recorded)
    old.close()
    assert_a_new_loader_reads_the_new_dataset(out, **settings)


def test_a_version_2_dataset_rewritten_in_place_is_named_too(tmp_path, llava_input):
    """An index of version 2 lists its shards, with their sidecars' bytes and sha256, in
    ``index.json``: a Loader built on one keeps them, and refuses the sidecars of the dataset
    written in its place (its own cached ones are checked again at most every ``_RECHECK``
    seconds)."""
    out = str(tmp_path / "ds")
    write(llava_input, out, per_shard=6)
    index = json.load(open(os.path.join(out, "index.json")))
    rows = wdsvlm.load_index(out)["shards"]
    index.update(version=2, shards=[{k: v for k, v in r.items() if k != "entries"} for r in rows])
    os.remove(os.path.join(out, index.pop("table")["name"]))
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(index, f)
    recorded = old_sidecars(out)
    old = wdsvlm.Loader(out, TOKENIZER, num_workers=0, **SMALL)
    assert isinstance(old.plan.sources[0].index["shards"], list)  # version 2's
    write(llava_input, out, per_shard=3)
    time.sleep(sidecar._RECHECK)
    got, message = batches_until_refused(old)
    assert got == []
    assert_names_the_rewrite(message, out, recorded)
    assert_a_new_loader_reads_the_new_dataset(out, num_workers=0)


def test_a_sidecar_of_the_same_size_and_other_bytes_is_named_by_its_sha256(tmp_path):
    """The size check alone would pass a sidecar rewritten at the same size: its sha256,
    computed over the bytes read once, does not."""
    entry = {"offset": 0, "size": 1024, "images": [], "chars": [5]}
    old, new = (sidecar.pack_entries([{**entry, "key": k}]) for k in ("a", "b"))
    assert len(old) == len(new) and old != new
    path = tmp_path / "data-000000.idx"
    path.write_bytes(new)
    digest = hashlib.sha256(old).hexdigest()
    entries = sidecar.LazyEntries(str(path), 1, None, None, digest, len(old), "data-000000.tar")
    with pytest.raises(ShardFormatError) as raised:
        entries.loaded()
    assert (
        f"shard data-000000.tar: its sidecar {path} is {len(new)} bytes, sha256 "
        f"{hashlib.sha256(new).hexdigest()[:12]}..., but the index this Loader read records "
        f"{len(old)} bytes, sha256 {digest[:12]}..." in str(raised.value)
    )
    path.write_bytes(old)  # the one the index records
    assert entries.loaded()[0]["key"] == "a"
