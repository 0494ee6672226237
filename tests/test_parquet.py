"""Parquet input as the Hugging Face Hub publishes VLM data: images embedded as ``{bytes,
path}`` structs, conversations in Cauldron's ``texts``, LLaVA's ``conversations`` or
``messages``. Built here with pyarrow in the Cauldron and LLaVA-OneVision layouts."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import wdsvlm
from wdsvlm.errors import BadInputError
from wdsvlm.write.inputs import iter_records

from .conftest import EXAMPLE, make_image, run_cli

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def picture(size, fmt="JPEG", seed=0) -> bytes:
    out = io.BytesIO()
    img = Image.new("RGB", size, (20 + 30 * seed % 200, 100, 180))
    img.paste((250, 220, 0), (size[0] // 4, size[1] // 4, size[0] // 2, size[1] // 2))
    img.save(out, format=fmt)
    return out.getvalue()


def cauldron_table(bad_row: int | None = None) -> tuple[pa.Table, list[list[bytes]]]:
    """Rows of The Cauldron's layout: one to three images, a text-only row, two turns in some;
    ``bad_row``'s first image is not an image."""
    images, texts, embedded = [], [], []
    for i in range(7):
        n = (0, 1, 2, 3, 1, 2, 1)[i]
        row = [
            picture((40 + 10 * i + 3 * k, 30 + 5 * k), ("JPEG", "PNG")[k % 2], i) for k in range(n)
        ]
        if i == bad_row:
            row[0] = b"these bytes are not an image"
        embedded.append(row)
        images.append([{"bytes": b, "path": f"img{i}_{k}.x"} for k, b in enumerate(row)])
        turns = [{"user": f"Question {i}?", "assistant": f"Answer {i}.", "source": "vqa"}]
        if i % 3 == 1:
            turns.append({"user": "And then?", "assistant": "Then more.", "source": "vqa"})
        texts.append(turns)
    turn = pa.struct([("user", pa.string()), ("assistant", pa.string()), ("source", pa.string())])
    table = pa.table(
        {"images": pa.array(images, pa.list_(IMAGE)), "texts": pa.array(texts, pa.list_(turn))}
    )
    return table, embedded


