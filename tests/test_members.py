"""A sample's media members are found by one rule (``format.members``) wherever they are looked
for: the writer's names, ``wdsvlm index`` and the reader agree, so what the index records of a
sample is what the Loader reads of it. A bare ``KEY.mp4`` or ``KEY.jpg`` beside ``KEY.json``
works end to end."""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest

import wdsvlm
from wdsvlm.format.images import KEPT_FORMATS, image_members
from wdsvlm.format.layouts import BadSample
from wdsvlm.format.members import (
    IMAGE,
    VIDEO,
    VIDEO_EXTENSIONS,
    media_kind,
    media_members,
    media_name,
)
from wdsvlm.format.videos import video_members
from wdsvlm.write.tarindex import index_tars

from .conftest import EXAMPLE, make_image

SETTINGS = {"max_length": 1024, "batch_size": 2, "shuffle_buffer": 4, "pack_window": 8}


def _tar(path, samples: dict[str, dict[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, members in samples.items():
            for suffix, data in members.items():
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _record(key: str, question: str) -> bytes:
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"Answer {key}."},
    ]
    return json.dumps({"id": key, "source": "here", "messages": messages}).encode()


def _first_pass_keys(loader) -> list[str]:
    return sorted(
        k
        for batch in loader
        for row, passes in zip(batch["sample_keys"], batch["sample_passes"], strict=True)
        for k, p in zip(row, passes, strict=True)
        if p == 0
    )


@pytest.mark.parametrize("layout", ["auto", "wdsvlm"])
def test_a_bare_video_beside_its_json_is_indexed_and_loaded_end_to_end(tmp_path, videos, layout):
    """``k0.json`` (wdsvlm's own record) beside a bare ``k0.mp4``: the index records one
    video, and the Loader reads it (it used to drop every such sample after packing it,
    ``undecodable_video``: "0 video members, the index lists 1")."""
    from wdsvlm.testing.qwen import qwen_processor

    tars = tmp_path / "tars"
    tars.mkdir()
    names = ["fps24", "fps25"]
    samples = {
        f"k{i}": {"json": _record(f"k{i}", "<video>\nWhat moves?"), "mp4": videos[name][1]}
        for i, name in enumerate(names)
    }
    _tar(tars / "clips-000000.tar", samples)
    index_tars(str(tars), format=layout, show_progress=False)
    assert wdsvlm.load_index(str(tars))["totals"]["videos"] == len(names)
    loader = wdsvlm.Loader(str(tars), processor=qwen_processor("qwen2_vl"), **SETTINGS)
    keys = _first_pass_keys(loader)
    assert loader.stats()["skipped"] == {}
    assert keys == [f"clips-000000.tar/k{i}" for i in range(len(names))]


def test_a_bare_image_beside_a_wdsvlm_json_is_indexed_and_loaded_as_its_own_layout(tmp_path):
    """In wdsvlm's own layout a bare ``KEY.jpg`` is the sample's image, as in img2dataset's
    tars (``KEY.jpg`` + ``KEY.json`` + ``KEY.txt``, the captions layout); it used to be
    refused at index time (``bad_layout``) though the conversations layout read it."""
    tars = tmp_path / "tars"
    tars.mkdir()
    samples = {}
    for i in range(3):
        make_image(str(tmp_path / "a.jpg"), (64 + 8 * i, 48), "JPEG", seed=i)
        image = (tmp_path / "a.jpg").read_bytes()
        samples[f"k{i}"] = {"json": _record(f"k{i}", "<image>\nWhat is it?"), "jpg": image}
    _tar(tars / "pics-000000.tar", samples)
    summary = index_tars(str(tars), format="wdsvlm", show_progress=False)
    assert (summary.samples, summary.images, summary.skipped) == (3, 3, {})
    tokenizer = os.path.join(EXAMPLE, "tokenizer")
    options = {"tile_size": 32, "max_image_side": 64, "tokens_per_tile": 4}
    loader = wdsvlm.Loader(str(tars), tokenizer=tokenizer, **SETTINGS, **options)
    keys = _first_pass_keys(loader)
    assert loader.stats()["skipped"] == {}
    assert keys == [f"pics-000000.tar/k{i}" for i in range(3)]


def test_what_the_writer_names_the_index_and_the_reader_read_as_the_same_media():
    # every member name the writer gives a medium is that medium's kind, in its order
    for ext in {*KEPT_FORMATS.values(), "png"}:
        assert media_kind(media_name(3, ext)) == IMAGE
    for ext in VIDEO_EXTENSIONS:
        assert media_kind(media_name(3, ext)) == VIDEO
    for suffixes, images, videos in (
        (["json", "0.jpg", "1.mp4", "2.PNG", "10.webm", "3.frames"], ["0.jpg", "2.PNG"], None),
        (["json", "mp4"], [], ["mp4"]),
        (["json", "jpg", "txt"], ["jpg"], []),
        (["json", "jpg", "mp4"], ["jpg"], ["mp4"]),
        (["json", "edited.jpg", "clip.mkv"], ["edited.jpg"], ["clip.mkv"]),
        (["json", "0.txt", "1.json"], [], []),  # numbered, but no media
    ):
        media = media_members(suffixes)
        sample = {"__key__": "k", "__meta__": {}, **dict.fromkeys(suffixes, b"")}
        assert list(media.images) == image_members(sample) == images, suffixes
        if videos is not None:
            assert list(media.videos) == video_members(sample) == videos, suffixes
    assert video_members({s: b"" for s in ["1.mp4", "10.webm", "3.frames"]}) == [
        "1.mp4",
        "3.frames",
        "10.webm",
    ]


@pytest.mark.parametrize(
    "suffixes, reason",
    [
        (["mp4", "0.mp4"], "ambiguous_videos"),
        (["mp4", "mkv"], "ambiguous_videos"),
        (["a.mp4", "b.webm"], "ambiguous_videos"),
        (["0.jpg", "0.png"], "ambiguous_images"),
        (["jpg", "1.jpg"], "ambiguous_images"),
    ],
)
def test_members_the_rule_cannot_tell_apart_are_refused_at_index_time_by_name(
    tmp_path, suffixes, reason
):
    """``wdsvlm index`` names the sample and the members; the reader, handed such a sample
    (its tar changed since), finds none of that kind, and counts it against its index."""
    with pytest.raises(BadSample, match=r"\[") as e:
        media_members(["json", *suffixes])
    assert e.value.reason == reason
    tars = tmp_path / "tars"
    tars.mkdir()
    members = {"json": _record("k0", "Hi?"), **dict.fromkeys(suffixes, b"\0" * 8)}
    _tar(tars / "odd-000000.tar", {"k0": members, "k1": {"json": _record("k1", "Hi?")}})
    summary = index_tars(str(tars), format="wdsvlm", skip_bad=True, show_progress=False)
    assert summary.skipped == {reason: 1}
    listed = (tars / "index-skipped.jsonl").read_text()
    assert "k0" in listed and suffixes[0] in listed
    kind = IMAGE if reason == "ambiguous_images" else VIDEO
    read = image_members if kind == IMAGE else video_members
    assert read(members) == []
