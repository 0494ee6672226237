"""The writer: round trip, index, determinism, sharding, bad input, atomicity, buckets."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tarfile

import pytest
import webdataset as wds

from wdsvlm import BadInputError, DatasetExistsError, load_index, verify_dataset, write_dataset
from wdsvlm.format.sidecar import Entries
from wdsvlm.storage.fs import filesystem
from wdsvlm.write import engines, shards
from wdsvlm.write import writer as write_module

from .conftest import decode, make_image, read_image_bytes, write_jsonl


def files_of(folder: str) -> dict[str, bytes]:
    return {
        name: read_image_bytes(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
    }


def stream(folder: str) -> dict[str, dict]:
    index = load_index(folder)
    urls = [os.path.join(folder, s["name"]) for s in index["shards"]]
    return {s["__key__"]: s for s in wds.WebDataset(urls, shardshuffle=False)}


def expected_messages(record: dict) -> list[dict]:
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    return [{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]]


def test_round_trip_with_plain_webdataset(llava_input, tmp_path):
    path, root, records = llava_input
    out = str(tmp_path / "ds")
    summary = write_dataset(path, out, image_root=root, samples_per_shard=5, progress=False)
    assert (summary.samples, summary.shards) == (12, 3)
    samples = stream(out)
    assert len(samples) == len(records)
    # keys follow input order, so the n-th sample is the n-th record
    for key, record in zip(sorted(samples), records, strict=True):
        sample = samples[key]
        doc = json.loads(sample["json"])
        assert doc["id"] == record["id"]
        images = record.get("image", [])
        images = [images] if isinstance(images, str) else images
        members = sorted(k for k in sample if k[0].isdigit())
        assert [m.split(".")[0] for m in members] == [str(i) for i in range(len(images))]
        for member, name in zip(members, images, strict=True):
            original = read_image_bytes(os.path.join(root, name))
            if name.endswith(".gif"):
                assert member.endswith(".png")
                assert decode(sample[member]).convert("RGB").tobytes() == (
                    decode(original).convert("RGB").tobytes()
                )
            else:
                assert sample[member] == original, f"{key}/{member} is not the original bytes"
                assert member.endswith(os.path.splitext(name)[1])
        if (
            record["id"] == "r7"
        ):  # no marker in the source: placed at the start of the first user turn
            assert doc["messages"][0]["content"] == "<image>\nCaption this."
            assert doc["messages"][1:] == expected_messages(record)[1:]
        else:
            assert doc["messages"] == expected_messages(record)
    sources = {json.loads(s["json"])["source"] for s in samples.values()}
    assert sources == {"llava", "custom_source"}


def test_cauldron_records_become_messages_with_image_markers(cauldron_input, tmp_path):
    path, root, _ = cauldron_input
    out = str(tmp_path / "ds")
    write_dataset(path, out, image_root=root, progress=False)
    docs = [json.loads(s["json"]) for _, s in sorted(stream(out).items())]
    assert docs[0]["messages"] == [
        {"role": "user", "content": "<image><image>\nHow many?"},
        {"role": "assistant", "content": "Two."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
    ]
    assert docs[0]["source"] == "vqa_set"
    assert docs[1]["messages"][0] == {"role": "user", "content": "No image here."}
    assert docs[2]["messages"][0] == {"role": "system", "content": "S"}
    assert docs[2]["messages"][1]["content"] == "<image>\nQ"
    assert docs[2]["source"] == "cauldron"


def test_index_offsets_seek_straight_to_each_sample(llava_input, tmp_path):
    path, root, _ = llava_input
    out = str(tmp_path / "ds")
    write_dataset(path, out, image_root=root, samples_per_shard=4, progress=False)
    streamed = stream(out)
    index = load_index(out)
    for shard in index["shards"]:
        with open(os.path.join(out, shard["name"]), "rb") as f:
            for entry in shard["entries"]:
                f.seek(entry["offset"])
                chunk = f.read(entry["size"])
                with tarfile.open(fileobj=io.BytesIO(chunk)) as tar:
                    members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
                assert members, entry
                for name, data in members.items():
                    key, suffix = name.split(".", 1)
                    assert key == entry["key"]
                    assert streamed[key][suffix] == data


def test_index_describes_shards_images_and_texts(llava_input, tmp_path):
    path, root, records = llava_input
    out = str(tmp_path / "ds")
    write_dataset(path, out, image_root=root, samples_per_shard=5, progress=False)
    index = load_index(out)
    assert (index["format"], index["version"]) == ("wdsvlm", 3)
    assert [s["name"] for s in index["shards"]] == [f"data-{i:06d}.tar" for i in range(3)]
    for shard in index["shards"]:
        data = read_image_bytes(os.path.join(out, shard["name"]))
        assert shard["bytes"] == len(data)
        assert shard["sha256"] == hashlib.sha256(data).hexdigest()
        # version 2: the samples' entries in a sidecar beside the shard, sums in the root
        sidecar = read_image_bytes(os.path.join(out, shard["sidecar"]["name"]))
        assert shard["sidecar"]["name"] == shard["name"].replace(".tar", ".idx")
        assert shard["sidecar"]["sha256"] == hashlib.sha256(sidecar).hexdigest()
        listed = list(shard["entries"])
        assert shard["sums"]["images"] == sum(len(e["images"]) for e in listed)
        assert shard["sums"]["chars"] == sum(sum(e["chars"]) for e in listed)
        assert shard["keys"] == [listed[0]["key"], listed[-1]["key"]]
    root = json.load(open(os.path.join(out, "index.json")))
    assert "shards" not in root and root["table"]["rows"] == len(index["shards"])  # a row a shard
    assert re.fullmatch(r"index-[0-9a-f]{16}\.shards", root["table"]["name"])  # by its digest
    entries = [e for s in index["shards"] for e in s["entries"]]
    assert [e["chars"] for e in entries] == [
        [len(m["content"]) for m in json.loads(s["json"])["messages"]]
        for _, s in sorted(stream(out).items())
    ]
    by_id = dict(zip((r["id"] for r in records), entries, strict=True))
    assert by_id["r0"]["images"] == [[320, 200]]
    assert by_id["r3"]["images"] == [[320, 200], [500, 375]]
    assert by_id["r2"]["images"] == []
    assert by_id["r6"]["images"] == [[100, 300]]  # EXIF orientation 6: displayed upright
    totals = index["totals"]
    assert totals["samples"] == 12 and totals["images"] == 10 and totals["text_only"] == 3
    assert totals["multi_image"] == 1 and totals["shards"] == 3
    assert totals["bytes"] == sum(s["bytes"] for s in index["shards"])
    verify_dataset(out)


def test_same_input_gives_byte_identical_dataset(llava_input, tmp_path):
    path, root, _ = llava_input
    write_dataset(path, str(tmp_path / "one"), image_root=root, samples_per_shard=3, progress=False)
    write_dataset(path, str(tmp_path / "two"), image_root=root, samples_per_shard=3, progress=False)
    assert files_of(str(tmp_path / "one")) == files_of(str(tmp_path / "two"))


@pytest.mark.processes
def test_workers_1_and_3_write_identical_datasets(llava_input, tmp_path):
    path, root, _ = llava_input
    one, three = str(tmp_path / "w1"), str(tmp_path / "w3")
    write_dataset(path, one, image_root=root, samples_per_shard=2, workers=1, progress=False)
    write_dataset(path, three, image_root=root, samples_per_shard=2, workers=3, progress=False)
    assert len(os.listdir(three)) == 14  # 6 shards, their 6 sidecars, the table and the index
    assert files_of(one) == files_of(three)


def test_shards_close_at_the_byte_limit(llava_input, tmp_path):
    path, root, _ = llava_input
    out = str(tmp_path / "ds")
    limit = 20_000
    write_dataset(path, out, image_root=root, max_shard_bytes=limit, progress=False)
    shards = load_index(out)["shards"]
    assert len(shards) > 2
    for shard in shards:
        # only a shard of one sample that is larger than the limit by itself may exceed it
        assert shard["bytes"] <= limit or shard["samples"] == 1, shard["name"]
    assert sum(s["samples"] for s in shards) == 12


@pytest.mark.parametrize(
    "bad, reason, words",
    [
        ({"image": "nope.jpg"}, "missing_image", ["nope.jpg", "not found"]),
        ({"image": "broken.jpg"}, "unreadable_image", ["broken.jpg", "not a decodable image"]),
        (
            {"image": "truncated.jpg"},
            "unreadable_image",
            ["truncated.jpg", "not a decodable image"],
        ),
        ({"image": ["a.jpg", "a.jpg"]}, "image_count_mismatch", ["1 <image>", "2 image"]),
        ({"answer": None}, "no_assistant_answer", ["no assistant answer"]),
        ({"answer": "   "}, "no_assistant_answer", ["assistant turn 2 is empty"]),
        ({"raw": '{"id": "x", "conversations": [}'}, "invalid_json", ["invalid JSON"]),
    ],
)
def test_bad_input_stops_the_run_or_is_skipped_and_listed(tmp_path, bad, reason, words):
    root = tmp_path / "img"
    root.mkdir()
    make_image(str(root / "a.jpg"), (100, 80), "JPEG")
    (root / "broken.jpg").write_bytes(b"this is not a jpeg at all")
    good = read_image_bytes(str(root / "a.jpg"))
    (root / "truncated.jpg").write_bytes(good[: len(good) // 2])

    def record(i, image="a.jpg", answer="An answer."):
        convo = [{"from": "human", "value": "<image>\nQ?"}]
        if answer is not None:
            convo.append({"from": "gpt", "value": answer})
        return {"id": f"id{i}", "image": image, "conversations": convo}

    raw = bad.get("raw")
    bad_record = raw or record(3, **{k: v for k, v in bad.items() if k in ("image", "answer")})
    path = write_jsonl(str(tmp_path / "in.jsonl"), [record(1), record(2), bad_record, record(4)])
    out = str(tmp_path / "out")

    with pytest.raises(BadInputError) as err:
        write_dataset(path, out, image_root=str(root), progress=False)
    message = str(err.value)
    assert "in.jsonl line 3" in message
    if raw is None:
        assert "id3" in message
    for word in words:
        assert word in message
    assert not os.path.exists(out) or os.listdir(out) == []  # nothing written

    summary = write_dataset(path, out, image_root=str(root), skip_bad=True, progress=False)
    assert summary.samples == 3 and summary.skipped == {reason: 1}
    assert load_index(out)["totals"]["skipped"] == {reason: 1}
    with open(os.path.join(out, "skipped.jsonl")) as f:
        listed = [json.loads(line) for line in f]
    assert len(listed) == 1 and listed[0]["reason"] == reason
    assert "in.jsonl line 3" in listed[0]["where"]
    assert sorted(json.loads(s["json"])["id"] for s in stream(out).values()) == [
        "id1",
        "id2",
        "id4",
    ]


def test_a_failure_mid_write_leaves_no_index_and_no_partial_shard(
    llava_input, tmp_path, monkeypatch
):
    path, root, _ = llava_input
    out = str(tmp_path / "ds")
    real = shards.stored_bytes
    calls = []

    def failing(data, info):
        calls.append(1)
        if len(calls) == 6:
            raise OSError("disk full (simulated)")
        return real(data, info)

    monkeypatch.setattr(shards, "stored_bytes", failing)
    with pytest.raises(OSError, match="disk full"):
        write_dataset(path, out, image_root=root, samples_per_shard=3, progress=False)
    names = os.listdir(out)
    assert "index.json" not in names
    assert not [n for n in names if n.endswith(".tmp")], names  # staging files cleaned up
    for name in names:  # whatever shard is visible is complete: it reads to the end
        if name.endswith(".idx"):  # and so is a sidecar
            assert len(Entries(open(os.path.join(out, name), "rb").read(), name)) == 3
            continue
        with tarfile.open(os.path.join(out, name)) as tar:
            assert len(tar.getmembers()) > 0


def test_existing_dataset_is_kept_unless_overwrite(llava_input, cauldron_input, tmp_path):
    path, root, _ = llava_input
    out = str(tmp_path / "ds")
    write_dataset(path, out, image_root=root, samples_per_shard=2, progress=False)
    before = files_of(out)
    cpath, croot, _ = cauldron_input
    with pytest.raises(DatasetExistsError, match="overwrite"):
        write_dataset(cpath, out, image_root=croot, progress=False)
    assert files_of(out) == before
    with pytest.raises(BadInputError):  # bad new input: the old dataset stays whole
        write_dataset(cpath, out, image_root=str(tmp_path), overwrite=True, progress=False)
    assert files_of(out) == before
    write_dataset(cpath, out, image_root=croot, overwrite=True, progress=False)
    # stale shards and their sidecars removed
    assert sorted(os.listdir(out)) == sorted(
        [
            "data-000000.idx",
            "data-000000.tar",
            "index.json",
            json.load(open(os.path.join(out, "index.json")))["table"]["name"],
        ]
    )
    assert len(stream(out)) == 3


def test_nothing_to_write_is_an_error_not_an_empty_dataset(tmp_path):
    empty = write_jsonl(str(tmp_path / "empty.jsonl"), [])
    with pytest.raises(ValueError, match="no records in .*empty.jsonl"):
        write_dataset(empty, str(tmp_path / "ds"), progress=False)
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), ["{nope"])
    with pytest.raises(BadInputError, match="1 of 1 input records are bad"):
        write_dataset(bad, str(tmp_path / "ds"), skip_bad=True, progress=False)
    assert not os.path.exists(tmp_path / "ds" / "index.json")


def test_write_to_memory_url_matches_local(llava_input, tmp_path):
    path, root, _ = llava_input
    local = str(tmp_path / "local")
    write_dataset(path, local, image_root=root, samples_per_shard=4, progress=False)
    write_dataset(
        path, "memory://wdsvlm-test/ds", image_root=root, samples_per_shard=4, progress=False
    )
    fs, _ = filesystem("memory://")
    for name, data in files_of(local).items():
        assert fs.cat_file(f"/wdsvlm-test/ds/{name}") == data, name


def test_write_to_s3_on_a_moto_server_matches_local(llava_input, tmp_path, s3_bucket):
    from wdsvlm.tools.cli import main

    path, root, _ = llava_input
    bucket, options = s3_bucket
    local = str(tmp_path / "local")
    write_dataset(path, local, image_root=root, samples_per_shard=4, progress=False)
    url = f"{bucket}/datasets/llava"
    argv = ["write", "--input", path, "--image-root", root, "--output", url, "-q"]
    argv += ["--samples-per-shard", "4", "--storage-options", json.dumps(options)]
    assert main(argv) == 0
    fs, _ = filesystem(url, options)
    fs.invalidate_cache()
    remote = sorted(os.path.basename(p) for p in fs.ls(url, detail=False))
    assert remote == sorted(files_of(local))
    for name, data in files_of(local).items():
        assert fs.cat_file(f"{url}/{name}") == data, name
    assert verify_dataset(url, options)["totals"]["samples"] == 12


@pytest.mark.processes
def test_the_writer_side_imports_no_torch():
    import sys

    from .conftest import run_process

    code = (
        "import sys, wdsvlm, wdsvlm.write.writer, wdsvlm.tools.cli; "
        "assert 'torch' not in sys.modules"
    )
    run = run_process([sys.executable, "-c", code], timeout=60)
    assert run.returncode == 0, run.stderr


def test_shards_are_written_as_the_records_come_not_after_all_are_read(
    llava_input, tmp_path, monkeypatch
):
    path, root, _ = llava_input
    checked, seen_at_write = [], []
    real_check, real_write = engines.check_record, write_module.write_shard

    def counting_check(record, **kw):
        checked.append(1)
        return real_check(record, **kw)

    def noting_write(plan, **kw):
        seen_at_write.append(len(checked))
        return real_write(plan, **kw)

    monkeypatch.setattr(engines, "check_record", counting_check)
    monkeypatch.setattr(write_module, "write_shard", noting_write)
    out = str(tmp_path / "ds")
    write_dataset(path, out, image_root=root, samples_per_shard=2, progress=False)
    # shard k is written once record 2k + 3 is checked (the one that closes it), never later:
    # memory holds the open shard, not the dataset
    assert seen_at_write == [min(2 * k + 3, len(checked)) for k in range(len(seen_at_write))]
    assert load_index(out)["totals"]["samples"] == len(checked) == 12
