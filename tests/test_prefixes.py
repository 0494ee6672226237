"""Shards spread over prefix folders (`wdsvlm write --prefixes N`): the rule, the layout on
disk and in a bucket, the Loader reading them as a dataset without prefixes, and `wdsvlm
index`, `--merge`, `verify` and `--upgrade` on such a dataset."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections import Counter

import pytest
from PIL import Image

import wdsvlm
from wdsvlm import BadInputError, ShardFormatError, load_index, verify_dataset, write_dataset
from wdsvlm.format.builder import upgrade_dataset
from wdsvlm.format.merge import merge_indexes
from wdsvlm.format.prefixes import MAX_PREFIXES, prefix_folder, prefix_folders
from wdsvlm.storage.fs import filesystem
from wdsvlm.write.tarindex import index_tars

from .conftest import EXAMPLE, run_cli, write_jsonl
from .test_ddp import digest

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"max_length": 1024, "batch_size": 2, "tile_size": 64, "max_image_side": 128, "seed": 5}
PER_SHARD = 2  # the 12 records of llava_input: 6 shards, so 4 prefix folders hold 2, 2, 1, 1


def names(index: dict) -> list[str]:
    shards = index["shards"]
    return [shards[i]["name"] for i in range(len(shards))]


def files_under(folder: str) -> dict[str, bytes]:
    """Every file under ``folder`` by its path there (``/``-separated)."""
    found = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            found[os.path.relpath(path, folder).replace(os.sep, "/")] = open(path, "rb").read()
    return found


def write(llava_input, folder: str, **options) -> str:
    path, root, _ = llava_input
    options = {"samples_per_shard": PER_SHARD, "progress": False, **options}
    write_dataset(path, folder, image_root=root, **options)
    return folder


def batches(source: str, **options) -> tuple[list[str], list[str]]:
    """An epoch's batches: the digest of each (but for its samples' names) and the names of
    the samples of the dataset's first pass in them (``SHARD/KEY``, the shard's prefix
    folder left out; an epoch's last batches may hold samples of the next pass)."""
    loader = wdsvlm.Loader(source, TOKENIZER, **SMALL, **options)
    digests, keys = [], []
    for batch in loader:
        for row, passes in zip(batch["sample_keys"], batch["sample_passes"], strict=True):
            keys += ["/".join(k.split("/")[-2:]) for k, p in zip(row, passes, strict=True) if not p]
        digests.append(digest({k: v for k, v in batch.items() if k != "sample_keys"}))
    return digests, keys


ALL_SAMPLES = sorted(f"data-{n // PER_SHARD:06d}.tar/{n:09d}" for n in range(12))


@pytest.mark.parametrize("prefixes", [1, 3, 4, 16, 17, 100, 256, 4096])
def test_any_n_consecutive_shards_use_every_prefix_folder_once(prefixes):
    folders = prefix_folders(prefixes)
    assert len(set(folders)) == prefixes and folders == sorted(folders)  # in key order
    assert len({len(f) for f in folders}) == 1  # one width: the names sort as their keys
    for start in (0, 1, 7, 12345):
        window = [prefix_folder(n, prefixes) for n in range(start, start + prefixes)]
        assert sorted(window) == folders
    # spread evenly over the hex key space: the first digit of the folders is as even as N allows
    firsts = Counter(f[0] for f in folders)
    assert max(firsts.values()) - min(firsts.values()) <= 1


def test_the_prefix_folder_of_a_shard_is_fixed_by_its_number_and_n():
    assert prefix_folders(4) == ["0", "4", "8", "c"]
    assert [prefix_folder(n, 4) for n in range(6)] == ["0", "4", "8", "c", "0", "4"]
    assert prefix_folder(123, 256) == "7b"
    assert prefix_folder(123, 100) == "3a"  # 23 * 256 // 100 = 58
    assert prefix_folder(4095, MAX_PREFIXES) == "fff"