def shard_images(folder: str) -> dict[str, bytes]:
    """Every image member of every shard, by key and member name."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".tar"):
            with tarfile.open(os.path.join(folder, name)) as tar:
                for info in tar:
                    if not info.name.endswith(".json"):
                        out[info.name] = tar.extractfile(info).read()
    return out


def test_cauldron_parquet_images_are_written_byte_for_byte(tmp_path):
    table, embedded = cauldron_table()
    path = str(tmp_path / "train-00000-of-00001.parquet")
    pq.write_table(table, path, row_group_size=2)  # four row groups, streamed one by one
    out = str(tmp_path / "ds")
    result = run_cli("write", "--input", str(tmp_path / "train-*.parquet"), "--output", out, "-q")
    assert result.returncode == 0, result.stderr
    assert (
        "wrote 7 samples (10 images)" in result.stdout and "input format cauldron" in result.stdout
    )
    stored = shard_images(out)
    want = {
        f"{n:09d}.{k}.{('jpg', 'png')[k % 2]}": data
        for n, row in enumerate(embedded)
        for k, data in enumerate(row)
    }
    assert stored == want  # byte-identical to the embedded bytes, never re-encoded
    index = wdsvlm.format.index.load_index(out)
    entries = [e for s in index["shards"] for e in s["entries"]]
    assert [len(e["images"]) for e in entries] == [0, 1, 2, 3, 1, 2, 1]
    assert entries[1]["chars"] == [len("<image>\nQuestion 1?"), 9, 9, 10]
    # a file named by its split takes its folder's name as the source where none is given
    folder = tmp_path / "chartqa"
    folder.mkdir()
    pq.write_table(
        table.drop_columns(["texts"]).append_column(
            "messages",
            pa.array(
                [
                    [
                        {"role": "user", "content": "<image>" * len(r) + "Hi?"},
                        {"role": "assistant", "content": "Hello."},
                    ]
                    for r in embedded
                ]
            ),
        ),
        str(folder / "train-00000-of-00001.parquet"),
    )
    records = list(iter_records(str(folder / "train-00000-of-00001.parquet")))
    assert {r["source"] for r in records} == {"chartqa"}
    assert [len(r["images"]) for r in records] == [0, 1, 2, 3, 1, 2, 1]
    loader = wdsvlm.Loader(out, TOKENIZER, max_length=512, batch_size=2, tile_size=64)
    assert sum(len(row) for b in loader for row in b["sample_keys"]) > 0


def test_a_row_whose_image_is_not_an_image_is_named_or_skipped_and_listed(tmp_path):
    table, _ = cauldron_table(bad_row=4)
    path = str(tmp_path / "part.parquet")
    pq.write_table(table, path, row_group_size=3)
    with pytest.raises(
        BadInputError,
        match=r"(?s)1 of 7 input.*/part.parquet row 4: image /\S+/part.parquet row group 1 "
        r"row 1 images\[0\] is not a decodable image",
    ):
        wdsvlm.write_dataset(path, str(tmp_path / "a"), progress=False)
    assert not os.path.exists(tmp_path / "a" / "index.json")
    summary = wdsvlm.write_dataset(path, str(tmp_path / "b"), skip_bad=True, progress=False)
    assert summary.samples == 6 and summary.skipped == {"unreadable_image": 1}
    listed = [json.loads(line) for line in open(tmp_path / "b" / "skipped.jsonl")]
    assert [b["where"] for b in listed] == [f"{path} row 4"]  # the whole path: the Hub
    # reuses file names across configs


@pytest.mark.processes
def test_llava_onevision_parquet_with_a_path_only_image_and_the_same_output_for_any_workers(
    tmp_path,
):
    """LLaVA-OneVision's layout: one ``image`` struct per row, ``conversations``; a struct with
    no bytes resolves its path against --image-root."""
    root = tmp_path / "root"
    root.mkdir()
    on_disk = make_image(str(root / "disk.png"), (70, 50), "PNG", 3)
    rows = []
    for i in range(6):
        data = None if i == 2 else picture((50 + 4 * i, 40), "JPEG", i)
        value = "<image>\nWhat is this?" if i != 5 else "No picture here."
        rows.append(
            {
                "id": f"ov-{i}" if i != 1 else None,  # a null id: made from file and row
                "image": None if i == 5 else {"bytes": data, "path": "disk.png"},
                "conversations": [
                    {"from": "human", "value": value},
                    {"from": "gpt", "value": f"Thing {i}."},
                ],
                "data_source": "ov",
            }
        )
    turn = pa.struct([("from", pa.string()), ("value", pa.string())])
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("image", IMAGE),
            ("conversations", pa.list_(turn)),
            ("data_source", pa.string()),
        ]
    )
    path = str(tmp_path / "ov.parquet")
    pq.write_table(pa.Table.from_pylist(rows, schema), path, row_group_size=4)
    formats = {}
    records = list(iter_records(path, image_root=str(root), found=formats))
    assert formats == {path: "llava"}
    assert [r["id"] for r in records[:2]] == ["ov-0", "ov.parquet:1"]
    assert {r["source"] for r in records} == {"ov"}  # LLaVA-OneVision's data_source
    assert str(records[2]["images"][0]) == str(root / "disk.png") and "data" in records[0]

    outs = []
    for workers in (1, 2):
        out = str(tmp_path / f"w{workers}")
        wdsvlm.write_dataset(
            path, out, image_root=str(root), workers=workers, samples_per_shard=4, progress=False
        )
        outs.append(
            {
                n: hashlib.sha256(open(os.path.join(out, n), "rb").read()).hexdigest()
                for n in sorted(os.listdir(out))
            }
        )
    assert outs[0] == outs[1]  # deterministic: the same bytes for any worker count
    stored = shard_images(str(tmp_path / "w1"))
    assert stored["000000002.0.png"] == open(on_disk, "rb").read()
    assert stored["000000000.0.jpg"] == rows[0]["image"]["bytes"]
    assert len(stored) == 5  # row 5 is text-only
