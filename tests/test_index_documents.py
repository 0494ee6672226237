"""``wdsvlm index`` of tars that hold documents or captions, in place: MINT-1T's tars as
published (``KEY.json`` with parallel ``texts`` and ``images``, ``KEY.tiff`` with the images as
frames, in ``image_metadata``'s order) and img2dataset's caption tars indexed as captions.
Each is read back through the Loader's read stage (``ReadSamples`` and the index's layout)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

import wdsvlm
from wdsvlm.errors import BadInputError
from wdsvlm.format.documents import IMAGE_ELEMENT, KINDS
from wdsvlm.format.index import load_index
from wdsvlm.pipeline.order import span
from wdsvlm.pipeline.read import ReadSamples
from wdsvlm.write.tarindex import index_tars

from .conftest import EXAMPLE, photo, run_cli

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"max_length": 256, "batch_size": 2, "tile_size": 64, "max_image_side": 128}


def member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def tiff(frames: list[Image.Image], **save) -> bytes:
    """One multi-frame TIFF of ``frames``, as MINT-1T stores a document's images."""
    out = io.BytesIO()  # copies: an image saved before keeps that format's encoder settings
    frames = [f.copy() for f in frames]
    frames[0].save(out, format="TIFF", save_all=True, append_images=frames[1:], **save)
    return out.getvalue()


def corrupt_frame(data: bytes, number: int) -> bytes:
    """``data`` (a deflate-compressed TIFF) with frame ``number``'s pixel data overwritten:
    its header still reads, its pixels do not decode."""
    with Image.open(io.BytesIO(data)) as img:
        img.seek(number)
        offset = img.tag_v2[273][0]  # StripOffsets
    out = bytearray(data)
    out[offset : offset + 16] = b"\xff" * 16
    return bytes(out)


def mint1t_json(order: list, metadata: list[tuple[int, int, tuple[int, int]]], **fields) -> dict:
    """A MINT-1T JSON member: ``order`` lists texts (str) and image names (``("image",
    name)``) in reading order; ``metadata`` holds ``(page, xref, (width, height))`` per TIFF
    frame, in frame order."""
    texts = [None if isinstance(x, tuple) else x for x in order]
    images = [x[1] if isinstance(x, tuple) else None for x in order]
    image_metadata = [
        {"height": h, "page": p, "sha256": f"{p}-{x}", "width": w, "xref": x}
        for p, x, (w, h) in metadata
    ]
    return {
        "bff_contained_ngram_count_before_dedupe": 0,
        "image_metadata": image_metadata,
        "images": images,
        "language_id_whole_page_fasttext": {"en": 0.93},
        "texts": texts,
        "url": "http://example.invalid/paper.pdf",
        **fields,
    }


