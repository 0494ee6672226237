"""The shard table of a dataset on a store, fetched once per node: a version-3 dataset served over
HTTP by the counting range server on 127.0.0.1 (``testing.stores.RangeServer``), read by
several Loader processes of one "node" (one ``local_dir``), each with DataLoader workers; a
damaged copy on the node's disk; a table on the store that is not the one its index names; two
datasets' tables side by side; copies left unused."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

import wdsvlm
from wdsvlm import write_dataset
from wdsvlm.errors import StorageError
from wdsvlm.format.table import TABLES
from wdsvlm.loader.build import on_this_node
from wdsvlm.loader.settings import LoaderSettings
from wdsvlm.storage.fs import ReadPolicy
from wdsvlm.storage.node import UNUSED_DAYS
from wdsvlm.testing.stores import range_server

from .conftest import EXAMPLE

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"max_length": 1024, "batch_size": 2, "tile_size": 64, "max_image_side": 128}
TIME_LIMIT = 240  # seconds for the node's processes to take their first batch

LOADER_PROCESS = """
import sys

import wdsvlm

if __name__ == "__main__":
    url, node, rank, world, tokenizer = sys.argv[1:6]
    loader = wdsvlm.Loader(
        url, tokenizer, num_workers=2, rank=int(rank), world_size=int(world), local_dir=node,
        max_length=1024, batch_size=2, tile_size=64, max_image_side=128,
    )
    batch = next(iter(loader))
    print(len(batch["sample_keys"]))
"""


def write(llava_input, out: str, per_shard: int) -> dict:
    """A version-3 dataset of the 12 records, ``per_shard`` a shard; what its index.json says
    of its table."""
    path, root, _ = llava_input
    write_dataset(path, out, image_root=root, samples_per_shard=per_shard, progress=False)
    return json.load(open(os.path.join(out, "index.json")))["table"]


def copies(node: str) -> dict[str, str]:
    """The table copies in the node folder: the sha256 of each one's content, by file name."""
    folder = os.path.join(node, TABLES)
    return {
        name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
        for name in sorted(os.listdir(folder))
        if name.endswith(".shards")
    }


def open_table(url: str, node: str):
    return wdsvlm.load_index(url, policy=ReadPolicy(node_dir=node))["shards"]