def test_write_with_prefixes_lays_out_shards_and_sidecars_under_their_folders(
    llava_input, tmp_path
):
    folder = write(llava_input, str(tmp_path / "ds"), prefixes=4)
    index = load_index(folder)
    expected = [f"{prefix_folder(n, 4)}/data-{n:06d}.tar" for n in range(6)]
    assert names(index) == expected
    assert index["prefixes"] == 4
    on_disk = files_under(folder)
    tables = [n for n in on_disk if n.endswith(".shards")]
    assert sorted(on_disk) == sorted(
        ["index.json", *tables, *expected, *(n.replace(".tar", ".idx") for n in expected)]
    )
    assert sorted(os.listdir(folder)) == sorted(["0", "4", "8", "c", "index.json", *tables])
    assert verify_dataset(folder)["checked"] == 6
    # each shard is the one written without prefixes, byte for byte: only its place differs
    flat = files_under(write(llava_input, str(tmp_path / "flat")))
    for name in expected:
        assert on_disk[name] == flat[name.split("/")[1]], name


def test_the_loader_reads_every_sample_once_in_the_batches_of_the_same_dataset_unspread(
    llava_input, tmp_path
):
    spread = write(llava_input, str(tmp_path / "spread"), prefixes=4)
    flat = write(llava_input, str(tmp_path / "flat"))
    spread_digests, spread_keys = batches(spread)
    flat_digests, flat_keys = batches(flat)
    assert sorted(spread_keys) == ALL_SAMPLES  # each once
    assert spread_digests == flat_digests and spread_keys == flat_keys


def test_write_with_prefixes_to_s3_places_the_objects_under_their_prefixes(
    llava_input, tmp_path, s3_bucket
):
    from wdsvlm.tools.cli import main

    path, root, _ = llava_input
    bucket, options = s3_bucket
    url = f"{bucket}/datasets/llava"
    argv = ["write", "--input", path, "--image-root", root, "--output", url, "-q"]
    argv += ["--samples-per-shard", str(PER_SHARD), "--prefixes", "4"]
    assert main([*argv, "--storage-options", json.dumps(options)]) == 0
    fs, base = filesystem(url, options)
    fs.invalidate_cache()
    keys = {p[len(base) + 1 :] for p in fs.find(base)}
    local = files_under(write(llava_input, str(tmp_path / "local"), prefixes=4))
    assert keys == set(local)
    for name, data in local.items():
        assert fs.cat_file(f"{base}/{name}") == data, name
    assert verify_dataset(url, options)["checked"] == 6
    digests, keys = batches(url, storage_options=options)
    assert sorted(keys) == ALL_SAMPLES
    assert (digests, keys) == batches(str(tmp_path / "local"))


def test_a_rewrite_with_another_number_of_prefixes_leaves_no_stale_shard(llava_input, tmp_path):
    folder = write(llava_input, str(tmp_path / "ds"), prefixes=4)
    write(llava_input, folder, prefixes=2, samples_per_shard=4, overwrite=True)
    left = sorted(n for n in files_under(folder) if n.endswith((".tar", ".idx")))
    assert left == sorted(f"{d}/data-{n:06d}.{e}" for d, n in [("0", 0), ("8", 1), ("0", 2)]
                          for e in ("tar", "idx"))  # fmt: skip
    assert sorted(os.listdir(folder))[:2] == ["0", "8"]  # the emptied folders are gone
    write(llava_input, folder, overwrite=True)  # and back to every shard beside the index
    assert not [n for n in files_under(folder) if "/" in n]
    assert verify_dataset(folder)["checked"] == 6


def test_a_write_refused_for_bad_input_leaves_no_shard_and_no_prefix_folder(llava_input, tmp_path):
    path, root, records = llava_input
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), [*records, {**records[0], "image": "gone.jpg"}])
    out = str(tmp_path / "ds")
    with pytest.raises(BadInputError, match="gone.jpg not found"):
        write_dataset(bad, out, image_root=root, prefixes=4, samples_per_shard=PER_SHARD,
                      progress=False)  # fmt: skip
    assert os.listdir(out) == []


def test_wdsvlm_index_finds_the_tars_in_their_prefix_folders(llava_input, tmp_path):
    folder = write(llava_input, str(tmp_path / "ds"), prefixes=4)
    written = load_index(folder)
    out = str(tmp_path / "elsewhere")
    summary = index_tars(folder, output=out, format="wdsvlm", show_progress=False)
    assert summary.shards == 6 and summary.samples == 12
    index = load_index(out)
    assert names(index) == names(written)  # the writer's order, each at its path
    for i in range(6):
        assert index["shards"][i]["sha256"] == written["shards"][i]["sha256"]
    assert os.path.exists(os.path.join(out, "4", "data-000001.idx"))  # sidecars at their path
    assert verify_dataset(out)["checked"] == 6
    assert batches(out) == batches(folder)
    # and in place, replacing the writer's index
    summary = index_tars(folder, format="wdsvlm", overwrite=True, show_progress=False)
    assert names(load_index(folder)) == names(written) and verify_dataset(folder)["checked"] == 6


