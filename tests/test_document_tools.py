"""`wdsvlm inspect` and `wdsvlm stats` on documents and captions: a document shown with its
images in place, where the Loader cuts it into pieces and which image it drops; the figures of
a dataset's documents (lengths, images, pieces, drops) equal those computed directly from the
documents and the Loader's own tokenizer stage."""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wdsvlm.families.tiling import ImageConfig, tile_count
from wdsvlm.pipeline.stats import SkipStats
from wdsvlm.pipeline.tokenize import IGNORE_INDEX, Tokenize
from wdsvlm.testing.documents import random_documents, write_documents
from wdsvlm.tools.dataset_stats import dataset_stats
from wdsvlm.tools.pictures import HISTOGRAM_SIZE, SHEET_ROW, SHEET_WIDTH

from .conftest import EXAMPLE, run_cli
from .test_documents import raw_samples
from .test_look import png_size

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = ["--tile-size", "32", "--max-image-side", "64", "--tokens-per-tile", "4"]
CONFIG = ImageConfig(tile_size=32, max_image_side=64)

# A title, a long text, an image of 5 tiles, another long text, an image of 1 tile, the end.
SPLIT = {
    "kind": "document",
    "elements": [
        {"text": "A title"},
        {"text": "before " * 40},
        {"image": 0},
        {"text": "after " * 30},
        {"image": 1},
        {"text": "The end."},
    ],
    "sizes": [(400, 300), (32, 32)],
}
CHARS = sum(len(e["text"]) for e in SPLIT["elements"] if "text" in e)
CAPTION = {
    "kind": "caption",
    "elements": [{"image": 0}, {"text": "a red cat"}],
    "sizes": [(64, 48)],
}


def stage(max_length=None, max_units=None, stats=None) -> Tokenize:
    return Tokenize(
        TOKENIZER,
        tokens_per_tile=4,
        image_config=CONFIG,
        max_length=max_length,
        max_units=max_units,
        stats=stats,
    )


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    return write_documents(str(tmp_path_factory.mktemp("split")), [SPLIT, CAPTION])


def wdsvlm(*args: str) -> str:
    run = run_cli(*args)
    assert run.returncode == 0, (run.stdout, run.stderr)
    return run.stdout


def test_inspect_shows_a_document_cut_into_pieces_with_its_images_in_place_and_one_dropped(split):
    out = wdsvlm(
        "inspect", split, "--key", "000000000", "--tokenizer", TOKENIZER, "--max-length", "64",
        "--max-tiles-per-pack", "4", *SMALL, "-q",
    )  # fmt: skip
    pieces = stage(64, 4).encode([raw_samples(split)[0]])
    assert len(pieces) >= 4
    lines = out.splitlines()
    assert lines[0] == "000000000  (data-000000.tar)"
    assert lines[1] == (
        f"  document: 4 texts ({CHARS} chars), 2 images; {len(pieces)} pieces at max_length 64, "
        "4 tiles a piece; 1 image dropped (over every budget)"
    )
    # each piece's line gives the numbers of the piece the Loader makes
    heads = [i for i, line in enumerate(lines) if line.startswith("  --- piece ")]
    assert len(heads) == len(pieces)
    for i, piece in zip(heads, pieces, strict=True):
        image = sum(4 * t + 0 for t in piece["image_tiles"])
        supervised = int((piece["labels"] != IGNORE_INDEX).sum())
        tiles = sum(piece["image_tiles"])
        units = f"{tiles} tile{'s' if tiles != 1 else ''}"
        assert lines[i] == (
            f"  --- piece {piece['__piece__']}: {piece['num_tokens']} tokens ({image} image, "
            f"{supervised} supervised), {units} ---"
        )
    # the elements in reading order: the separator between the two first texts, the dropped
    # image between the parts of text 1 and text 3, image 1 in the piece that holds it
    body = [line.strip() for line in lines[2:] if not line.startswith("  ---")]
    order = [re.match(r"\[(\w+)(?: (\d+))?", line).groups() for line in body if line[0] == "["]
    order = [(kind, n) for kind, n in order if kind != "tokens"]
    assert order[:3] == [("text", "0"), ("separator", None), ("text", "1")]
    dropped = next(line for line in body if "DROPPED" in line)
    assert dropped == (
        "[image 0: 400x300 px, DROPPED: 5 tiles / 20 tokens alone, over the vision budget of "
        "4 tiles]"
    )
    after = order[order.index(("image", "0")) :]
    assert after[1] == ("text", "3") and ("image", "1") in after and after[-1] == ("EOS", None)
    holder = next(p["__piece__"] for p in pieces if p["__meta__"]["document_images"] == [1])
    in_piece = out.split(f"--- piece {holder}:")[1].split("--- piece")[0]
    assert "[image 1: 32x32 px, 1 tile / 4 tokens]" in in_piece
    # a text cut between pieces: its parts' token ranges follow each other to its end
    ranges = [
        tuple(map(int, m.groups()))
        for m in re.finditer(r"\[text 1, tokens (\d+)-(\d+) of (\d+)\]", out)
    ]
    assert len(ranges) >= 2 and ranges[0][0] == 0 and ranges[-1][1] == ranges[-1][2]
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    total = sum(p["num_tokens"] for p in pieces)
    assert f"tokens: {total} (4 image, {total - 4} text, " in out
    assert out.rstrip().endswith(f"in {len(pieces)} pieces")


