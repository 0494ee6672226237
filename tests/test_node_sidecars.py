"""The shards' sidecars of a dataset on a store, kept once per node: a version-3 dataset served
over HTTP by the counting range server on 127.0.0.1 (``testing.stores.RangeServer``), read by
several Loader processes of one "node" (one ``local_dir``), each with DataLoader workers; the
requests a read counts; a damaged copy; copies bounded by ``local_bytes``; a dataset rewritten
in place."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys

import pytest

import wdsvlm
from wdsvlm.errors import ShardFormatError
from wdsvlm.format import sidecar
from wdsvlm.format.table import TABLES
from wdsvlm.storage.fs import ReadPolicy, RequestCounts
from wdsvlm.storage.node import LOCAL_BYTES, SIDECARS
from wdsvlm.testing.stores import range_server

from .test_node_table import TOKENIZER, run_together, write

TIME_LIMIT = 240  # seconds for the node's processes to read their epoch

LOADER_PROCESS = """
import sys

import wdsvlm

if __name__ == "__main__":
    url, node, local_bytes, rank, world, tokenizer = sys.argv[1:7]
    loader = wdsvlm.Loader(
        url, tokenizer, num_workers=2, rank=int(rank), world_size=int(world), local_dir=node,
        local_bytes=int(local_bytes), max_length=1024, batch_size=2, tile_size=64,
        max_image_side=128,
    )
    print(sum(1 for _ in loader))
"""

READER_PROCESS = """
import random
import sys

import wdsvlm
from wdsvlm.format import sidecar
from wdsvlm.storage.fs import ReadPolicy

if __name__ == "__main__":
    url, node, cap, seed = sys.argv[1:5]
    shards = wdsvlm.load_index(url, policy=ReadPolicy(node_dir=node, node_bytes=int(cap)))["shards"]
    order = list(range(len(shards))) * 8
    random.Random(int(seed)).shuffle(order)
    for i in order:
        sidecar._cache.clear()  # as a new process would: read from the node's copy, or fetched
        assert len(shards[i]["entries"].loaded()) == shards[i]["samples"]
    print(len(order))
"""


def sidecars_of(folder: str) -> dict[str, bytes]:
    """The sidecars of a dataset folder, by name."""
    return {
        name: open(os.path.join(folder, name), "rb").read()
        for name in sorted(os.listdir(folder))
        if name.endswith(".idx")
    }


def node_copies(node: str) -> dict[str, str]:
    """The sidecar copies of a node folder: the sha256 of each one's content, by file name."""
    folder = os.path.join(node, SIDECARS)
    if not os.path.isdir(folder):
        return {}
    return {
        name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
        for name in sorted(os.listdir(folder))
        if name.endswith(sidecar.SIDECAR_SUFFIX)
    }


def copied_bytes(node: str) -> int:
    folder = os.path.join(node, SIDECARS)
    return sum(os.path.getsize(os.path.join(folder, name)) for name in node_copies(node))


def shards_of(url: str, node: str, cap: int | None = None) -> list[dict]:
    policy = ReadPolicy(node_dir=node, node_bytes=cap)
    return list(wdsvlm.load_index(url, policy=policy)["shards"])


def asked_sidecars(server) -> dict[str, int]:
    return {name: n for name, n in server.asked_by_name.items() if name.endswith(".idx")}