def run_together(commands: list[list[str]], timeout: float) -> list[str]:
    """The processes of ``commands`` started at once, each in its own process group; what each
    printed. Past ``timeout`` every group is killed and the test fails with their output."""
    procs = [
        subprocess.Popen(
            c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        for c in commands
    ]
    deadline, outs = time.monotonic() + timeout, []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{' '.join(p.args)} did not finish in {timeout} s")
            assert p.returncode == 0, f"{' '.join(p.args)}:\n{err[-3000:]}"
            outs.append(out)
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # whatever it left running
    return outs


@pytest.mark.processes
def test_a_node_fetches_the_table_once_for_all_its_loaders_and_workers(tmp_path, llava_input):
    """3 Loader processes of one node, 2 DataLoader workers each (9 processes open the table),
    started at once: the table's bytes are served once, index.json once per Loader, and the
    node holds one copy, the one its index names."""
    table = write(llava_input, str(tmp_path / "ds"), per_shard=1)
    index_bytes = os.path.getsize(tmp_path / "ds" / "index.json")
    script = tmp_path / "loader_process.py"
    script.write_text(LOADER_PROCESS)
    node, world = str(tmp_path / "node"), 3
    with range_server(str(tmp_path / "ds"), delay=0.05) as server:
        run = [sys.executable, str(script), server.url, node]
        outs = run_together([[*run, str(r), str(world), TOKENIZER] for r in range(world)], 240)
    assert [out.split() for out in outs] == [["2"]] * world  # each took its first batch
    assert server.served_by_name[table["name"]] == table["bytes"]
    assert server.asked_by_name[table["name"]] == 1
    assert server.served_by_name["index.json"] == world * index_bytes
    assert copies(node) == {f"{table['sha256']}.shards": table["sha256"]}


def test_a_table_opened_again_on_the_node_is_not_fetched_again(tmp_path, llava_input):
    table = write(llava_input, str(tmp_path / "ds"), per_shard=2)
    node = str(tmp_path / "node")
    with range_server(str(tmp_path / "ds")) as server:
        first = open_table(server.url, node)
        again = open_table(server.url, node)
        assert first.names(0, 6) == again.names(0, 6)
        assert server.served_by_name[table["name"]] == table["bytes"]


@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_a_damaged_copy_on_the_node_is_fetched_anew(tmp_path, llava_input, damage):
    """A copy cut short (its size tells) or garbled at its size (not a table: its header
    tells) is replaced by a fresh fetch, checked against the digest its index names."""
    table = write(llava_input, str(tmp_path / "ds"), per_shard=2)
    node = str(tmp_path / "node")
    path = os.path.join(node, TABLES, f"{table['sha256']}.shards")
    with range_server(str(tmp_path / "ds")) as server:
        names = open_table(server.url, node).names(0, 6)
        data = open(path, "rb").read()
        with open(path, "wb") as f:  # damaged in place, as a disk would
            f.write(data[: len(data) // 2] if damage == "truncated" else bytes(len(data)))
        assert open_table(server.url, node).names(0, 6) == names
        assert server.served_by_name[table["name"]] == 2 * table["bytes"]
    assert copies(node) == {f"{table['sha256']}.shards": table["sha256"]}


def test_a_table_on_the_store_unlike_its_digest_is_fetched_twice_then_named(tmp_path, llava_input):
    table = write(llava_input, str(tmp_path / "ds"), per_shard=2)
    stored = tmp_path / "ds" / table["name"]
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF  # damaged on the store, at its size
    stored.write_bytes(bytes(data))
    node = str(tmp_path / "node")
    with range_server(str(tmp_path / "ds")) as server:
        with pytest.raises(StorageError) as raised:
            open_table(server.url, node)
        assert server.served_by_name[table["name"]] == 2 * table["bytes"]
    message = str(raised.value)
    assert f"{server.url}/{table['name']}: fetched twice into {node}/{TABLES}" in message
    assert f"not the {table['bytes']} bytes, sha256 {table['sha256'][:12]}" in message
    assert copies(node) == {}  # nothing wrong left in place


def test_two_datasets_on_one_node_each_get_their_copy(tmp_path, llava_input):
    tables = [write(llava_input, str(tmp_path / f"ds{n}"), per_shard=n) for n in (2, 3)]
    assert tables[0]["sha256"] != tables[1]["sha256"]
    node = str(tmp_path / "node")
    for n, table in zip((2, 3), tables, strict=True):
        with range_server(str(tmp_path / f"ds{n}")) as server:
            assert len(open_table(server.url, node)) == 12 // n
            assert server.served_by_name[table["name"]] == table["bytes"]
    assert copies(node) == {f"{t['sha256']}.shards": t["sha256"] for t in tables}


def test_copies_unused_for_days_are_removed_when_another_is_written(tmp_path, llava_input):
    tables = [write(llava_input, str(tmp_path / f"ds{n}"), per_shard=n) for n in (2, 3, 4)]
    node = str(tmp_path / "node")
    folder = os.path.join(node, TABLES)
    for n in (2, 3):
        with range_server(str(tmp_path / f"ds{n}")) as server:
            open_table(server.url, node)
    old = time.time() - (UNUSED_DAYS + 1) * 86400
    for table in tables[:2]:
        os.utime(os.path.join(folder, f"{table['sha256']}.shards"), (old, old))
    with range_server(str(tmp_path / "ds3")) as server:
        open_table(server.url, node)  # opened again: marked as used now
    with range_server(str(tmp_path / "ds4")) as server:
        open_table(server.url, node)  # a new copy written: the unused ones go
    assert set(copies(node)) == {f"{t['sha256']}.shards" for t in tables[1:]}


def test_the_node_folder_is_local_dir_else_under_the_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("WDSVLM_LOCAL_DIR")  # set for each test by conftest
    given = on_this_node(LoaderSettings(local_dir=str(tmp_path / "local")))
    assert given.read_policy.node_dir == str(tmp_path / "local")
    cached = on_this_node(LoaderSettings(cache_dir=str(tmp_path / "cache")))
    assert cached.read_policy.node_dir == os.path.join(str(tmp_path / "cache"), "node")
    policy = ReadPolicy(node_dir=str(tmp_path / "policy"), attempts=2)
    kept = on_this_node(LoaderSettings(local_dir=str(tmp_path / "x"), read_policy=policy))
    assert kept.read_policy == replace(policy, node_bytes=LoaderSettings().local_bytes)
    capped = replace(policy, node_bytes=5)
    assert on_this_node(LoaderSettings(local_bytes=7, read_policy=capped)).read_policy == capped
    assert "local_dir" not in on_this_node(LoaderSettings()).shaping()  # not in a state


def test_wdsvlm_local_dir_names_the_node_folder_where_local_dir_does_not(tmp_path, monkeypatch):
    monkeypatch.setenv("WDSVLM_LOCAL_DIR", str(tmp_path / "site"))
    assert on_this_node(LoaderSettings()).read_policy.node_dir == str(tmp_path / "site")
    cached = on_this_node(LoaderSettings(cache_dir=str(tmp_path / "cache")))
    assert cached.read_policy.node_dir == str(tmp_path / "site")  # the site's choice first
    given = on_this_node(LoaderSettings(local_dir=str(tmp_path / "local")))
    assert given.read_policy.node_dir == str(tmp_path / "local")
    monkeypatch.delenv("WDSVLM_LOCAL_DIR")
    assert on_this_node(LoaderSettings()).read_policy.node_dir.endswith(f"wdsvlm-{os.getuid()}")