def test_inspect_shows_the_text_of_each_piece_as_the_tokens_of_the_piece(split):
    """The parts shown, put back together, are the document's texts; each piece's text is
    the decoded text tokens of that piece."""
    from wdsvlm.tools.samples import inspect_samples

    (view,) = inspect_samples(
        split, keys=["000000000"], tokenizer=TOKENIZER, image_config=CONFIG,
        tokens_per_tile=4, max_length=64, max_units=4,
    )  # fmt: skip
    t = stage(64, 4)
    pieces = t.encode([raw_samples(split)[0]])
    for shown, piece in zip(view.document.pieces, pieces, strict=True):
        ids = piece["input_ids"][piece["input_ids"] != t.image_token_id]
        text = "".join(
            p.text + ("\n\n" if p.kind == "separator" else "")
            for p in shown.parts
            if p.kind in ("text", "separator", "EOS", "eos")
        )
        assert text == t.tokenizer.decode(ids.tolist())
    texts: dict[int, str] = {}
    for shown in view.document.pieces:
        for p in shown.parts:
            if p.kind == "text":
                texts[p.number] = texts.get(p.number, "") + p.text
    want = {i: e["text"] for i, e in enumerate(SPLIT["elements"]) if "text" in e}
    assert texts == want


def test_inspect_without_a_tokenizer_shows_the_elements_with_their_images_in_place(split, tmp_path):
    sheet = str(tmp_path / "sheet.png")
    out = wdsvlm("inspect", split, *SMALL, "-q", "--out", sheet)
    assert png_size(sheet) == (SHEET_WIDTH, 2 * SHEET_ROW)  # a row per document
    doc, caption = out.split("\n\n")[:2]
    tiles = [tile_count(w, h, CONFIG) for w, h in SPLIT["sizes"]]
    assert doc.splitlines()[1:] == [
        f"  document: 4 texts ({CHARS} chars), 2 images",
        "  [text 0, 7 chars] A title",
        "  [separator '\\n\\n']",
        f"  [text 1, 280 chars] {'before ' * 40}",
        f"  [image 0: 400x300 px, {tiles[0]} tiles]",
        f"  [text 3, 180 chars] {'after ' * 30}",
        f"  [image 1: 32x32 px, {tiles[1]} tile]",
        "  [text 5, 8 chars] The end.",
    ]
    assert caption.splitlines()[1:3] == [
        "  caption: 1 text (9 chars), 1 image",
        f"  [image 0: 64x48 px, {tile_count(64, 48, CONFIG)} tiles]",
    ]