def write_tar(path, samples: list[tuple[str, dict | bytes, bytes | None]]) -> str:
    """A tar of ``(key, json, tiff bytes or None)`` samples, KEY.json then KEY.tiff."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, doc, frames in samples:
            data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
            member(tar, f"{key}.json", data)
            if frames is not None:
                member(tar, f"{key}.tiff", frames)
    return str(path)


def digests(folder) -> dict:
    return {
        n: hashlib.sha256(open(os.path.join(folder, n), "rb").read()).hexdigest()
        for n in sorted(os.listdir(folder))
        if n.endswith(".tar")
    }


def read_back(folder) -> dict[str, dict]:
    """Every indexed sample's members as the Loader's read stage hands them on, by key."""
    index = load_index(str(folder))
    read = ReadSamples(read_ahead=0)
    spans = [
        span(os.path.join(folder, s["name"]), s["name"], s["entries"], layout=index.get("layout"))
        for s in index["shards"]
    ]
    samples = {s["__key__"]: s for s in read(iter(spans))}
    assert read.stats.as_dict()["skipped"] == {}
    return {k: {n: v for n, v in s.items() if not n.startswith("__")} for k, s in samples.items()}


def pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


@pytest.fixture
def mint1t(tmp_path):
    """Two MINT-1T-style tars: a document with two images, one whose image order differs
    from its TIFF's frame order, one of text alone (no TIFF), and one whose second frame
    does not decode."""
    folder = tmp_path / "mint"
    folder.mkdir()
    pictures = [photo(40 + 8 * i, 30 + 5 * i, seed=i) for i in range(6)]
    two = mint1t_json(
        ["A title", ("image", "page_0_image_12"), "A paragraph.", ("image", "page_1_image_7")],
        [(0, 12, pictures[0].size), (1, 7, pictures[1].size)],
        pdf_name="two.pdf",
    )
    swapped = mint1t_json(
        [("image", "page_2_image_5"), "Between them.", ("image", "page_0_image_3")],
        [(0, 3, pictures[2].size), (2, 5, pictures[3].size)],  # frame 0 is the second image
    )
    text = mint1t_json(["Only words here.", "And more."], [])
    broken = mint1t_json(
        ["Three figures:", ("image", "page_0_image_1"), ("image", "page_0_image_2"),
         ("image", "page_0_image_3"), "the end."],
        [(0, n + 1, pictures[3 + n].size) for n in range(3)],
    )  # fmt: skip
    write_tar(
        folder / "part-000000.tar",
        [
            ("0a1b", two, tiff(pictures[:2], compression="tiff_deflate")),
            ("0a1c", swapped, tiff(pictures[2:4])),
        ],
    )
    corrupt = corrupt_frame(tiff(pictures[3:6], compression="tiff_deflate"), 1)
    write_tar(folder / "part-000001.tar", [("0b00", text, None), ("0b01", broken, corrupt)])
    return folder, pictures, {"0a1b": two, "0a1c": swapped, "0b00": text, "0b01": broken}


def expected_json(key: str, source: dict, elements: list) -> dict:
    kept = {k: v for k, v in source.items() if k not in ("texts", "images")}
    return {"id": key, "source": "", "kind": "document", "elements": elements, **kept}


def test_mint1t_tars_are_indexed_in_place_as_documents_and_read_as_written_ones(mint1t):
    folder, pictures, docs = mint1t
    before = digests(folder)
    summary = index_tars(str(folder), format="mint1t", show_progress=False)
    assert digests(folder) == before  # indexed in place: not a byte of a tar changed
    assert (summary.samples, summary.images) == (4, 6)
    assert summary.dropped_images == {"unreadable_image": 1}
    assert "0b01" in summary.dropped_examples[0] and "frame 1" in summary.dropped_examples[0]

    index = load_index(str(folder))
    assert index["layout"] == {"name": "mint1t"}
    assert index["totals"]["dropped_images"] == {"unreadable_image": 1}
    assert index["totals"]["documents"] == 4
    entries = {e["key"]: e for s in index["shards"] for e in s["entries"]}
    document = KINDS.index("document")
    assert {k: e["kind"] for k, e in entries.items()} == dict.fromkeys(docs, document)
    assert entries["0a1b"]["elements"] == [7, IMAGE_ELEMENT, 12, IMAGE_ELEMENT]
    assert entries["0a1b"]["chars"] == [7, 12]
    assert entries["0a1b"]["images"] == [list(pictures[0].size), list(pictures[1].size)]
    assert entries["0a1c"]["images"] == [list(pictures[3].size), list(pictures[2].size)]
    assert entries["0b00"]["elements"] == [16, 9] and entries["0b00"]["images"] == []
    assert entries["0b01"]["elements"] == [14, IMAGE_ELEMENT, IMAGE_ELEMENT, 8]
    assert entries["0b01"]["images"] == [list(pictures[3].size), list(pictures[5].size)]

    got = read_back(folder)
    assert sorted(got) == sorted(docs)
    want = {
        "0a1b": (
            [{"text": "A title"}, {"image": 0}, {"text": "A paragraph."}, {"image": 1}],
            [pictures[0], pictures[1]],
        ),
        "0a1c": (
            [{"image": 0}, {"text": "Between them."}, {"image": 1}],
            [pictures[3], pictures[2]],  # placed by page and xref, not by frame order
        ),
        "0b00": ([{"text": "Only words here."}, {"text": "And more."}], []),
        "0b01": (  # the frame that does not decode is left out, the rest renumbered
            [{"text": "Three figures:"}, {"image": 0}, {"image": 1}, {"text": "the end."}],
            [pictures[3], pictures[5]],
        ),
    }
    for key, (elements, images) in want.items():
        members = got[key]
        assert json.loads(members["json"]) == expected_json(key, docs[key], elements)
        assert sorted(members) == sorted(["json", *(f"{n}.tiff" for n in range(len(images)))])
        for n, picture in enumerate(images):
            assert np.array_equal(pixels(members[f"{n}.tiff"]), np.asarray(picture))


def test_mint1t_layout_is_detected_and_its_dropped_images_reported(mint1t):
    folder, _, _ = mint1t
    result = run_cli("index", str(folder), "-q")
    assert result.returncode == 0, result.stderr
    assert "layout mint1t (detected: a json member with parallel 'texts' and 'images'" in (
        result.stdout
    )
    assert "indexed 4 samples (4 documents, 6 images) in 2 shards" in result.stdout
    assert "dropped 1 images (unreadable_image: 1)" in result.stdout
    assert "skipped none" in result.stdout


def test_bad_mint1t_samples_are_named_and_refused_unless_skipped(tmp_path):
    folder = tmp_path / "bad"
    folder.mkdir()
    frame = photo(24, 16)
    image = ("image", "page_0_image_1")
    lengths = mint1t_json(["words", image], [(0, 1, frame.size)])
    lengths["texts"].append("one text too many")
    both = mint1t_json(["words", image], [(0, 1, frame.size)])
    both["texts"][1] = "a text where the image is"
    neither = mint1t_json(["words", image], [(0, 1, frame.size)])
    neither["images"][1] = None
    no_text = mint1t_json([image, "  "], [(0, 1, frame.size)])
    good = mint1t_json(["words", image], [(0, 1, frame.size)])
    write_tar(
        folder / "shard-0.tar",
        [
            ("lengths", lengths, tiff([frame])),
            ("both", both, tiff([frame])),
            ("neither", neither, tiff([frame])),
            ("notext", no_text, tiff([frame])),
            ("notjson", b"{not json", tiff([frame])),
            ("good", good, tiff([frame])),
        ],
    )
    with pytest.raises(BadInputError) as e:
        index_tars(str(folder), format="mint1t", show_progress=False)
    message = str(e.value)
    assert "5 of 6 samples are bad; no index.json was written" in message
    assert "shard-0.tar key lengths: 'texts' has 3 entries and 'images' 2" in message
    assert "shard-0.tar key both: position 1 holds both a text and an image" in message
    assert "shard-0.tar key neither: position 1 holds neither a text nor an image" in message
    assert "(bad_document)" in message
    assert not os.path.exists(folder / "index.json")

    summary = index_tars(str(folder), format="mint1t", skip_bad=True, show_progress=False)
    assert summary.samples == 1
    assert summary.skipped == {"bad_document": 3, "missing_text": 1, "invalid_json": 1}
    listed = [json.loads(line) for line in open(folder / "index-skipped.jsonl")]
    assert {(b["shard"], b["key"], b["reason"]) for b in listed} == {
        ("shard-0.tar", "lengths", "bad_document"),
        ("shard-0.tar", "both", "bad_document"),
        ("shard-0.tar", "neither", "bad_document"),
        ("shard-0.tar", "notext", "missing_text"),
        ("shard-0.tar", "notjson", "invalid_json"),
    }
    assert sorted(read_back(folder)) == ["good"]


@pytest.fixture
def captions(tmp_path):
    """An img2dataset-style tar: KEY.jpg, KEY.txt and KEY.json (its metadata) per sample."""
    folder = tmp_path / "captions"
    folder.mkdir()
    samples = []
    with tarfile.open(folder / "00000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(3):
            key = f"00000{i:04d}"
            out = io.BytesIO()
            photo(32 + 4 * i, 24, seed=i).save(out, format="JPEG")
            caption = f"  a picture of thing {i} "
            member(tar, f"{key}.jpg", out.getvalue())
            member(tar, f"{key}.txt", caption.encode())
            member(tar, f"{key}.json", json.dumps({"url": "http://x.invalid", "key": key}).encode())
            samples.append((key, out.getvalue(), caption.strip(), (32 + 4 * i, 24)))
    return folder, samples


def test_img2dataset_captions_are_indexed_as_captions_trained_without_a_prompt(captions):
    folder, samples = captions
    before = digests(folder)
    result = run_cli("index", str(folder), "--format", "captions", "--kind", "caption", "-q")
    assert result.returncode == 0, result.stderr
    assert "indexed 3 samples (3 captions, 3 images)" in result.stdout
    assert digests(folder) == before
    index = load_index(str(folder))
    assert index["layout"] == {"name": "captions", "kind": "caption", "text": ["txt", "caption",
                               "text", "cap"]}  # fmt: skip
    assert index["totals"]["captions"] == 3
    entries = {e["key"]: e for s in index["shards"] for e in s["entries"]}
    got = read_back(folder)
    for key, jpg, caption, size in samples:
        assert entries[key]["kind"] == KINDS.index("caption")
        assert entries[key]["elements"] == [IMAGE_ELEMENT, len(caption)]
        assert entries[key]["chars"] == [len(caption)] and entries[key]["images"] == [list(size)]
        assert json.loads(got[key]["json"]) == {
            "id": key,
            "source": "",
            "kind": "caption",
            "elements": [{"image": 0}, {"text": caption}],
        }
        assert sorted(got[key]) == ["0.jpg", "json"] and got[key]["0.jpg"] == jpg


def test_captions_stay_conversations_unless_asked(captions):
    folder, samples = captions
    index_tars(str(folder), format="captions", show_progress=False)
    index = load_index(str(folder))
    assert index["layout"]["name"] == "captions" and "kind" not in index["layout"]
    entries = [e for s in index["shards"] for e in s["entries"]]
    assert all("kind" not in e for e in entries)
    record = json.loads(read_back(folder)[samples[0][0]]["json"])
    assert [m["role"] for m in record["messages"]] == ["user", "assistant"]
    with pytest.raises(ValueError, match="the mint1t layout makes document samples"):
        index_tars(str(folder), format="mint1t", kind="caption", overwrite=True)


def test_mint1t_documents_load_as_the_same_documents_written_by_wdsvlm_write(tmp_path):
    """The Loader's batches of MINT-1T tars indexed in place equal, tensor for tensor, those
    of the same documents written by ``wdsvlm write`` (OBELICS rows, the frames as PNG)."""
    pictures = [photo(40 + 8 * i, 30 + 5 * i, seed=i) for i in range(4)]
    documents = {
        "0a": [
            "A title",
            ("image", "page_0_image_12"),
            "A paragraph.",
            ("image", "page_1_image_7"),
        ],
        "0b": [("image", "page_2_image_5"), "Between them " * 30],
        "0c": ["Only words here.", "And more words " * 50],
        "0d": ["Figure:", ("image", "page_0_image_1"), "the end."],
    }
    (tmp_path / "mint").mkdir()
    (tmp_path / "images").mkdir()
    samples, records, used = [], [], iter(pictures)
    for key, order in documents.items():
        frames, metadata, paths = [], [], []
        for x in order:
            if isinstance(x, tuple):
                picture = next(used)
                _, page, _, xref = x[1].split("_")
                frames.append(picture)
                metadata.append((int(page), int(xref), picture.size))
                paths.append(f"{len(os.listdir(tmp_path / 'images'))}.png")
                picture.save(tmp_path / "images" / paths[-1])
            else:
                paths.append(None)
        samples.append((key, mint1t_json(order, metadata), tiff(frames) if frames else None))
        texts = [None if isinstance(x, tuple) else x for x in order]
        records.append({"id": key, "texts": texts, "images": paths})
    write_tar(tmp_path / "mint" / "part-0.tar", samples)
    index_tars(str(tmp_path / "mint"), format="mint1t", show_progress=False)
    jsonl = str(tmp_path / "documents.jsonl")
    with open(jsonl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    written = str(tmp_path / "written")
    wdsvlm.write_dataset(jsonl, written, image_root=str(tmp_path / "images"), progress=False)

    def batches(source):
        loader = wdsvlm.Loader(source, TOKENIZER, **SMALL)
        got = [{k: v for k, v in b.items() if isinstance(v, torch.Tensor)} for b in loader]
        assert loader.stats()["skipped"] == {}
        return got

    indexed, want = batches(str(tmp_path / "mint")), batches(written)
    assert len(indexed) == len(want) > 0
    for a, b in zip(indexed, want, strict=True):
        assert sorted(a) == sorted(b)
        for name in a:
            assert a[name].shape == b[name].shape and torch.equal(a[name], b[name]), name


def test_written_documents_copied_without_their_index_are_indexed_as_written(tmp_path):
    """Documents and captions that ``wdsvlm write`` wrote, their tars alone: ``auto`` finds
    wdsvlm's own layout and the entries equal those the writer recorded (kind, elements,
    texts' characters, image sizes, byte ranges)."""
    (tmp_path / "images").mkdir()
    records = []
    for i in range(5):
        photo(30 + 6 * i, 20 + 4 * i, seed=i).save(tmp_path / "images" / f"{i}.png")
        texts = [f"document {i} begins", None, "and goes on " * (i + 1)]
        records.append({"id": f"d{i}", "texts": texts, "images": [None, f"{i}.png", None]})
    jsonl = str(tmp_path / "documents.jsonl")
    with open(jsonl, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    written = str(tmp_path / "written")
    wdsvlm.write_dataset(jsonl, written, image_root=str(tmp_path / "images"), progress=False)
    copied = tmp_path / "copied"
    copied.mkdir()
    for name in os.listdir(written):
        if name.endswith(".tar"):
            os.link(os.path.join(written, name), copied / name)
    summary = index_tars(str(copied), show_progress=False)
    assert summary.layout == "wdsvlm" and "kind/elements" in summary.detected
    original, indexed = load_index(written), load_index(str(copied))
    for a, b in zip(original["shards"], indexed["shards"], strict=True):
        assert (a["name"], a["sha256"]) == (b["name"], b["sha256"])
        assert list(a["entries"]) == list(b["entries"])
    assert {e["kind"] for s in indexed["shards"] for e in s["entries"]} == {1}
