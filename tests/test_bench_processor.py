"""``wdsvlm bench --processor``: the naive way (the processor per sample, padded batches)
beside the Loader with the same processor, on the same samples and with the same outputs."""

from __future__ import annotations

import json
import os

import pytest
import torch
import webdataset as wds

import wdsvlm
from wdsvlm.pipeline.tokenize import IGNORE_INDEX
from wdsvlm.testing.tiny import tiny_processor
from wdsvlm.tools.bench_processor import (
    PUBLISHED,
    AnswerLabels,
    bench_processor,
    pad_outputs,
    processor_samples,
)
from wdsvlm.tools.cli import main

from .conftest import EXAMPLE


def _cli(capsys, *args: str) -> str:
    assert main(["bench", EXAMPLE, "--processor", "tiny:qwen2_vl", "-q", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.processes
def test_cli_reports_both_sides(capsys, monkeypatch):
    monkeypatch.setitem(PUBLISHED, "qwen2_vl", {})  # the tiny image sizes: a fast test
    result = json.loads(
        _cli(capsys, "--limit", "24", "--batch-size", "2", "--max-length", "1024", "--json")
    )
    naive, ours = result["naive"], result["wdsvlm"]
    for side in (naive, ours):
        assert side["samples"] >= 24 and side["batches"] >= 1 and side["tokens"] > 0
        assert side["samples_per_s"] == pytest.approx(side["samples"] / side["seconds"])
        assert side["tokens_per_s"] == pytest.approx(side["tokens"] / side["seconds"])
        assert 0 < side["first_batch_s"] <= side["seconds"]
        assert 0 <= side["padding"] < 1
    assert naive["batches"] == -(-naive["samples"] // 2)  # batches of 2 samples
    assert ours["padding"] < naive["padding"]
    assert result["ratios"]["samples_per_s"] == pytest.approx(
        ours["samples_per_s"] / naive["samples_per_s"]
    )
    settings = result["settings"]
    assert settings["processor"] == "TinyQwen2VLProcessor"
    assert settings["image_size"] == dict(tiny_processor("qwen2_vl").image_processor.size)
    table = _cli(capsys, "--limit", "8", "--batch-size", "2", "--max-length", "1024")
    assert "TinyQwen2VLProcessor" in table and "float32 pixels" in table
    for row in ("samples/s", "tokens/s (real)", "first batch (s)", "padding"):
        assert row in table


def test_tiny_processors_get_the_published_image_sizes():
    ip = bench_processor("tiny:qwen2_5_vl").image_processor
    assert dict(ip.size) == {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
    with pytest.raises(ValueError, match="unknown family 'llava'"):
        bench_processor("tiny:llava")


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "give --tokenizer T or --processor P"),
        (["--tokenizer", "t", "--processor", "tiny:qwen2_vl"], "one of them"),
        (["--tokenizer", "t", "--batches-only"], "--batches-only goes with --processor"),
    ],
)
def test_tokenizer_or_processor(args, message, capsys):
    assert main(["bench", EXAMPLE, "-q", *args]) == 2
    assert message in capsys.readouterr().err


def test_naive_outputs_equal_the_loaders():
    """Per sample: the same tokens, labels (answers and their end-of-turn token) and pixels."""
    processor = tiny_processor("qwen2_vl")
    shards = sorted(os.path.join(EXAMPLE, n) for n in os.listdir(EXAMPLE) if n.endswith(".tar"))
    stored = wds.WebDataset(shards, shardshuffle=False)
    naive = {
        s["__key__"]: s for s in processor_samples(iter(stored), processor, AnswerLabels(processor))
    }
    loader = wdsvlm.Loader(EXAMPLE, processor=processor, max_length=1024, batch_size=2)
    batch = next(iter(loader))
    pixels = wdsvlm.model_inputs(batch)["pixel_values"]
    text = batch["position_ids"][0]
    at = checked = 0
    for r, keys in enumerate(batch["sample_keys"]):
        starts = torch.nonzero(text[r] == 0).flatten().tolist()
        for key, start in zip(keys, starts, strict=False):
            mine = naive[key.split("/")[1]]
            n = len(mine["input_ids"])
            assert torch.equal(batch["input_ids"][r, start : start + n], mine["input_ids"])
            assert torch.equal(batch["labels"][r, start : start + n], mine["labels"])
            assert (mine["labels"] != IGNORE_INDEX).any()
            if "pixel_values" in mine:
                expected = mine["pixel_values"]
                assert expected.dtype == torch.float32
                assert torch.equal(pixels[at : at + len(expected)], expected), key
                at += len(expected)
            checked += 1
    assert checked > 2 and at == len(pixels)


def test_naive_batches_pad_tokens_and_concatenate_the_rest():
    a = {
        "__key__": "a",
        "input_ids": torch.tensor([5, 6, 7]),
        "attention_mask": torch.ones(3, dtype=torch.long),
        "labels": torch.tensor([-100, 6, 7]),
        "pixel_values": torch.ones(1, 2, 3, 4, 4),  # SmolVLM-like: [1, images, 3, S, S]
    }
    b = {
        "__key__": "b",
        "input_ids": torch.tensor([8]),
        "attention_mask": torch.ones(1, dtype=torch.long),
        "labels": torch.tensor([8]),
        "pixel_values": torch.full((1, 1, 3, 4, 4), 2.0),
    }
    batch = pad_outputs([a, b], pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["pixel_values"].shape == (2, 2, 3, 4, 4)
    assert batch["pixel_values"][1, 0].eq(2).all() and batch["pixel_values"][1, 1].eq(0).all()
    assert batch["sample_keys"] == [["a"], ["b"]]
    text_only = {k: v for k, v in b.items() if k != "pixel_values"}
    assert pad_outputs([a, text_only], 0)["pixel_values"].shape == (1, 2, 3, 4, 4)