def test_inspect_refuses_a_max_length_without_a_tokenizer(split):
    run = run_cli("inspect", split, "--max-length", "64")
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "wdsvlm inspect: error: --max-length goes with --tokenizer T or --processor P"
    )


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    """36 documents and captions (10 to 400 words, up to 4 images), and the split one."""
    made = random_documents(36, seed=3, words=(10, 400), images=(0, 4), caption_share=0.25)
    made.append(SPLIT)
    return write_documents(str(tmp_path_factory.mktemp("mix")), made, per_shard=7), made


def directly(folder: str, made: list[dict], max_length: int, max_units: int) -> dict:
    """The figures of the mix computed here: from the documents as made, and the pieces of
    each as the Loader's tokenizer stage cuts it."""
    stats = SkipStats()
    t = stage(max_length, max_units, stats)
    pieces = {s["__key__"]: t.encode([s]) for s in raw_samples(folder)}
    keys = [f"{i:09d}" for i in range(len(made))]
    chars = [sum(len(e["text"]) for e in d["elements"] if "text" in e) for d in made]
    images = [len(d["sizes"]) for d in made]
    counts = [len(pieces[k]) for k in keys]
    tokens = [sum(p["num_tokens"] for p in pieces[k]) for k in keys]
    return {
        "documents": sum(d["kind"] == "document" for d in made),
        "captions": sum(d["kind"] == "caption" for d in made),
        "chars": chars,
        "tokens": tokens,
        "images": Counter(images),
        "pieces": Counter(counts),
        "over_budget": stats.counts["image_over_budget"],
        "samples": sum(counts),
    }


def test_stats_figures_of_documents_equal_those_computed_directly(mix, tmp_path):
    folder, made = mix
    want = directly(folder, made, 64, 4)
    assert want["over_budget"] >= 1 and max(want["pieces"]) >= 4
    found = dataset_stats(
        folder, TOKENIZER, max_length=64, max_tiles_per_pack=4, image_config=CONFIG,
        tokens_per_tile=4, show_progress=False,
    )  # fmt: skip
    d = found.documents
    assert (d["documents"], d["captions"]) == (want["documents"], want["captions"])
    assert d["chars_per_document"]["mean"] == pytest.approx(np.mean(want["chars"]))
    assert d["chars_per_document"]["max"] == max(want["chars"])
    assert d["chars_per_document"]["p50"] == pytest.approx(np.percentile(want["chars"], 50))
    assert d["tokens_per_document"]["mean"] == pytest.approx(np.mean(want["tokens"]))
    assert d["tokens_per_document"]["p95"] == pytest.approx(np.percentile(want["tokens"], 95))
    assert d["images_per_document"]["counts"] == dict(sorted(want["images"].items()))
    assert d["pieces_per_document"]["counts"] == dict(sorted(want["pieces"].items()))
    assert d["dropped_images"] == {"image_over_budget": want["over_budget"]}
    assert d["dropped_when_written"] == {"dropped_images": {}, "left_out_captions": 0}
    # every piece is a sample; none is dropped at packing, and an image over every budget is
    # not bad data
    assert found.samples == want["samples"]
    assert "image_over_budget" not in found.skipped
    assert found.dropped == {"too_many_tokens": 0, "too_many_vision_units": 0}


def test_stats_of_a_mixture_counts_a_document_once_in_its_source(mix, tmp_path):
    folder, made = mix
    mixture = tmp_path / "mixture.yaml"
    mixture.write_text(f"sources:\n  - {{path: {EXAMPLE}}}\n  - {{path: {folder}, name: docs}}\n")
    want = directly(folder, made, 64, 4)
    found = dataset_stats(
        str(mixture), TOKENIZER, max_length=64, max_tiles_per_pack=4, image_config=CONFIG,
        tokens_per_tile=4, show_progress=False,
    )  # fmt: skip
    docs = found.per_source["docs"]
    assert docs["planned"] == docs["read"] == docs["kept"] == len(made)
    assert docs["tokens"] == sum(want["tokens"])
    assert found.documents["pieces_per_document"]["counts"] == dict(sorted(want["pieces"].items()))


