"""The dataset facts a loader state records (``loader/fingerprint.py``): taken from the shard
tables' digests without reading a row; states that record every shard's row (saved on an index
of version 1 or 2, or by an earlier wdsvlm) still resume, an upgraded dataset included; a
changed dataset is still refused, named."""

from __future__ import annotations

import logging
import os
import time

import pytest

import wdsvlm
from wdsvlm import write_dataset
from wdsvlm.format.builder import publish_root, upgrade_dataset
from wdsvlm.loader.fingerprint import TABLES, dataset_facts, row_facts
from wdsvlm.pipeline.plan import Plan, WorkerConfig

from .conftest import EXAMPLE

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
BASE = {"max_length": 1024, "batch_size": 2, "batches_per_epoch": 3}
SMALL = {"tile_size": 128, "max_image_side": 256, "tokens_per_tile": 16}


def write(llava_input, out: str, per_shard: int = 4, version: int = 3) -> str:
    path, root, _ = llava_input
    write_dataset(
        path,
        out,
        image_root=root,
        samples_per_shard=per_shard,
        progress=False,
        overwrite=True,
        index_version=version,
    )
    return out


def saved_and_rest(folder: str) -> tuple[dict, list]:
    """A loader's state after its first batch, and the sample keys of the batches after it."""
    loader = wdsvlm.Loader(folder, TOKENIZER, **BASE, **SMALL)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    return state, [b["sample_keys"] for b in batches]


def resumed(folder: str, state: dict) -> list:
    loader = wdsvlm.Loader(folder, TOKENIZER, **BASE, **SMALL)
    loader.load_state_dict(state)
    return [b["sample_keys"] for b in loader]


class Watched(dict):
    """A table's columns, noting which are read."""

    def __init__(self, columns):
        super().__init__(columns)
        self.read = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)


def test_the_facts_of_a_100k_shard_table_read_none_of_its_rows(tmp_path):
    shards = 100_000
    sidecar = {"name": "", "bytes": 40, "sha256": "1" * 64}
    rows = (
        {
            "name": f"data-{s:07d}.tar",
            "samples": 10,
            "bytes": 10_000,
            "sha256": f"{s:064x}",
            "sidecar": {**sidecar, "name": f"data-{s:07d}.idx"},
        }
        for s in range(shards)
    )
    totals = {"shards": shards, "samples": 10 * shards}
    publish_root(str(tmp_path), {"format": "wdsvlm", "shards": rows, "totals": totals})
    plan = Plan(str(tmp_path), worker_config=WorkerConfig(0, 1, 0))
    table = plan.sources[0].index["shards"]
    table.columns = Watched(table.columns)
    start = time.perf_counter()
    facts = dataset_facts(plan)
    quick = time.perf_counter() - start
    assert all(v.startswith(TABLES) for v in facts.values())
    assert not table.columns.read & {"name_bytes", "name_end", "sha256"}, table.columns.read
    start = time.perf_counter()
    rows = row_facts(plan)  # the rows' form: every name and sha256 read
    slow = time.perf_counter() - start
    assert {"name_bytes", "name_end", "sha256"} <= table.columns.read
    assert not any(v.startswith(TABLES) for v in rows.values())
    print(f"100k shards: the tables' facts in {quick * 1e3:.2f} ms, the rows' in {slow:.3f} s")


def test_a_state_saved_on_a_version_2_index_resumes_exactly_after_an_upgrade(tmp_path, llava_input):
    folder = write(llava_input, str(tmp_path / "ds"), version=2)
    state, rest = saved_and_rest(folder)
    assert not state["config"]["dataset"].startswith(TABLES)  # every shard's row
    assert upgrade_dataset(folder)[0] == 2  # the same shards, a new table
    upgraded = wdsvlm.Loader(folder, TOKENIZER, **BASE, **SMALL)
    assert upgraded.plan.sources[0].index["version"] == 3
    assert upgraded.state_dict()["config"]["dataset"].startswith(TABLES)
    assert resumed(folder, state) == rest


def test_a_state_that_records_a_tables_rows_still_resumes(tmp_path, llava_input, caplog):
    """As a wdsvlm before the tables' form saved it on an index of version 3."""
    folder = write(llava_input, str(tmp_path / "ds"))
    state, rest = saved_and_rest(folder)
    assert state["config"]["shards_sha256"].startswith(TABLES)
    plan = wdsvlm.Loader(folder, TOKENIZER, **BASE, **SMALL).plan
    state["config"].update(row_facts(plan))
    with caplog.at_level(logging.WARNING, logger="wdsvlm"):
        assert resumed(folder, state) == rest
    assert "without checking" not in caplog.text


@pytest.mark.parametrize("version", [2, 3])
def test_a_changed_dataset_is_refused_naming_its_facts(tmp_path, llava_input, version):
    """A state saved on one dataset (index version 2: its rows; 3: its table), the dataset then
    written again with other shards (4 samples a shard, then 3) and, after version 2,
    upgraded: refused, the dataset's facts named."""
    folder = write(llava_input, str(tmp_path / "ds"), version=version)
    state, _ = saved_and_rest(folder)
    write(llava_input, folder, per_shard=3)
    with pytest.raises(ValueError) as raised:
        resumed(folder, state)
    message = str(raised.value)
    assert f"dataset {state['config']['dataset']!r} -> " in message
    assert "and on the data it was saved on" in message


def test_a_state_of_a_table_resumes_unchecked_on_a_version_2_index(tmp_path, llava_input, caplog):
    folder = write(llava_input, str(tmp_path / "ds"))
    state, rest = saved_and_rest(folder)
    write(llava_input, folder, version=2)  # the same shards, indexed as version 2
    with caplog.at_level(logging.WARNING, logger="wdsvlm"):
        assert resumed(folder, state) == rest
    assert "resuming without checking them" in caplog.text
