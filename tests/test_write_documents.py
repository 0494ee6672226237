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

from wdsvlm import BadInputError, load_index, write_dataset
from wdsvlm.format.documents import KINDS
from wdsvlm.tools.cli import main
from wdsvlm.write.parquet import open_parquet, parquet_format

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


def test_parquet_format_tells_obelics_texts_from_cauldron_turns(pictures, tmp_path):
    root, _ = pictures
    path = str(tmp_path / "obelics.parquet")
    pq.write_table(obelics_table(obelics_rows(), root), path)
    with open_parquet(path) as parquet:
        assert parquet_format(parquet, path) == "obelics"


def mmc4_row() -> dict:
    """MMC4's layout: the images matched to sentences 2, 0, 2 (under 0.24) and 3 (a file that
    is not there)."""
    return {
        "url": "http://example.com/page",
        "text_list": ["S0.", "S1.", "S2.", "S3."],
        "image_info": [
            {"image_name": "a.jpg", "matched_text_index": 2, "matched_sim": 0.31, "raw_url": "u/a"},
            {"image_name": "b.png", "matched_text_index": 0, "matched_sim": 0.25, "raw_url": "u/b"},
            {"image_name": "c.webp", "matched_text_index": 2, "matched_sim": 0.1, "raw_url": "u/c"},
            {"image_name": "gone.jpg", "matched_text_index": 3, "matched_sim": 0.5},
        ],
        "similarity_matrix": [[0.0] * 4] * 4,
        "could_have_url_duplicate": 0,
    }


@pytest.mark.parametrize(
    "min_sim, elements, images, dropped",
    [
        (
            None,  # the default, OpenFlamingo's 0.24: c.webp left out
            [{"image": 0}, {"text": "S0. S1."}, {"image": 1}, {"text": "S2. S3."}],
            ["b.png", "a.jpg"],
            {"below_min_sim": 1, "missing_image": 1},
        ),
        (
            0.0,
            [{"image": 0}, {"text": "S0. S1."}, {"image": 1}, {"image": 2}, {"text": "S2. S3."}],
            ["b.png", "a.jpg", "c.webp"],
            {"missing_image": 1},
        ),
    ],
)
def test_mmc4_images_go_before_their_matched_sentence(
    pictures, tmp_path, min_sim, elements, images, dropped
):
    root, sizes = pictures
    path = write_jsonl(str(tmp_path / "docs_shard_0.jsonl"), [mmc4_row()])
    out = str(tmp_path / "ds")
    options = {} if min_sim is None else {"min_sim": min_sim}
    summary = write_dataset(path, out, image_root=root, progress=False, **options)
    assert summary.formats == {path: "mmc4"}
    # the image before S3 is dropped (not there): S2 and S3 meet again as one text
    check_written(out, [elements], [images], sizes, "document")
    assert summary.dropped_images == dropped
    record = json.loads(next(iter(samples_of(out).values()))["json"])
    assert record["url"] == "http://example.com/page"


def test_mmc4_threshold_on_the_command_line(pictures, tmp_path, capsys):
    root, _ = pictures
    path = write_jsonl(str(tmp_path / "docs.jsonl"), [mmc4_row()])
    out = str(tmp_path / "ds")
    argv = ["write", "--input", path, "--image-root", root, "--output", out, "-q"]
    assert main([*argv, "--min-sim", "0.3"]) == 0
    line = capsys.readouterr().out
    assert "(1 document, 1 image)" in line and "input format mmc4" in line
    assert "dropped 3 images (below_min_sim: 2, missing_image: 1)" in line


def llava_pretrain_rows() -> list[dict]:
    def row(id_, image, caption):
        prompt = {
            "from": "human",
            "value": "Render a clear and concise summary of the photo.\n<image>",
        }
        return {
            "id": id_,
            "image": image,
            "conversations": [prompt, {"from": "gpt", "value": caption}],
        }

    return [
        row("004539375", "a.jpg", "select luxury furniture 3 - inch gel memory foam mattress"),
        row("002239345", "gone.jpg", "a lost picture"),
        row("005947502", "b.png", "the sun rises over a field"),
    ]


def test_llava_pretrain_rows_are_written_as_captions(pictures, tmp_path):
    root, sizes = pictures
    path = str(tmp_path / "blip_laion_cc_sbu_558k.json")
    with open(path, "w") as f:
        json.dump(llava_pretrain_rows(), f)
    out = str(tmp_path / "ds")
    summary = write_dataset(path, out, image_root=root, format="llava-pretrain", progress=False)
    # the caption whose image is not there is not written, and counted
    assert (summary.samples, summary.captions) == (2, 2)
    assert summary.dropped_images == {"missing_image": 1} and summary.left_out_captions == 1
    elements = [
        [{"image": 0}, {"text": "select luxury furniture 3 - inch gel memory foam mattress"}],
        [{"image": 0}, {"text": "the sun rises over a field"}],
    ]
    check_written(out, elements, [["a.jpg"], ["b.png"]], sizes, "caption")
    ids = [json.loads(m["json"])["id"] for m in samples_of(out).values()]
    assert ids == ["004539375", "005947502"]
    totals = load_index(out)["totals"]
    assert (totals["captions"], totals["left_out_captions"]) == (2, 1)
    assert "so 1 caption not written" in str(summary)


BAD_ROWS = [
    ({"texts": ["T", None], "images": [None]}, "bad_document", "differ in length (2 and 1)"),
    ({"texts": ["T", "U"], "images": [None, "a.jpg"]}, "bad_document", "position 1 has both"),
    ({"texts": ["T", None], "images": [None, None]}, "bad_document", "position 1 has neither"),
    ({"texts": [None, "  "], "images": ["a.jpg", None]}, "missing_text", "has no text"),
]


