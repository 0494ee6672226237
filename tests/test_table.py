"""The shard table of index version 3 against the ``index.json`` that names it: a dataset
rewritten in place while a Loader (and its worker processes, which open the table again by its
path) holds the old one."""

from __future__ import annotations

import faulthandler
import json
import os
import shutil

import pytest

import wdsvlm
from wdsvlm import write_dataset
from wdsvlm.errors import ShardFormatError
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
