"""The writer on documents and captions: OBELICS (JSON Lines, Parquet, URLs through an
img2dataset folder), MMC4 and LLaVA-Pretrain rows written as ``kind``/``elements`` records,
their index entries, bad rows refused or skipped, unavailable images dropped and counted."""

from __future__ import annotations

import io
import json
import os
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wdsvlm import load_index, write_dataset
from wdsvlm.format.documents import KINDS

from .conftest import make_image, write_jsonl


def samples_of(out: str) -> dict[str, dict[str, bytes]]:
    """Every sample of the dataset at ``out``: key -> {member suffix: bytes}, in key order."""
    samples: dict[str, dict[str, bytes]] = {}
    for shard in load_index(out)["shards"]:
        with tarfile.open(os.path.join(out, shard["name"])) as tar:
            for member in tar:
                key, suffix = member.name.split(".", 1)
                samples.setdefault(key, {})[suffix] = tar.extractfile(member).read()
    return dict(sorted(samples.items()))


def entries_of(out: str) -> list[dict]:
    return [e for shard in load_index(out)["shards"] for e in shard["entries"]]


@pytest.fixture
def pictures(tmp_path):
    """Three images of distinct sizes and formats under ``tmp_path/img``."""
    root = tmp_path / "img"
    root.mkdir()
    make_image(str(root / "a.jpg"), (40, 30), "JPEG")
    make_image(str(root / "b.png"), (20, 50), "PNG", seed=1)
    make_image(str(root / "c.webp"), (33, 17), "WEBP", seed=2)
    sizes = {"a.jpg": [40, 30], "b.png": [20, 50], "c.webp": [33, 17]}
    return str(root), sizes


def obelics_rows() -> list[dict]:
    return [
        {
            "texts": ["A title", None, "A paragraph.", None, "The end."],
            "images": [None, "b.png", None, "a.jpg", None],
            "metadata": json.dumps([None, {"alt": "b"}, None, {"alt": "a"}, None]),
            "general_metadata": json.dumps({"url": "https://example.com/doc"}),
        },
        {
            "texts": [None, "Caption-like text under a picture."],
            "images": ["c.webp", None],
            "metadata": "[]",
            "general_metadata": "{}",
        },
        {"texts": ["Text only."], "images": [None], "metadata": "[]", "general_metadata": "{}"},
    ]


OBELICS_ELEMENTS = [
    [
        {"text": "A title"},
        {"image": 0},
        {"text": "A paragraph."},
        {"image": 1},
        {"text": "The end."},
    ],
    [{"image": 0}, {"text": "Caption-like text under a picture."}],
    [{"text": "Text only."}],
]
OBELICS_IMAGES = [["b.png", "a.jpg"], ["c.webp"], []]


def check_written(out: str, elements: list, images: list, sizes: dict, kind: str) -> None:
    """The tar's records and the index entries are those of ``elements`` and ``images``."""
    samples, entries = samples_of(out), entries_of(out)
    assert len(samples) == len(entries) == len(elements)
    for (key, members), entry, want, names in zip(
        samples.items(), entries, elements, images, strict=True
    ):
        record = json.loads(members.pop("json"))
        assert record["kind"] == kind and record["elements"] == want
        # images numbered in element order, each stored with its own format
        exts = [os.path.splitext(n)[1].lstrip(".") for n in names]
        assert sorted(members) == sorted(f"{n}.{ext}" for n, ext in enumerate(exts))
        assert entry["key"] == key and entry["kind"] == KINDS.index(kind)
        assert entry["elements"] == [len(e["text"]) if "text" in e else -1 for e in want]
        assert entry["chars"] == [len(e["text"]) for e in want if "text" in e]
        assert entry["images"] == [sizes[n] for n in names]


def test_obelics_jsonl_is_written_as_documents_with_images_in_element_order(pictures, tmp_path):
    root, sizes = pictures
    path = write_jsonl(str(tmp_path / "obelics.jsonl"), obelics_rows())
    out = str(tmp_path / "ds")
    summary = write_dataset(path, out, image_root=root, progress=False)
    assert summary.formats == {path: "obelics"}  # told by its fields
    assert (summary.samples, summary.documents, summary.images) == (3, 3, 3)
    check_written(out, OBELICS_ELEMENTS, OBELICS_IMAGES, sizes, "document")
    first = json.loads(next(iter(samples_of(out).values()))["json"])
    assert first["metadata"] == obelics_rows()[0]["metadata"]  # kept as they were
    assert first["general_metadata"] == obelics_rows()[0]["general_metadata"]
    totals = load_index(out)["totals"]
    assert (totals["documents"], totals["images"], totals["text_only"]) == (3, 3, 1)
    assert "3 documents" in str(summary)


