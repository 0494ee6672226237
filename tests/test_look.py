"""`wdsvlm inspect`, `wdsvlm stats` and `wdsvlm bench` as a person runs them (in this process,
as the console script does; test_cli.py runs the installed script end to end): exit codes,
the lines a person reads, and PNGs of the documented sizes. The numbers are
checked against the index and against the naive pipeline's own tokenization (another code
path: webdataset's tar reader, the chat template applied per prefix)."""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess

import numpy as np
import pytest
import torch
import webdataset as wds
from PIL import Image

from wdsvlm.families.tiling import ImageConfig, tile_count
from wdsvlm.pipeline.tokenize import Tokenize
from wdsvlm.tools.naive import naive_samples
from wdsvlm.tools.pictures import BATCH_PICTURE_SIZE, HISTOGRAM_SIZE, SHEET_ROW, SHEET_WIDTH

from .conftest import EXAMPLE, run_cli

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = ["--tile-size", "128", "--max-image-side", "256", "--tokens-per-tile", "16"]


def wdsvlm(*args: str, check_code: int | None = 0) -> subprocess.CompletedProcess:
    run = run_cli(*args)
    if check_code is not None:
        assert run.returncode == check_code, (run.returncode, run.stdout, run.stderr)
    return run


def png_size(path: str) -> tuple[int, int]:
    with Image.open(path) as img:
        img.load()  # decodes the whole picture, not just its header
        assert img.format == "PNG"
        return img.size


@pytest.fixture(scope="module")
def naive_lengths() -> dict[str, int]:
    """Tokens per sample of the example (tile 128, max side 256, 16 tokens per tile), made by
    the naive pipeline."""
    tokenize = Tokenize(TOKENIZER, tokens_per_tile=16, image_config=ImageConfig(128, 256))
    urls = sorted(os.path.join(EXAMPLE, n) for n in os.listdir(EXAMPLE) if n.endswith(".tar"))
    samples = naive_samples(wds.WebDataset(urls, shardshuffle=False), tokenize)
    return {s["__key__"]: len(s["input_ids"]) for s in samples}


def test_inspect_prints_samples_and_draws_a_contact_sheet(tmp_path):
    index = json.load(open(os.path.join(EXAMPLE, "index.json")))
    first = index["shards"][0]["entries"][0]
    sheet = str(tmp_path / "sheet.png")
    run = wdsvlm("inspect", EXAMPLE, "-n", "3", "--out", sheet, "--tokenizer", TOKENIZER)
    out = run.stdout
    assert out.startswith(f"{first['key']}  ({index['shards'][0]['name']})")
    config = ImageConfig()  # the command's defaults: tile 512, max side 1024
    for i, (w, h) in enumerate(first["images"]):
        tiles = tile_count(w, h, config)
        assert f"image {i}: {w}x{h} px, {tiles} tile" in out
    image_tokens = 64 * sum(tile_count(w, h, config) for w, h in first["images"])
    block = out.split("\n\n")[0]
    assert f"({image_tokens} image, " in block
    tokenizer = Tokenize(TOKENIZER).tokenizer
    for turn in json.loads(_member(index["shards"][0]["name"], first["key"]))["messages"]:
        n = len(tokenizer(turn["content"], add_special_tokens=False)["input_ids"])
        assert f"[{turn['role']}, {n} tokens] " + turn["content"].split("\n")[0] in block
    total, image, text, supervised = map(
        int,
        re.search(r"tokens: (\d+) \((\d+) image, (\d+) text, (\d+) supervised\)", block).groups(),
    )
    assert total == image + text + supervised and supervised > 0
    assert out.count("[assistant, ") >= 3 and "[user, " in out
    assert f"contact sheet of 3 samples: {sheet} ({SHEET_WIDTH}x{3 * SHEET_ROW})" in out
    assert png_size(sheet) == (SHEET_WIDTH, 3 * SHEET_ROW)


def _member(shard: str, key: str, ext: str = "json") -> bytes:
    import tarfile

    with tarfile.open(os.path.join(EXAMPLE, shard)) as tar:
        return tar.extractfile(f"{key}.{ext}").read()


def test_inspect_draws_text_only_samples(tmp_path):
    index = json.load(open(os.path.join(EXAMPLE, "index.json")))
    text_only = next(e["key"] for s in index["shards"] for e in s["entries"] if not e["images"])
    sheet = str(tmp_path / "t.png")
    run = wdsvlm("inspect", EXAMPLE, "--key", text_only, "--out", sheet)
    assert "  no images" in run.stdout
    assert png_size(sheet) == (SHEET_WIDTH, SHEET_ROW)