@pytest.mark.processes
def test_a_node_reads_each_sidecar_from_the_store_once_for_all_its_loaders_and_workers(
    tmp_path, llava_input
):
    """3 Loader processes of one node, 2 DataLoader workers each (9 processes read sidecars:
    each rank to size its epochs, each worker for the shards it reads), a whole epoch: with
    the node's copies each sidecar is asked of the store once; without (``local_bytes=0``,
    as each process read them before) once per process that reads it."""
    write(llava_input, str(tmp_path / "ds"), per_shard=1)
    names = set(sidecars_of(str(tmp_path / "ds")))
    script = tmp_path / "loader_process.py"
    script.write_text(LOADER_PROCESS)
    asked, world = {}, 3
    for cap in (0, LOCAL_BYTES):
        node = str(tmp_path / f"node-{cap}")
        with range_server(str(tmp_path / "ds"), delay=0.02) as server:
            run = [sys.executable, str(script), server.url, node, str(cap)]
            commands = [[*run, str(r), str(world), TOKENIZER] for r in range(world)]
            outs = run_together(commands, TIME_LIMIT)
        assert all(int(out) > 0 for out in outs)  # each rank read batches
        asked[cap] = asked_sidecars(server)
    print(
        f"sidecar GETs, 12 sidecars: {sum(asked[0].values())} without the node's copies, "
        f"{sum(asked[LOCAL_BYTES].values())} with them"
    )
    assert asked[LOCAL_BYTES] == dict.fromkeys(names, 1)
    assert set(asked[0]) == names and min(asked[0].values()) >= world  # each rank sized them
    stored = {
        hashlib.sha256(data).hexdigest() for data in sidecars_of(str(tmp_path / "ds")).values()
    }
    copies = node_copies(str(tmp_path / f"node-{LOCAL_BYTES}"))
    assert copies == {f"{digest}.idx": digest for digest in stored}
    assert node_copies(str(tmp_path / "node-0")) == {}


def test_a_fetch_is_a_request_a_read_of_the_nodes_copy_is_not(tmp_path, llava_input):
    """What a read counts (``sidecar.counting``, where ``stats()["requests"]`` gets its
    sidecars' figures): the fetch of a node's copy, its GETs and bytes as the store sent them;
    a later read of the copy by a Loader that has not read it (another store URL: another
    key of the process's cache), nothing, and the store is not asked."""
    write(llava_input, str(tmp_path / "ds"), per_shard=2)
    node = str(tmp_path / "node")
    figures = []
    for _ in range(2):
        with range_server(str(tmp_path / "ds")) as server:
            counts = RequestCounts()
            token = sidecar.counting.set(counts)
            try:
                loaded = [len(shard["entries"].loaded()) for shard in shards_of(server.url, node)]
            finally:
                sidecar.counting.reset(token)
        assert loaded == [2] * 6
        sent = sum(asked_sidecars(server).values())
        served = sum(n for name, n in server.served_by_name.items() if name.endswith(".idx"))
        figures.append((counts.requests, counts.bytes, sent, served))
    size = sum(map(len, sidecars_of(str(tmp_path / "ds")).values()))
    assert figures == [(6, size, 6, size), (0, 0, 0, 0)]