def test_stats_table_json_and_picture_of_documents(mix, tmp_path):
    folder, made = mix
    want = directly(folder, made, 64, 4)
    common = [folder, "--tokenizer", TOKENIZER, "--max-length", "64", "--max-tiles-per-pack", "4"]
    lines = wdsvlm("stats", *common, *SMALL, "-q").splitlines()
    table = dict(line.split("  ", 1) for line in lines[1:])
    assert table["documents"].strip() == (
        f"{want['documents']} documents, {want['captions']} captions (each piece a sample)"
    )
    pieces = table["pieces per document"].strip()
    mean = sum(k * n for k, n in want["pieces"].items()) / len(made)
    assert pieces.startswith(f"mean {mean:.2f}, ")
    assert pieces.endswith("(at max_length 64, 4 tiles a piece)")
    assert table["images dropped"].strip() == (
        f"{want['over_budget']} fit no piece (image_over_budget)"
    )
    out = str(tmp_path / "pictures")
    found = json.loads(wdsvlm("stats", *common, *SMALL, "-q", "--json", "--out", out))
    counts = found["documents"]["pieces_per_document"]["counts"]
    assert counts == {str(k): n for k, n in sorted(want["pieces"].items())}
    assert found["pictures"][-1] == os.path.join(out, "documents.png")
    assert png_size(found["pictures"][-1]) == HISTOGRAM_SIZE


def test_stats_reports_what_the_writer_dropped(tmp_path):
    """The index totals' dropped images and left-out captions, as ``wdsvlm write`` wrote them."""
    from PIL import Image

    root = tmp_path / "img"
    root.mkdir()
    Image.new("RGB", (40, 30), "red").save(root / "a.jpg")
    rows = [
        {"id": str(i), "image": name, "conversations": [
            {"from": "human", "value": "<image>"}, {"from": "gpt", "value": f"caption {i}"}]}
        for i, name in enumerate(["a.jpg", "gone.jpg", "a.jpg"])
    ]  # fmt: skip
    path = tmp_path / "blip_laion_cc_sbu_558k.json"
    path.write_text(json.dumps(rows))
    out = str(tmp_path / "stage1")
    wdsvlm("write", "--input", str(path), "--format", "llava-pretrain", "--image-root",
           str(root), "--output", out, "-q")  # fmt: skip
    found = json.loads(wdsvlm("stats", out, "--tokenizer", TOKENIZER, "--max-length", "64",
                              *SMALL, "-q", "--json"))  # fmt: skip
    d = found["documents"]
    assert (d["documents"], d["captions"]) == (0, 2)
    assert d["dropped_when_written"] == {
        "dropped_images": {"missing_image": 1},
        "left_out_captions": 1,
    }