def test_bad_document_rows_are_named_and_refused_or_skipped(pictures, tmp_path):
    root, _ = pictures
    rows = [obelics_rows()[2]] + [{"id": f"bad{n}", **r} for n, (r, _, _) in enumerate(BAD_ROWS)]
    path = write_jsonl(str(tmp_path / "bad.jsonl"), rows)
    out = str(tmp_path / "ds")
    with pytest.raises(BadInputError) as refused:
        write_dataset(path, out, image_root=root, progress=False)
    message = str(refused.value)
    assert "4 of 5 input records are bad" in message
    for n, (_, reason, text) in enumerate(BAD_ROWS):
        assert f"bad.jsonl line {n + 2} (id 'bad{n}'): " in message
        assert text in message and f"({reason})" in message
    assert not os.path.exists(os.path.join(out, "index.json"))
    summary = write_dataset(path, out, image_root=root, skip_bad=True, progress=False)
    assert summary.samples == 1
    assert summary.skipped == {"bad_document": 3, "missing_text": 1}
    with open(os.path.join(out, "skipped.jsonl")) as f:
        listed = [json.loads(line) for line in f]
    assert [e["reason"] for e in listed] == [reason for _, reason, _ in BAD_ROWS]


@pytest.mark.parametrize("skip_bad", [False, True])
def test_images_that_cannot_be_had_are_dropped_and_counted_the_document_kept(
    pictures, tmp_path, skip_bad
):
    root, sizes = pictures
    with open(os.path.join(root, "broken.jpg"), "wb") as f:
        f.write(b"\xff\xd8\xff\xe0 not a picture")
    row = {
        "texts": ["T0", None, "T1", None, "T2", None],
        "images": [None, "broken.jpg", None, "a.jpg", None, "gone.png"],
    }
    path = write_jsonl(str(tmp_path / "web.jsonl"), [row])
    out = str(tmp_path / "ds")
    summary = write_dataset(path, out, image_root=root, skip_bad=skip_bad, progress=False)
    # a.jpg was image 1 of the row, it is image 0 of the document written
    elements = [{"text": "T0"}, {"text": "T1"}, {"image": 0}, {"text": "T2"}]
    check_written(out, [elements], [["a.jpg"]], sizes, "document")
    assert summary.skipped == {}
    assert summary.dropped_images == {"missing_image": 1, "unreadable_image": 1}
    assert load_index(out)["totals"]["dropped_images"] == summary.dropped_images


@pytest.mark.processes
def test_documents_are_written_the_same_by_any_number_of_workers(pictures, tmp_path):
    root, _ = pictures
    urls = {f"https://img.example/{n}": n for n in ("a.jpg", "b.png", "c.webp")}
    folder = str(tmp_path / "downloaded")
    img2dataset_folder(folder, root, urls, "webdataset")
    rows = obelics_rows() * 7
    for row in rows:
        row["images"] = [None if n is None else f"https://img.example/{n}" for n in row["images"]]
    path = write_jsonl(str(tmp_path / "obelics.jsonl"), rows)
    written = []
    for workers in (1, 2):
        out = str(tmp_path / f"ds{workers}")
        write_dataset(
            path, out, image_folder=folder, workers=workers, samples_per_shard=4, progress=False
        )
        written.append(
            {
                n: open(os.path.join(out, n), "rb").read()
                for n in os.listdir(out)
                if n.endswith(".tar")
            }
        )
    assert len(written[0]) == 6 and written[0] == written[1]


def test_llava_pretrain_parquet_with_embedded_images_is_written_as_captions(pictures, tmp_path):
    root, sizes = pictures
    rows = [r for r in llava_pretrain_rows() if r["image"] != "gone.jpg"]
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    embedded = []
    for r in rows:
        with open(os.path.join(root, r["image"]), "rb") as f:
            embedded.append({"bytes": f.read(), "path": r["image"]})
    table = pa.table(
        {
            "id": [r["id"] for r in rows],
            "image": pa.array(embedded, image),  # one image a row, as LLaVA-ReCap-558K
            "conversations": [r["conversations"] for r in rows],
        }
    )
    path = str(tmp_path / "recap.parquet")
    pq.write_table(table, path)
    out = str(tmp_path / "ds")
    summary = write_dataset(path, out, format="llava-pretrain", progress=False)
    assert summary.captions == 2
    elements = [[{"image": 0}, {"text": r["conversations"][1]["value"]}] for r in rows]
    check_written(out, elements, [["a.jpg"], ["b.png"]], sizes, "caption")


def test_mmc4_images_are_found_by_raw_url_in_an_img2dataset_folder(pictures, tmp_path):
    root, sizes = pictures
    folder = str(tmp_path / "downloaded")
    img2dataset_folder(folder, root, {"u/a": "a.jpg", "u/b": "b.png"}, "files")
    row = mmc4_row()
    row["image_info"][3]["raw_url"] = "https://img.example/failed.jpg"
    path = write_jsonl(str(tmp_path / "docs.jsonl"), [row])
    out = str(tmp_path / "ds")
    summary = write_dataset(path, out, image_folder=folder, progress=False)
    elements = [{"image": 0}, {"text": "S0. S1."}, {"image": 1}, {"text": "S2. S3."}]
    check_written(out, [elements], [["b.png", "a.jpg"]], sizes, "document")
    assert summary.dropped_images == {"below_min_sim": 1, "download_failed": 1}