def test_inspect_a_key_on_a_bucket(s3_bucket, tmp_path):
    bucket, options = s3_bucket
    url = f"{bucket}/example"
    wdsvlm(
        "write",
        "--input",
        str(_example_records(tmp_path)),
        "--output",
        url,
        "--storage-options",
        json.dumps(options),
        "-q",
    )
    sheet = str(tmp_path / "one.png")
    run = wdsvlm(
        "inspect", url, "--key", "000000002", "--out", sheet,
        "--storage-options", json.dumps(options),
    )  # fmt: skip
    assert run.stdout.startswith("000000002  (data-000000.tar)")
    assert "[assistant] Answer 2." in run.stdout
    assert png_size(sheet) == (SHEET_WIDTH, SHEET_ROW)


def _example_records(tmp_path):
    """Four LLaVA records with small images."""
    from .conftest import make_image, write_jsonl

    records = []
    for i in range(4):
        make_image(str(tmp_path / f"{i}.jpg"), (100 + 50 * i, 80), "JPEG", seed=i)
        records.append(
            {
                "id": f"r{i}",
                "image": f"{i}.jpg",
                "conversations": [
                    {"from": "human", "value": f"<image>\nQuestion {i}?"},
                    {"from": "gpt", "value": f"Answer {i}."},
                ],
            }
        )
    return write_jsonl(str(tmp_path / "in.jsonl"), records)