def page_inputs(root) -> None:
    """The inputs docs/pretraining.md starts from, small, at the paths it names (``root``
    stands for its working folder, ``root/data`` for ``/data``)."""
    import shutil

    from .conftest import make_image, photo, write_jsonl
    from .test_index_documents import member, mint1t_json, tiff, write_tar
    from .test_write_documents import img2dataset_folder, mmc4_row, obelics_rows

    pics = root / "pics"
    pics.mkdir()
    for name, size, fmt in [("a.jpg", (40, 30), "JPEG"), ("b.png", (20, 50), "PNG"),
                            ("c.webp", (33, 17), "WEBP")]:  # fmt: skip
        make_image(str(pics / name), size, fmt)
    # LLaVA-Pretrain: its JSON and images/
    images = root / "LLaVA-Pretrain" / "images" / "00453"
    images.mkdir(parents=True)
    shutil.copy(pics / "a.jpg", images / "004539375.jpg")
    rows = [{"id": "004539375", "image": "00453/004539375.jpg", "conversations": [
        {"from": "human", "value": "Give a brief description of the image.\n<image>"},
        {"from": "gpt", "value": "a red cat on a mat"}]}]  # fmt: skip
    (root / "LLaVA-Pretrain" / "blip_laion_cc_sbu_558k.json").write_text(json.dumps(rows))
    data = root / "data"
    # img2dataset caption tars
    (data / "cc3m-wds").mkdir(parents=True)
    with tarfile.open(data / "cc3m-wds" / "00000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(3):
            member(tar, f"00000{i:04d}.jpg", (pics / "a.jpg").read_bytes())
            member(tar, f"00000{i:04d}.txt", f"a picture of thing {i}".encode())
    # OBELICS Parquet with URLs, and the img2dataset folder of their images
    (root / "OBELICS" / "data").mkdir(parents=True)
    obelics = obelics_rows()
    table = {k: [r[k] for r in obelics] for k in ("texts", "metadata", "general_metadata")}
    table["images"] = [
        [None if n is None else f"https://img.example/{n}" for n in r["images"]] for r in obelics
    ]
    pq.write_table(pa.table(table), root / "OBELICS" / "data" / "train-00000-of-00001.parquet")
    urls = {f"https://img.example/{n}": n for n in ("a.jpg", "b.png", "c.webp")}
    img2dataset_folder(str(root / "obelics_images"), str(pics), urls, "webdataset")
    # MMC4 JSON Lines and its images
    (root / "mmc4").mkdir()
    write_jsonl(str(root / "mmc4" / "docs_no_face_shard_0_v2.jsonl"), [mmc4_row()])
    shutil.copytree(pics, root / "mmc4_images")
    # MINT-1T tars
    mint = data / "MINT-1T-PDF-CC-2024-18"
    mint.mkdir()
    frames = [photo(40 + 8 * i, 30 + 5 * i, seed=i) for i in range(2)]
    doc = mint1t_json(
        ["A title", ("image", "page_0_image_12"), "A paragraph.", ("image", "page_1_image_7")],
        [(0, 12, frames[0].size), (1, 7, frames[1].size)],
    )
    write_tar(mint / "CC-MAIN-2024-18-shard-0.tar", [("0a1b", doc, tiff(frames))])
    # instruction data: conversations
    shutil.copytree(EXAMPLE, data / "llava_instruct")


def page_commands(text: str) -> list[list[str]]:
    """The ``wdsvlm`` commands of a page's bash blocks, each as its arguments."""
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            if command.strip():
                commands.append(shlex.split(command))
    return commands


def test_pretraining_page_commands_and_examples_run(tmp_path, monkeypatch):
    """Every command of docs/pretraining.md runs on small inputs of each layout (the tiny
    processor for the Hub's, one writer process), and its Python examples run: the documents'
    batches hold pieces, and the schedule's first batches are captions alone."""
    from .conftest import REPO

    page = open(os.path.join(REPO, "docs", "pretraining.md"), encoding="utf-8").read()
    page_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    page = re.sub(r"(?<=[\s\"'])/data/", f"{tmp_path}/data/", page)
    page = page.replace("Qwen/Qwen2-VL-2B-Instruct", "tiny:qwen2_vl")
    commands = page_commands(page)
    assert [c[:2] for c in commands] == [["wdsvlm", "write"], ["wdsvlm", "index"]] + [
        ["wdsvlm", "write"]
    ] * 2 + [["wdsvlm", "index"], ["wdsvlm", "inspect"], ["wdsvlm", "stats"]]
    outputs = []
    for command in commands:
        args = [
            "1" if a == "8" and b == "--workers" else a
            for b, a in zip(["", *command], command, strict=False)
        ]
        outputs.append(wdsvlm(*args[1:], "-q"))
    assert "(1 caption, 1 image)" in outputs[0] and "(3 captions, 3 images)" in outputs[1]
    assert "3 documents" in outputs[2] and "input format obelics" in outputs[2]
    assert "input format mmc4" in outputs[3] and "layout mint1t" in outputs[4]
    assert "  document: " in outputs[5] and "--- piece 0: " in outputs[5]
    assert "pieces per document" in outputs[6]
    assert os.path.exists(tmp_path / "obelics-stats" / "documents.png")
    examples = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(examples) == 2
    scope: dict = {"__name__": "example"}
    exec(examples[0], scope)  # noqa: S102 - our own documentation
    batch = scope["batch"]
    assert batch["num_loss_tokens"] > 0 and "sample_pieces" in batch
    exec(examples[1], scope)  # noqa: S102 - our own documentation
    loader = scope["loader"]
    for _, batch in zip(range(3), loader, strict=False):
        assert {s for row in batch["sample_sources"] for s in row} == {"stage1"}
