"""A ``<video>`` or ``<image>`` in a record's text is a placeholder only where the record has
media of that kind; elsewhere it is text, written and trained on as such, in new datasets and
in datasets written before. In a record with media of a kind, every marker of that kind is a
placeholder, and a count that differs from the media's stays an error."""

from __future__ import annotations

import io
import json
import os
import tarfile

import numpy as np
import pytest

import wdsvlm
from wdsvlm.errors import BadInputError, InputError
from wdsvlm.format.conversation import conversation_of, place_images
from wdsvlm.pipeline.stats import SkipStats
from wdsvlm.pipeline.tokenize import IGNORE_INDEX, Tokenize
from wdsvlm.write.tarindex import index_tars

from .conftest import EXAMPLE, make_image, write_jsonl

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
QUESTION = "What does the HTML <video> tag do?"
ANSWER = "It embeds a video player: <video src='a.mp4'>. Its poster is an <image> of it."
SETTINGS = {"max_length": 512, "batch_size": 2, "shuffle_buffer": 4, "pack_window": 8}


def _conversation(question: str = QUESTION, answer: str = ANSWER) -> list[dict]:
    return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]


def _placed(question: str, images: int, videos: int) -> str:
    record = {"conversations": _conversation(question, "A dot.")}
    messages = conversation_of(record, "r.jsonl line 1")
    place_images(messages, images, "r.jsonl line 1", n_videos=videos)
    return messages[0]["content"]


def test_markers_of_a_kind_the_record_has_no_media_of_are_text():
    assert _placed(QUESTION, 0, 0) == QUESTION
    assert _placed("An <image> or a <video>?", 0, 0) == "An <image> or a <video>?"
    # a video and no image: <image> is text, the video's marker goes first as ever
    assert _placed("<image><image>", 0, 1) == "<video>\n<image><image>"
    assert _placed(QUESTION, 1, 0) == "<image>\n" + QUESTION
    # LLaVA-Video's <image>, one per video, still stands for the video
    assert _placed("<image>\nWhat happens?", 0, 1) == "<video>\nWhat happens?"


@pytest.mark.parametrize(
    "question, images, videos, reason",
    [
        ("<image>\nWhat does the HTML <image> tag do?", 1, 0, "image_count_mismatch"),
        ("<video>\n" + QUESTION, 0, 1, "video_count_mismatch"),
    ],
)
def test_a_literal_tag_beside_placeholders_of_its_kind_is_refused(question, images, videos, reason):
    with pytest.raises(InputError) as caught:
        _placed(question, images, videos)
    assert caught.value.reason == reason


def test_the_writer_writes_a_literal_tag_of_a_text_only_record_as_text(tmp_path):
    """It used to refuse the record (``video_count_mismatch``: 1 <video> but 0 videos)."""
    make_image(str(tmp_path / "a.jpg"), (40, 30), "JPEG")
    records = [
        {"id": "html", "conversations": _conversation()},
        {"id": "pic", "image": "a.jpg", "conversations": _conversation("<image>\nIt?", "A dot.")},
    ]
    out = str(tmp_path / "out")
    wdsvlm.write_dataset(write_jsonl(str(tmp_path / "in.jsonl"), records), out, progress=False)
    index = wdsvlm.load_index(out)
    assert index["totals"]["samples"] == 2 and index["totals"].get("videos", 0) == 0
    name = next(n for n in os.listdir(out) if n.endswith(".tar"))
    with tarfile.open(os.path.join(out, name)) as tar:
        docs = [json.load(tar.extractfile(m)) for m in tar.getmembers() if m.name.endswith("json")]
    assert [m["content"] for m in docs[0]["messages"]] == [QUESTION, ANSWER]
    assert docs[1]["messages"][0]["content"] == "<image>\nIt?"


def test_the_writer_still_refuses_a_literal_tag_beside_media_of_its_kind(tmp_path):
    make_image(str(tmp_path / "a.jpg"), (40, 30), "JPEG")
    question = "<image>\nWhat does the HTML <image> tag do?"
    records = [{"id": "x", "image": "a.jpg", "conversations": _conversation(question, "A dot.")}]
    path = write_jsonl(str(tmp_path / "in.jsonl"), records)
    with pytest.raises(BadInputError, match="image_count_mismatch"):
        wdsvlm.write_dataset(path, str(tmp_path / "out"), progress=False)


def _sample(messages, images=(), key="k"):
    return {
        "__key__": key,
        "__shard__": "s",
        "json": json.dumps({"id": key, "source": "s", "messages": messages}),
        "__meta__": {"images": [list(i) for i in images]},
    }


def _messages(question: str = QUESTION, answer: str = ANSWER) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def test_a_literal_tag_is_tokenized_as_its_text_not_as_the_vocabularys_image_token():
    """The example tokenizer has ``<image>`` as a token of its own (the image token): a
    literal one in a sample without images is the text's tokens, supervised in the answer."""
    stats = SkipStats()
    stage = Tokenize(TOKENIZER, stats=stats)
    tok = stage.tokenizer
    question = "Is <image> a tag? " + QUESTION
    (out,) = stage(iter([_sample(_messages(question))]))
    assert stats.counts == {}
    ids, labels = out["input_ids"], out["labels"]
    assert stage.image_token_id not in ids
    assert tok.decode(ids[labels != IGNORE_INDEX]) == ANSWER + "<|im_end|>"
    assert question in tok.decode(ids) and ANSWER in tok.decode(ids)
    # a sample without literal tags is tokenized as it always was
    plain = _messages("What does the HTML tag do?", "It embeds a video player.")
    (alone,) = stage(iter([_sample(plain)]))
    rendered = tok.apply_chat_template(plain, tokenize=False)
    assert alone["input_ids"].tolist() == tok(rendered, add_special_tokens=False)["input_ids"]
    # beside an image, every <image> is a placeholder: one more than images is refused
    image = _messages("<image>\nIs <image> a tag?", "Yes.")
    assert list(stage(iter([_sample(image, images=[(64, 48)])]))) == []
    assert stats.counts == {"image_count_mismatch": 1}