def test_stats_counts_drops_and_padding(tmp_path, naive_lengths):
    max_length = 256
    out = str(tmp_path / "pictures")
    run = wdsvlm(
        "stats", EXAMPLE, "--tokenizer", TOKENIZER, "--max-length", str(max_length),
        "--naive-batch-size", "4", "--out", out, "--json", "-q", *SMALL,
    )  # fmt: skip
    assert "reading" not in run.stderr  # -q: no progress bar
    found = json.loads(run.stdout)
    lengths = list(naive_lengths.values())
    index = json.load(open(os.path.join(EXAMPLE, "index.json")))
    assert found["samples"] == len(lengths) == index["totals"]["samples"]
    assert found["images"] == index["totals"]["images"]
    assert found["tokens"] == sum(lengths)
    assert found["tokens_per_sample"]["max"] == max(lengths)
    fitting = [n for n in lengths if n <= max_length]
    assert 0 < len(fitting) < len(lengths)  # the cut matters at this length
    assert found["dropped"] == {
        "too_many_tokens": len(lengths) - len(fitting),
        "too_many_vision_units": 0,
    }
    assert found["padding"]["fixed"] == pytest.approx(
        1 - sum(fitting) / (len(fitting) * max_length)
    )
    # naive: batches of 4 in a seeded shuffle of the fitting samples sorted by key
    order = [naive_lengths[k] for k in sorted(naive_lengths) if naive_lengths[k] <= max_length]
    random.Random(0).shuffle(order)
    rows = [order[i : i + 4] for i in range(0, len(order), 4)]
    naive = 1 - sum(order) / sum(max(r) * len(r) for r in rows)
    assert found["padding"]["naive"] == pytest.approx(naive)
    room = found["packs"] * max_length
    assert found["packs"] >= -(-sum(fitting) // max_length)  # no row holds more than it can
    assert found["padding"]["packed"] == pytest.approx(1 - sum(fitting) / room)
    assert found["padding"]["packed"] < min(0.1, naive / 3)  # 1.8 samples a row here
    assert found["pictures"] == [
        os.path.join(out, n) for n in ("tokens.png", "tiles.png", "batches.png")
    ]
    assert png_size(found["pictures"][0]) == HISTOGRAM_SIZE
    assert png_size(found["pictures"][1]) == HISTOGRAM_SIZE
    assert png_size(found["pictures"][2]) == BATCH_PICTURE_SIZE


def test_stats_with_a_processor_says_where_the_vision_budget_binds_and_what_does_not():
    """256 patches a row of 2048 tokens: most packs end on the budget. stats says so, with a
    budget it measured; run again with that budget, it finds what it said and no advice."""
    common = ["--processor", "tiny:qwen2_5_vl", "--max-length", "2048", "-q"]
    run = wdsvlm("stats", EXAMPLE, *common, "--max-tiles-per-pack", "256")
    line = next(x for x in run.stdout.splitlines() if x.startswith("vision budget"))
    assert re.search(r"\d+ of \d+ packs \(\d+%\) ended at max_tiles_per_pack=256 patches", line)
    said = re.search(r"max_tiles_per_pack=(\d+) does not bind \(padding ([\d.]+)%\)", line)
    budget, padding = said.group(1), float(said.group(2))
    found = json.loads(
        wdsvlm("stats", EXAMPLE, *common, "--max-tiles-per-pack", budget, "--json").stdout
    )
    assert "advice" not in found
    assert round(100 * found["padding"]["packed"], 1) == padding


def test_stats_table_and_progress_bar(tmp_path):
    run = wdsvlm(
        "stats", EXAMPLE, "--tokenizer", TOKENIZER, "--max-length", "2048", "--limit", "50",
        *SMALL,
    )  # fmt: skip
    lines = run.stdout.splitlines()
    assert lines[0] == f"{EXAMPLE} at max_length 2048:"
    table = dict(line.split("  ", 1) for line in lines[1:])
    assert table["samples"].strip() == "50"
    assert table["dropped at max_length 2048"].strip() == "none"
    naive = float(table["padding, naive (batches of 8)"].split("%")[0])
    packed = float(table["padding, wdsvlm packing"].split("%")[0])
    assert packed < naive / 2
    # no more rows than the tokens need: 50 samples of about `mean` tokens each
    mean = float(re.search(r"mean (\d+)", table["tokens per sample"]).group(1))
    rows = int(re.search(r"in (\d+) rows", table["padding, wdsvlm packing"]).group(1))
    assert rows <= math.ceil((mean + 0.5) * 50 / 2048)
    assert "reading" in run.stderr and "50/50" in run.stderr  # the progress bar
    assert "pictures" not in run.stdout  # none asked for


@pytest.mark.processes
def test_bench_compares_with_the_naive_pipeline():
    run = wdsvlm(
        "bench", EXAMPLE, "--tokenizer", TOKENIZER, "--batch-size", "4", "--workers", "1",
        "--limit", "60", "--max-length", "1024", "--json", "-q", *SMALL,
    )  # fmt: skip
    result = json.loads(run.stdout)
    naive, ours = result["naive"], result["wdsvlm"]
    for side in (naive, ours):
        assert side["samples"] >= 60 and side["batches"] >= 1
        assert side["samples_per_s"] == pytest.approx(side["samples"] / side["seconds"])
        assert side["tokens_per_s"] == pytest.approx(side["tokens"] / side["seconds"])
        assert 0 < side["first_batch_s"] < side["seconds"]
    assert result["ratios"]["samples_per_s"] == pytest.approx(
        ours["samples_per_s"] / naive["samples_per_s"]
    )
    assert ours["padding"] < naive["padding"]
    assert result["settings"]["workers"] == 1
    table = wdsvlm(
        "bench", EXAMPLE, "--tokenizer", TOKENIZER, "--workers", "0", "--limit", "20", "-q",
        *SMALL,
    ).stdout  # fmt: skip
    assert "wdsvlm/naive" in table and "samples/s" in table and "first batch (s)" in table


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["inspect", "/no/such/dataset"], 1, "/no/such/dataset is not a wdsvlm dataset"),
        (["inspect", EXAMPLE, "--key", "nope"], 2, "no sample with key nope"),
        (
            ["stats", EXAMPLE, "--tokenizer", "/no/tokenizer", "--max-length", "64"],
            2,
            "cannot load the tokenizer '/no/tokenizer'",
        ),
        (["bench", EXAMPLE, "--tokenizer", TOKENIZER, "--workers", "-1"], 2, "0 or more"),
    ],
)
def test_user_errors_are_one_line(args, code, message):
    run = wdsvlm(*args, check_code=code)
    command = args[0]
    assert run.stderr.startswith(f"wdsvlm {command}: error: ")
    assert message in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1  # no traceback


def test_usage_errors_exit_2_with_the_usage():
    run = wdsvlm("stats", EXAMPLE, "--tokenizer", TOKENIZER, check_code=2)
    assert "usage: wdsvlm stats" in run.stderr and "--max-length" in run.stderr
    run = wdsvlm("bench", EXAMPLE, "--tokenizer", TOKENIZER, "--limit", "0", check_code=2)
    assert "--limit: must be at least 1, not 0" in run.stderr