@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_a_damaged_copy_of_a_sidecar_is_fetched_anew(tmp_path, llava_input, damage):
    write(llava_input, str(tmp_path / "ds"), per_shard=2)
    node = str(tmp_path / "node")
    with range_server(str(tmp_path / "ds")) as server:
        first = shards_of(server.url, node)[0]
        keys = [entry["key"] for entry in first["entries"].loaded()]
        path = os.path.join(node, SIDECARS, f"{first['sidecar']['sha256']}.idx")
        data = open(path, "rb").read()
        with open(path, "wb") as f:  # damaged in place, as a disk would
            f.write(data[: len(data) // 2] if damage == "truncated" else bytes(len(data)))
    with range_server(str(tmp_path / "ds")) as server:  # another URL: not in this process's cache
        again = shards_of(server.url, node)[0]["entries"].loaded()
        assert [entry["key"] for entry in again] == keys
        assert asked_sidecars(server) == {first["sidecar"]["name"]: 1}
    assert open(path, "rb").read() == data


def test_the_copies_stay_within_local_bytes_the_least_recently_used_removed_first(
    tmp_path, llava_input
):
    """12 sidecars, a cap that holds 3 of them: after each fetch the node's copies take at most
    the cap, the copies left are the ones read last, and the table's copy stays."""
    write(llava_input, str(tmp_path / "ds"), per_shard=1)
    sizes = sorted(map(len, sidecars_of(str(tmp_path / "ds")).values()))
    cap = sum(sizes[-3:])
    node = str(tmp_path / "node")
    with range_server(str(tmp_path / "ds")) as server:
        shards = shards_of(server.url, node, cap)
        for shard in shards:
            assert len(shard["entries"].loaded()) == 1
            assert copied_bytes(node) <= cap
    assert len(node_copies(node)) >= 2
    last = [f"{shard['sidecar']['sha256']}.idx" for shard in shards[-2:]]
    assert set(last) <= set(node_copies(node))
    assert len(os.listdir(os.path.join(node, TABLES))) == 2  # the table's copy and its lock


@pytest.mark.processes
def test_copies_removed_to_make_room_are_fetched_again_by_the_processes_reading_them(
    tmp_path, llava_input
):
    """4 processes of one node read the 12 sidecars 8 times each in random orders, the node's
    cap holding 2 of them: copies are removed while others open them, and every read gives the
    sidecar's samples; the copies stay within the cap."""
    write(llava_input, str(tmp_path / "ds"), per_shard=1)
    sizes = sorted(map(len, sidecars_of(str(tmp_path / "ds")).values()))
    cap = sum(sizes[-2:])
    script = tmp_path / "reader_process.py"
    script.write_text(READER_PROCESS)
    node = str(tmp_path / "node")
    with range_server(str(tmp_path / "ds")) as server:
        run = [sys.executable, str(script), server.url, node, str(cap)]
        outs = run_together([[*run, str(seed)] for seed in range(4)], TIME_LIMIT)
    assert [int(out) for out in outs] == [96] * 4
    assert copied_bytes(node) <= cap
    print(f"sidecar GETs: {sum(asked_sidecars(server).values())} for 4 x 96 reads")


def test_a_dataset_rewritten_in_place_has_its_sidecars_fetched_anew(tmp_path, llava_input):
    """The same shard names with other samples (6 to a shard, then 4): the new index names new
    sidecar digests, so new copies, fetched from the store; a Loader of the old index reading a
    shard it had not read is told the dataset was rewritten."""
    folder = str(tmp_path / "ds")
    write(llava_input, folder, per_shard=6)
    node = str(tmp_path / "node")
    with range_server(folder) as server:
        old = shards_of(server.url, node)
        assert len(old[0]["entries"].loaded()) == 6
        shutil.rmtree(folder)
        write(llava_input, folder, per_shard=4)
        new = shards_of(server.url, node)
        assert [len(shard["entries"].loaded()) for shard in new] == [4, 4, 4]
        assert asked_sidecars(server)["data-000000.idx"] == 2
        with pytest.raises(ShardFormatError, match="rewritten in place since the Loader was built"):
            old[1]["entries"].loaded()
    digests = {shard["sidecar"]["sha256"] for shard in (old[0], *new)}
    assert set(node_copies(node)) == {f"{digest}.idx" for digest in digests}


def test_a_node_folder_that_takes_no_copy_leaves_the_sidecars_read_from_the_store(
    tmp_path, llava_input, caplog
):
    """``sidecars`` in the node folder is a file (no copy can be kept there): each sidecar is
    read from the store, with one warning naming the folder and the fix."""
    write(llava_input, str(tmp_path / "ds"), per_shard=2)
    node = tmp_path / "node"
    node.mkdir()
    (node / SIDECARS).write_text("not a folder")
    with range_server(str(tmp_path / "ds")) as server:
        with caplog.at_level("WARNING", logger="wdsvlm.sidecar"):
            loaded = [len(shard["entries"].loaded()) for shard in shards_of(server.url, str(node))]
        assert loaded == [2] * 6
        assert asked_sidecars(server) == dict.fromkeys(sidecars_of(str(tmp_path / "ds")), 1)
    warned = [r.getMessage() for r in caplog.records if "cannot be kept there" in r.getMessage()]
    assert len(warned) == 1 and str(node / SIDECARS) in warned[0] and "local_dir" in warned[0]
