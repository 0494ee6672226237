"""Index versions 2 and 3: a root index of one entry per shard (version 3: in a binary shard
table beside it), each shard's samples in a sidecar beside it; version 1 still read; `wdsvlm
index --upgrade` turns 1 or 2 into 3 without touching the tars, and the same Loader gives the
same batches from each."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

import wdsvlm
from wdsvlm.errors import ShardFormatError
from wdsvlm.format import sidecar
from wdsvlm.tools.samples import pick_entries

from .conftest import EXAMPLE, run_cli
from .test_ddp import digest

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"max_length": 512, "batch_size": 2, "tile_size": 64, "max_image_side": 128}


def sha(path: str) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def upgraded(tmp_path):
    """shards_example (version 1) copied, then upgraded with the CLI."""
    folder = str(tmp_path / "ds")
    shutil.copytree(EXAMPLE, folder, ignore=shutil.ignore_patterns("tokenizer"))
    tars = {n: sha(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".tar")}
    run = run_cli("index", folder, "--upgrade")
    assert run.returncode == 0, run.stderr
    assert "index version 1 -> 3" in run.stdout
    return folder, tars


def test_an_upgrade_writes_sidecars_and_a_small_root_and_leaves_the_tars(upgraded):
    folder, tars = upgraded
    assert {n: sha(os.path.join(folder, n)) for n in tars} == tars  # not rewritten
    root = json.load(open(os.path.join(folder, "index.json")))
    assert root["version"] == 3 and "shards" not in root
    assert root["table"]["sha256"] == sha(os.path.join(folder, root["table"]["name"]))
    old = wdsvlm.load_index(EXAMPLE)
    new = wdsvlm.load_index(folder)
    for a, b in zip(old["shards"], new["shards"], strict=True):
        assert list(a["entries"]) == list(b["entries"])  # the same entries, from the sidecar
        assert b["sums"]["chars"] == sum(sum(e["chars"]) for e in a["entries"])
    for a, b in zip(old["shards"], new["shards"], strict=True):  # the rest of each entry
        assert {k: v for k, v in b.items() if k not in ("entries", "sidecar", "sums", "keys")} == {
            k: v for k, v in a.items() if k in ("name", "samples", "bytes", "sha256")
        }
    assert wdsvlm.verify_dataset(folder)["version"] == 3
    again = run_cli("index", folder, "--upgrade")
    assert again.returncode == 0 and "version 3 already" in again.stdout


def test_the_same_loader_gives_the_same_batches_from_version_1_and_version_3(upgraded):
    folder, _ = upgraded
    old = wdsvlm.Loader(EXAMPLE, TOKENIZER, batches_per_epoch=6, **SMALL)
    new = wdsvlm.Loader(folder, TOKENIZER, batches_per_epoch=6, **SMALL)
    assert [digest(b) for b in old] == [digest(b) for b in new]
    # and a state saved on the one resumes on the other
    batches = iter(old)
    next(batches)
    state = old.state_dict()
    following = digest(next(batches))
    resumed = wdsvlm.Loader(folder, TOKENIZER, batches_per_epoch=6, **SMALL)
    resumed.load_state_dict(state)
    assert digest(next(iter(resumed))) == following


def test_a_key_is_found_reading_one_sidecar(upgraded):
    folder, _ = upgraded
    index = wdsvlm.load_index(folder)
    urls = [os.path.join(folder, s["name"]) for s in index["shards"]]
    last = index["shards"][-1]
    key = last["keys"][1]
    sidecar._cache.clear()
    ((url, name, entry),) = pick_entries(index, urls, 5, [key])
    assert (name, entry["key"]) == (last["name"], key)
    assert [url for url, _ in sidecar._cache] == [os.path.join(folder, last["sidecar"]["name"])]
    with pytest.raises(ValueError, match="no sample with key nope"):
        pick_entries(index, urls, 5, ["nope"])


def test_a_damaged_or_missing_sidecar_is_named(upgraded):
    folder, _ = upgraded
    index = wdsvlm.load_index(folder)
    first = os.path.join(folder, index["shards"][0]["sidecar"]["name"])
    with open(first, "wb") as f:
        f.write(b"not a sidecar")
    sidecar._cache.clear()
    with pytest.raises(ShardFormatError, match=r"-000000.idx: 13 bytes.*changed or truncated"):
        wdsvlm.verify_dataset(folder)
    with pytest.raises(ShardFormatError, match="-000000.idx: not a readable wdsvlm sidecar"):
        list(wdsvlm.load_index(folder)["shards"][0]["entries"])
    os.remove(first)
    with pytest.raises(ShardFormatError, match="-000000.idx: the shard's sidecar is missing"):
        list(wdsvlm.load_index(folder)["shards"][0]["entries"])


def test_sidecar_round_trip_keeps_every_field():
    entries = [
        {"key": "a", "offset": 0, "size": 1536, "images": [[3, 4], [5, 6]], "chars": [1, 2, 3]},
        {"key": "bé", "offset": 1536, "size": 512, "images": [], "chars": []},
        {"key": "c.d", "offset": 2048, "size": 1024, "images": [[7, 8]], "chars": [9]},
    ]
    got = sidecar.Entries(sidecar.pack_entries(entries), "mem")
    assert list(got) == entries and got[-1] == entries[-1]
    assert got.offset.dtype == np.int64 and len(got) == 3
    assert list(sidecar.Entries(sidecar.pack_entries([]), "empty")) == []


def test_a_missing_sidecar_is_skipped_with_its_samples_or_named(upgraded):
    folder, _ = upgraded
    index = wdsvlm.load_index(folder)
    gone = index["shards"][1]
    os.remove(os.path.join(folder, gone["sidecar"]["name"]))
    sidecar._cache.clear()
    loader = wdsvlm.Loader(folder, TOKENIZER, on_shard_error="skip", batches_per_epoch=40, **SMALL)
    keys = {k for batch in loader for row in batch["sample_keys"] for k in row}
    skipped = loader.stats()["skipped"].get("unreadable_sidecar", 0)
    assert skipped >= gone["samples"]  # the shard's samples, in every pass read (the last in part)
    assert not any(k.startswith(gone["name"]) for k in keys)
    assert len({k.split("/")[0] for k in keys}) == len(index["shards"]) - 1  # the others read
    with pytest.raises(ShardFormatError, match=r"-000001.idx: the shard's sidecar is missing"):
        next(iter(wdsvlm.Loader(folder, TOKENIZER, batches_per_epoch=4, **SMALL)))


def test_a_dataset_written_again_is_read_anew_in_the_same_process(tmp_path, llava_input):
    path, root, _ = llava_input
    out = str(tmp_path / "ds")
    wdsvlm.write_dataset(path, out, image_root=root, samples_per_shard=50, progress=False)
    assert len(list(wdsvlm.load_index(out)["shards"][0]["entries"])) == 12
    half = str(tmp_path / "half.jsonl")
    with open(half, "w") as f:
        f.writelines(open(path).readlines()[:3])
    wdsvlm.write_dataset(half, out, image_root=root, overwrite=True, progress=False)
    assert len(list(wdsvlm.load_index(out)["shards"][0]["entries"])) == 3  # not the cached 12