def _old_dataset(folder) -> str:
    """A dataset as the writer lays one out, whose text-only records hold literal tags (the
    writer used to refuse them; a tar made elsewhere and indexed could hold them)."""
    folder.mkdir()
    with tarfile.open(folder / "data-000000.tar", "w") as tar:
        for i, messages in enumerate(
            [_messages(), _messages("Is <image> a tag?", "Yes, <image> and <video> are.")]
        ):
            data = json.dumps({"id": f"k{i}", "source": "old", "messages": messages}).encode()
            info = tarfile.TarInfo(f"{i:09d}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    index_tars(str(folder), format="wdsvlm", show_progress=False)
    return str(folder)


@pytest.mark.parametrize("family", ["tiling", "llava_onevision", "qwen2_vl"])
def test_a_dataset_written_before_with_literal_tags_loads_them_as_text(tmp_path, family):
    """Each sample comes, none is skipped (it used to be skipped, ``video_count_mismatch``
    and ``image_count_mismatch``), and no image or video token stands for nothing: the
    LLaVA-OneVision tokenizer has ``<image>`` and ``<video>`` as tokens of their own."""
    data = _old_dataset(tmp_path / "old")
    if family == "tiling":
        options = {"tokenizer": TOKENIZER, "tile_size": 32, "max_image_side": 64}
        tokenizer = Tokenize(TOKENIZER).tokenizer
        specials = {tokenizer.convert_tokens_to_ids("<image>")}
    else:
        from wdsvlm.testing.tiny import tiny_processor

        processor = tiny_processor(family)
        options = {"processor": processor}
        tokenizer = processor.tokenizer
        specials = {getattr(processor, "image_token_id", None)}
        specials |= {getattr(processor, "video_token_id", None)} - {None}
    loader = wdsvlm.Loader(data, **SETTINGS, **options)
    seen, texts = set(), []
    for batch in loader:
        ids = batch["input_ids"]
        assert not np.isin(ids.numpy(), list(specials)).any(), family
        for row, keys in enumerate(batch["sample_keys"]):
            seen |= set(keys)
            labels = batch["labels"][row]
            texts.append(tokenizer.decode(ids[row][labels != IGNORE_INDEX]))
    assert loader.stats()["skipped"] == {}
    assert seen == {"data-000000.tar/000000000", "data-000000.tar/000000001"}
    assert any(ANSWER in t for t in texts) and any("<image> and <video>" in t for t in texts)


def _stripping_tokenizer(folder, lstrip: bool, rstrip: bool) -> str:
    """The example tokenizer with its ``<image>`` token stripping the whitespace beside it
    (``AddedToken(lstrip=..., rstrip=...)``, as many published tokenizers have it): that
    token's offsets then take in the spaces and newlines around the marker."""
    folder.mkdir()
    with open(os.path.join(TOKENIZER, "tokenizer.json")) as f:
        spec = json.load(f)
    (image,) = [t for t in spec["added_tokens"] if t["content"] == "<image>"]
    image.update(lstrip=lstrip, rstrip=rstrip)
    with open(folder / "tokenizer.json", "w") as f:
        json.dump(spec, f)
    with open(os.path.join(TOKENIZER, "tokenizer_config.json")) as f:
        (folder / "tokenizer_config.json").write_text(f.read())
    return str(folder)


@pytest.mark.parametrize("lstrip, rstrip", [(True, False), (False, True), (True, True)])
def test_a_literal_tag_is_text_with_a_tokenizer_whose_image_token_strips_spaces(
    tmp_path, lstrip, rstrip
):
    """Through such a tokenizer a literal ``<image>`` of a text-only sample is tokenized as
    its text, spaces and newlines kept, and the sample is trained on (not skipped as
    ``image_count_mismatch``); written and loaded end to end, the same."""
    folder = _stripping_tokenizer(tmp_path / "tokenizer", lstrip, rstrip)
    stats = SkipStats()
    stage = Tokenize(folder, stats=stats)
    tok = stage.tokenizer
    question = "Is <image> a tag?\n<image>\nx<image>y " + QUESTION
    out = list(stage(iter([_sample(_messages(question))])))
    assert stats.counts == {} and len(out) == 1
    ids, labels = out[0]["input_ids"], out[0]["labels"]
    assert stage.image_token_id not in ids
    assert question in tok.decode(ids)
    assert tok.decode(ids[labels != IGNORE_INDEX]) == ANSWER + "<|im_end|>"
    data = _old_dataset(tmp_path / "old")
    loader = wdsvlm.Loader(data, folder, tile_size=32, max_image_side=64, **SETTINGS)
    batches = list(loader)
    keys = [k for batch in batches for row in batch["sample_keys"] for k in row]
    assert not any((batch["input_ids"] == stage.image_token_id).any() for batch in batches)
    assert loader.stats()["skipped"] == {}
    assert set(keys) == {"data-000000.tar/000000000", "data-000000.tar/000000001"}
