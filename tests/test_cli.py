"""The wdsvlm command: exit codes 0 / 1 / 2, one-line errors, the summary line."""

from __future__ import annotations

import json
import logging
import os
import sys

import pytest

from wdsvlm import load_index
from wdsvlm.tools.cli import byte_size, main

from .conftest import EXAMPLE, run_process, write_jsonl


@pytest.mark.processes
def test_write_prints_a_summary_and_exits_0(llava_input, tmp_path, capsys):
    path, root, _ = llava_input
    out = str(tmp_path / "ds")
    code = main(
        [
            "write",
            "--input",
            path,
            "--image-root",
            root,
            "--output",
            out,
            "-q",
            "--samples-per-shard",
            "5",
            "--prefix",
            "train",
            "--workers",
            "2",
        ]
    )
    assert code == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("wrote 12 samples (10 images) in 3 shards")
    assert f"to {out}" in line and "skipped none" in line
    assert "index.json" in os.listdir(out) and "train-000002.tar" in os.listdir(out)


def test_bad_input_exits_1_with_the_record_named(tmp_path, capsys):
    path = write_jsonl(
        str(tmp_path / "in.jsonl"),
        [
            {
                "id": "ok",
                "conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}],
            },
            {
                "id": "lost",
                "image": "gone.jpg",
                "conversations": [
                    {"from": "human", "value": "<image>"},
                    {"from": "gpt", "value": "A"},
                ],
            },
        ],
    )
    out = str(tmp_path / "ds")
    assert main(["write", "--input", path, "--output", out, "-q"]) == 1
    err = capsys.readouterr().err
    assert "in.jsonl line 2 (id 'lost')" in err and "gone.jpg not found" in err
    assert "Traceback" not in err
    assert main(["write", "--input", path, "--output", out, "-q", "--skip-bad"]) == 0
    assert "skipped 1 bad record (missing_image: 1)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["write", "--output", "x"], "--input"),
        (["write", "--input", "missing.jsonl", "--output", "x"], "missing.jsonl not found"),
        (["write", "--input", "a", "--output", "x", "--prefix", "a.b"], "prefix 'a.b'"),
        (
            ["write", "--input", "a", "--output", "x", "--max-shard-bytes", "lots"],
            "not a byte size",
        ),
        (["write", "--input", "a", "--output", "x", "--storage-options", "[1]"], "JSON object"),
    ],
)
def test_usage_errors_exit_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        code = main(argv)
        raise SystemExit(code)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_stats_batch_size_is_a_deprecated_name_of_naive_batch_size(capsys, caplog):
    """``wdsvlm stats --batch-size`` (samples per naive batch) still works, under its new name
    ``--naive-batch-size`` (the Loader's ``batch_size`` counts packed rows), with a warning."""
    from wdsvlm.tools.arguments import build_parser
    from wdsvlm.tools.commands import naive_batch_size

    def parse(*options: str):
        return build_parser().parse_args(["stats", EXAMPLE, "--max-length", "256", *options])

    with caplog.at_level(logging.WARNING, logger="wdsvlm"):
        assert naive_batch_size(parse()) == 8
        assert naive_batch_size(parse("--naive-batch-size", "4")) == 4
        assert caplog.records == []
        assert naive_batch_size(parse("--batch-size", "4")) == 4
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "--batch-size is deprecated, use --naive-batch-size" in caplog.text
    with pytest.raises(ValueError, match="disagree"):
        naive_batch_size(parse("--batch-size", "4", "--naive-batch-size", "2"))
    # the whole command, under its old spelling
    tokenizer = os.path.join(EXAMPLE, "tokenizer")
    argv = ["stats", EXAMPLE, "--tokenizer", tokenizer, "--max-length", "256", "--limit", "8"]
    small = ["--tile-size", "128", "--max-image-side", "256", "--tokens-per-tile", "16"]
    assert main([*argv, *small, "--batch-size", "4", "--json", "-q"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["naive_batch_size"] == found["batch_size"] == 4 and found["samples"] == 8


def test_byte_sizes_read_with_binary_units():
    assert byte_size("1000") == 1000
    assert byte_size("64MB") == 64 * 2**20
    assert byte_size("1GiB") == 2**30
    assert byte_size("1.5k") == 1536


@pytest.mark.processes
def test_console_script_verifies_the_example():
    exe = os.path.join(os.path.dirname(sys.executable), "wdsvlm")
    run = run_process([exe, "verify", EXAMPLE], timeout=120)
    assert run.returncode == 0, run.stderr
    assert "every shard matches the index" in run.stdout and "samples=320" in run.stdout


def test_verify_names_a_changed_shard(tmp_path, capsys, llava_input):
    path, root, _ = llava_input
    out = str(tmp_path / "ds")
    assert main(["write", "--input", path, "--image-root", root, "--output", out, "-q"]) == 0
    shard = os.path.join(out, "data-000000.tar")
    with open(shard, "r+b") as f:
        f.seek(700)
        f.write(b"X")
    assert main(["verify", out]) == 1
    assert "data-000000.tar" in capsys.readouterr().err
    assert main(["verify", str(tmp_path / "nothing")]) == 1
    assert "not a wdsvlm dataset" in capsys.readouterr().err


def test_a_merge_into_a_dataset_is_refused_without_overwrite(tmp_path, capsys):
    """``wdsvlm index OUT --merge PART`` where OUT holds a dataset already (its own shards, or
    an earlier merge) exits 1 naming it and leaves its index as it was, as ``write`` and
    ``index`` do; with ``--overwrite`` the merged index replaces it."""
    records = [
        {
            "id": f"r{i}",
            "conversations": [
                {"from": "human", "value": f"What is {i} and {i}?"},
                {"from": "gpt", "value": f"{2 * i}."},
            ],
        }  # fmt: skip
        for i in range(4)
    ]
    out = str(tmp_path / "out")
    for k, name in enumerate(("", "part-0", "part-1")):  # OUT's own dataset, then two parts
        path = write_jsonl(str(tmp_path / f"in{k}.jsonl"), records[k : k + 2])
        assert main(["write", "--input", path, "--output", os.path.join(out, name), "-q"]) == 0
    capsys.readouterr()
    index = os.path.join(out, "index.json")
    before = open(index, "rb").read()
    assert main(["index", out, "--merge", "part-0", "part-1"]) == 1
    err = capsys.readouterr().err
    assert f"{out} already holds a dataset (index.json)" in err and "--overwrite" in err
    assert "Traceback" not in err
    assert open(index, "rb").read() == before  # the dataset at OUT is untouched, still whole
    assert load_index(out)["totals"]["samples"] == 2

    assert main(["index", out, "--merge", "part-0", "part-1", "--overwrite"]) == 0
    assert "2 datasets merged into one index (shards=2 samples=4" in capsys.readouterr().out
    assert main(["index", out, "--merge", "part-0"]) == 1  # an earlier merge is a dataset too
    assert "already holds a dataset" in capsys.readouterr().err
    assert load_index(out)["totals"]["samples"] == 4