def test_verbose_shows_the_traceback():
    run = wdsvlm("inspect", "/no/such/dataset", "-v", check_code=1)
    assert "Traceback" in run.stderr


def test_stats_counts_bad_samples_and_says_when_nothing_fits(llava_input, tmp_path):
    path, root, records = llava_input
    out = str(tmp_path / "ds")
    wdsvlm("write", "--input", path, "--image-root", root, "--output", out, "-q")
    shard = os.path.join(out, "data-000000.tar")
    data = bytearray(open(shard, "rb").read())
    at = data.index(b'{"id":"r2"')  # the text-only record's JSON member: now not JSON
    data[at : at + 10] = b"#" * 10
    open(shard, "wb").write(bytes(data))
    run = wdsvlm("stats", out, "--tokenizer", TOKENIZER, "--max-length", "4096", "--json", "-q")
    found = json.loads(run.stdout)
    assert found["samples"] == len(records) - 1
    assert found["skipped"] == {"invalid_json": 1}
    assert "000000002" in run.stderr  # the warning names the sample
    run = wdsvlm("inspect", out, "--key", "000000002", "--out", str(tmp_path / "bad.png"))
    assert "PROBLEM: invalid JSON member" in run.stdout  # shown, not a crash
    run = wdsvlm("stats", out, "--tokenizer", TOKENIZER, "--max-length", "8", "-q")
    table = dict(line.split("  ", 1) for line in run.stdout.splitlines()[1:])
    assert table["dropped at max_length 8"].strip() == f"{len(records) - 1} too_many_tokens"
    assert table["padding, wdsvlm packing"].strip() == "n/a (no sample fits)"


@pytest.mark.processes
def test_progress_bars_stay_off_in_dataloader_workers():
    from torch.utils.data import DataLoader, IterableDataset

    from wdsvlm.progress import progress

    class Bars(IterableDataset):
        def __iter__(self):
            yield progress(range(3), enabled=True).disable

    assert progress(range(3), enabled=True).disable is False  # on in the main process
    assert list(DataLoader(Bars(), batch_size=None, num_workers=1)) == [True]
    assert progress(range(3), enabled=False).disable is True


def test_a_missing_shard_is_a_runtime_error_naming_it(llava_input, tmp_path):
    path, root, _ = llava_input
    out = str(tmp_path / "ds")
    wdsvlm("write", "--input", path, "--image-root", root, "--output", out, "-q")
    os.remove(os.path.join(out, "data-000000.tar"))
    run = wdsvlm("inspect", out, "-n", "1", check_code=1)
    assert "data-000000.tar" in run.stderr and len(run.stderr.strip().splitlines()) == 1


@pytest.mark.processes
def test_bench_on_one_shard_gives_the_naive_side_one_worker(llava_input, tmp_path):
    path, root, records = llava_input
    out = str(tmp_path / "ds")
    wdsvlm("write", "--input", path, "--image-root", root, "--output", out, "-q")
    run = wdsvlm("bench", out, "--tokenizer", TOKENIZER, "--workers", "2", "-q", *SMALL)
    assert "2 DataLoader workers each (naive: 1, one per shard)" in run.stdout


def test_naive_batches_keep_tiles_uint8():
    from wdsvlm.tools.naive import pad_to_longest

    tokenize = Tokenize(TOKENIZER, tokens_per_tile=16, image_config=ImageConfig(128, 256))
    shard = os.path.join(EXAMPLE, sorted(n for n in os.listdir(EXAMPLE) if n.endswith(".tar"))[0])
    stored = list(wds.WebDataset(shard, shardshuffle=False))
    text_only = next(s for s in stored if not any(k[0].isdigit() for k in s))
    with_image = next(s for s in stored if any(k[0].isdigit() for k in s))
    samples = list(naive_samples(iter([text_only, with_image]), tokenize))
    assert [s["pixel_values"].dtype for s in samples] == [np.uint8, np.uint8]
    assert samples[0]["pixel_values"].shape == (0, 3, 128, 128)
    assert pad_to_longest(samples)["pixel_values"].dtype == torch.uint8


def test_hub_names_are_not_taken_for_missing_folders(monkeypatch):
    from wdsvlm.families.tiling import load_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as error:
        load_tokenizer("some-org/some-model")
    assert "cannot load the tokenizer 'some-org/some-model'" in str(error.value)
    assert "no such folder" not in str(error.value)
    with pytest.raises(ValueError, match="there is no such folder"):
        load_tokenizer("./no/such/tokenizer")