def test_merge_keeps_the_parts_prefix_folders(llava_input, tmp_path):
    out = str(tmp_path / "out")
    for part in ("part-0", "part-1"):
        write(llava_input, os.path.join(out, part), prefixes=4)
    merged = merge_indexes(out, ["part-0", "part-1"])
    expected = [
        f"part-{p}/{prefix_folder(n, 4)}/data-{n:06d}.tar" for p in (0, 1) for n in range(6)
    ]
    assert names(merged) == expected
    assert verify_dataset(out)["checked"] == 12
    assert Counter(batches(out)[1]) == Counter(ALL_SAMPLES * 2)


def test_verify_names_a_missing_or_damaged_shard_in_its_prefix_folder(llava_input, tmp_path):
    folder = write(llava_input, str(tmp_path / "ds"), prefixes=4)
    with open(os.path.join(folder, "8", "data-000002.tar"), "r+b") as f:
        f.write(b"x")
    run = run_cli("verify", folder)
    assert run.returncode == 1
    assert "8/data-000002.tar" in run.stderr and "changed or truncated" in run.stderr
    write(llava_input, folder, prefixes=4, overwrite=True)
    os.remove(os.path.join(folder, "4", "data-000001.tar"))
    with pytest.raises(ShardFormatError, match=r"4/data-000001\.tar: shard listed in the index"):
        verify_dataset(folder)
    write(llava_input, folder, prefixes=4, overwrite=True)
    os.remove(os.path.join(folder, "c", "data-000003.idx"))
    with pytest.raises(ShardFormatError, match=r"c/data-000003\.idx.* missing"):
        verify_dataset(folder, sample=6)


def test_upgrade_of_a_version_2_dataset_with_prefixes(llava_input, tmp_path):
    folder = write(llava_input, str(tmp_path / "ds"), prefixes=4, index_version=2)
    old = json.load(open(os.path.join(folder, "index.json")))
    assert [s["name"] for s in old["shards"]][:2] == ["0/data-000000.tar", "4/data-000001.tar"]
    assert old["shards"][1]["sidecar"]["name"] == "4/data-000001.idx"
    before = batches(folder)
    run = run_cli("index", folder, "--upgrade")
    assert run.returncode == 0, run.stderr
    index = load_index(folder)
    assert index["version"] == 3 and names(index) == [s["name"] for s in old["shards"]]
    assert verify_dataset(folder)["checked"] == 6
    assert batches(folder) == before
    assert upgrade_dataset(folder)[0] == 3  # nothing more to do


@pytest.mark.parametrize("value", ["0", "-3", "4097"])
def test_a_bad_number_of_prefixes_is_refused_with_the_range(llava_input, tmp_path, value):
    path, root, _ = llava_input
    out = str(tmp_path / "ds")
    run = run_cli(
        "write", "--input", path, "--image-root", root, "--output", out, "--prefixes", value
    )
    assert run.returncode == 2
    assert (
        f"prefixes must be from 1 to 4096 (the prefix folders shards are spread over), not {value}"
        in run.stderr
    )
    assert not os.path.exists(out)
    with pytest.raises(ValueError, match="prefixes must be a whole number"):
        write_dataset(path, out, prefixes=2.5)


def test_a_bad_sample_of_a_tar_in_a_prefix_folder_is_named_by_its_path(tmp_path):
    folder = tmp_path / "tars"
    (folder / "4").mkdir(parents=True)
    with tarfile.open(folder / "4" / "part-0.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        jpeg = io.BytesIO()
        Image.new("RGB", (8, 8)).save(jpeg, format="JPEG")
        members = {"good.jpg": jpeg.getvalue(), "good.txt": b"fine"}
        members.update({"bad.png": b"\x89PNG not really", "bad.txt": b"broken"})
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    summary = index_tars(str(folder), format="captions", skip_bad=True, show_progress=False)
    assert summary.skipped
    listed = [json.loads(line) for line in open(folder / "index-skipped.jsonl")]
    assert [(item["shard"], item["key"]) for item in listed] == [("4/part-0.tar", "bad")]