def obelics_table(rows: list[dict], root: str) -> pa.Table:
    """OBELICS rows with each image embedded as ``datasets`` stores an ``Image``."""

    def embed(name):
        if name is None:
            return None
        with open(os.path.join(root, name), "rb") as f:
            return {"bytes": f.read(), "path": name}

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    return pa.table(
        {
            "images": pa.array([[embed(n) for n in r["images"]] for r in rows], pa.list_(image)),
            "metadata": [r["metadata"] for r in rows],
            "general_metadata": [r["general_metadata"] for r in rows],
            "texts": pa.array([r["texts"] for r in rows], pa.list_(pa.string())),
        }
    )


def test_obelics_parquet_with_embedded_images_is_written_byte_for_byte(pictures, tmp_path):
    root, sizes = pictures
    path = str(tmp_path / "train-00000-of-00001.parquet")
    pq.write_table(obelics_table(obelics_rows(), root), path, row_group_size=2)
    out = str(tmp_path / "ds")
    summary = write_dataset(path, out, progress=False)  # no image root: the bytes are there
    assert summary.formats == {path: "obelics"} and summary.documents == 3
    check_written(out, OBELICS_ELEMENTS, OBELICS_IMAGES, sizes, "document")
    samples = list(samples_of(out).values())
    for members, names in zip(samples, OBELICS_IMAGES, strict=True):
        for n, name in enumerate(names):
            ext = os.path.splitext(name)[1].lstrip(".")
            with open(os.path.join(root, name), "rb") as f:
                assert members[f"{n}.{ext}"] == f.read()


def img2dataset_folder(folder, root: str, urls: dict[str, str], style: str) -> None:
    """A folder as img2dataset writes it: shard 00000's table of every URL tried (url, key,
    status, error_message) and its images as ``style`` (files, webdataset, parquet) keeps
    them; ``urls`` maps a downloaded URL to its image under ``root``. One URL failed."""
    os.makedirs(folder)
    rows, stored = [], {}
    for n, (url, name) in enumerate(urls.items()):
        key = f"{n:09d}"
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        ext = os.path.splitext(name)[1].lstrip(".")
        stored[f"{key}.{ext}"] = data
        rows.append({"url": url, "key": key, "status": "success", "error_message": None})
        rows[-1]["jpg"] = data
        stored[f"{key}.json"] = json.dumps({"url": url, "key": key}).encode()
    failed = {"url": "https://img.example/failed.jpg", "key": f"{len(rows):09d}"}
    rows.append(
        {**failed, "status": "failed_to_download", "error_message": "HTTP 404", "jpg": None}
    )
    table = {k: [r[k] for r in rows] for k in ("url", "key", "status", "error_message")}
    if style == "parquet":
        table["jpg"] = [r["jpg"] for r in rows]
    pq.write_table(pa.table(table), os.path.join(folder, "00000.parquet"))
    if style == "files":
        os.makedirs(os.path.join(folder, "00000"))
        for name, data in stored.items():
            with open(os.path.join(folder, "00000", name), "wb") as f:
                f.write(data)
    elif style == "webdataset":
        with tarfile.open(os.path.join(folder, "00000.tar"), "w") as tar:
            for name, data in stored.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("style", ["files", "webdataset", "parquet"])
def test_obelics_urls_are_found_in_an_img2dataset_folder(pictures, tmp_path, style):
    root, sizes = pictures
    urls = {f"https://img.example/{n}": n for n in ("a.jpg", "b.png", "c.webp")}
    folder = str(tmp_path / "downloaded")
    img2dataset_folder(folder, root, urls, style)
    rows = obelics_rows()
    for row in rows:
        row["images"] = [None if n is None else f"https://img.example/{n}" for n in row["images"]]
    # one image img2dataset failed on, one it never tried: dropped, the documents kept
    rows[2]["texts"] += [None, None]
    rows[2]["images"] += ["https://img.example/failed.jpg", "https://elsewhere.example/x.jpg"]
    path = str(tmp_path / "obelics.parquet")  # as OBELICS publishes it: images as URLs
    columns = ("images", "metadata", "general_metadata", "texts")
    pq.write_table(pa.table({c: [r[c] for r in rows] for c in columns}), path)
    out = str(tmp_path / "ds")
    summary = write_dataset(path, out, image_folder=folder, progress=False)
    check_written(out, OBELICS_ELEMENTS, OBELICS_IMAGES, sizes, "document")
    assert summary.dropped_images == {"download_failed": 1, "not_downloaded": 1}
    assert load_index(out)["totals"]["dropped_images"] == summary.dropped_images
    assert "dropped 2 images (download_failed: 1, not_downloaded: 1)" in str(summary)
