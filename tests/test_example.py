"""shards_example/: small, whole, a realistic mix, and a tokenizer that loads offline."""

from __future__ import annotations

import json
import os

from wdsvlm import verify_dataset

from .conftest import EXAMPLE


def test_example_is_small_and_matches_its_index():
    size = sum(
        os.path.getsize(os.path.join(folder, name))
        for folder, _, names in os.walk(EXAMPLE)
        for name in names
    )
    assert size < 5 * 2**20
    index = verify_dataset(EXAMPLE)
    assert 200 <= index["totals"]["samples"] <= 1000
    assert len({s["samples"] for s in index["shards"]}) > 1  # uneven shards, as real data has


def test_example_has_a_realistic_mix():
    index = verify_dataset(EXAMPLE)
    entries = [e for s in index["shards"] for e in s["entries"]]
    images = [wh for e in entries for wh in e["images"]]
    assert sum(not e["images"] for e in entries) >= 10  # text-only
    assert sum(len(e["images"]) > 1 for e in entries) >= 10  # multi-image
    assert sum(len(e["chars"]) > 2 for e in entries) >= 10  # multi-turn (or with a system turn)
    answers = sorted(c for e in entries for c in e["chars"][1::2])
    assert answers[len(answers) // 10] < 20 and answers[-1] > 500  # short VQA and long answers
    ratios = {round(w / h, 1) for w, h in images}
    assert len(ratios) >= 6 and min(w for w, _ in images) < 200 and max(w for w, _ in images) > 1000
    names = [n for s in index["shards"] for n in _member_names(s["name"])]
    assert any(n.endswith(".jpg") for n in names) and any(n.endswith(".png") for n in names)


def _member_names(shard: str) -> list[str]:
    import tarfile

    with tarfile.open(os.path.join(EXAMPLE, shard)) as tar:
        return tar.getnames()


def test_example_tokenizer_loads_offline_with_a_chat_template(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.join(EXAMPLE, "tokenizer"))
    messages = [
        {"role": "user", "content": "<image>\nWhat color is the circle?"},
        {"role": "assistant", "content": "Red."},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text.startswith("<|im_start|>user\n<image>\n") and text.endswith("Red.<|im_end|>\n")
    ids = tok(text)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<image>")) == 1  # one special token, not split
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None


def test_example_records_are_chat_messages():
    import webdataset as wds

    urls = [os.path.join(EXAMPLE, s["name"]) for s in verify_dataset(EXAMPLE)["shards"]]
    for sample in wds.WebDataset(urls[:1], shardshuffle=False):
        doc = json.loads(sample["json"])
        assert set(doc) == {"id", "source", "messages"}
        markers = sum(m["content"].count("<image>") for m in doc["messages"])
        assert markers == sum(1 for k in sample if k[0].isdigit())
