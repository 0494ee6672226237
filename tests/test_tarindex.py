"""`wdsvlm index` on WebDataset tars written by other tools: webdataset's ShardWriter in the
captions layout, LLaVA conversations in JSON, hand-made tars with odd keys and bad members.
The tars are never rewritten, and the Loader over them gives every good sample once per pass
and the same batches as the same data written by `wdsvlm write`."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile

import pytest
import webdataset as wds
from PIL import Image

import wdsvlm
from wdsvlm.errors import BadInputError
from wdsvlm.format.layouts import (
    TEXT_SUFFIXES,
    BadSample,
    Layout,
    find_member,
    split_name,
)
from wdsvlm.format.members import media_members
from wdsvlm.write.tarindex import index_tars

from .conftest import EXAMPLE, make_image, run_cli, write_jsonl
from .test_ddp import digest

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"max_length": 512, "batch_size": 2, "tile_size": 64, "max_image_side": 128}


def tree_digest(folder) -> dict:
    return {
        name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
        for name in sorted(os.listdir(folder))
    }


def one_pass(source, **options) -> tuple[list[str], list[str]]:
    """The digests of two epochs' batches, and the keys read in pass 0 (over by then: an
    epoch's last samples may wait in the packer for the next)."""
    loader = wdsvlm.Loader(source, TOKENIZER, **{**SMALL, **options})
    digests, keys = [], []
    for epoch in range(2):
        loader.set_epoch(epoch)
        for batch in loader:
            digests.append(digest(batch))
            for row, passes in zip(batch["sample_keys"], batch["sample_passes"], strict=True):
                keys += [k.rsplit("/", 1)[-1] for k, p in zip(row, passes, strict=True) if p == 0]
    return digests, keys


def caption_records(tmp_path, n=20):
    """``n`` captioned images: their bytes, captions and the LLaVA records wdsvlm write takes
    for the same conversations (the prompts the captions layout picks for each key)."""
    root = tmp_path / "images"
    root.mkdir()
    layout = Layout("captions")
    samples, records = [], []
    for i in range(n):
        key = f"{i:09d}"
        fmt, ext = ("PNG", "png") if i % 4 == 3 else ("JPEG", "jpg")
        path = make_image(str(root / f"{i}.{ext}"), (60 + 7 * i, 40 + 5 * i), fmt, seed=i)
        caption = (f"picture {i}: " + "a yellow disc beside a green bar " * (1 + i % 3)).strip()
        samples.append({"__key__": key, ext: open(path, "rb").read(), "txt": caption})
        user = "<image>\n" + layout.prompt(key)
        records.append(
            {
                "id": key,
                "image": f"{i}.{ext}",
                "conversations": [
                    {"from": "human", "value": user},
                    {"from": "gpt", "value": caption},
                ],
            }
        )
    return samples, records, str(root)


@pytest.fixture
def captions(tmp_path):
    """The same data twice: tars of webdataset's ShardWriter in the captions layout (with an
    img2dataset-style metadata json member), and `wdsvlm write`'s dataset."""
    samples, records, root = caption_records(tmp_path)
    tars = tmp_path / "tars"
    tars.mkdir()
    with wds.ShardWriter(str(tars / "data-%06d.tar"), maxcount=8, verbose=0) as sink:
        for s in samples:
            sink.write({**s, "json": {"url": "http://example.invalid/x", "width": 1}})
    ref = str(tmp_path / "ref")
    wdsvlm.write_dataset(
        write_jsonl(str(tmp_path / "records.jsonl"), records),
        ref,
        image_root=root,
        samples_per_shard=8,
        progress=False,
    )
    return str(tars), ref, [s["__key__"] for s in samples]


@pytest.mark.processes
def test_shardwriter_captions_are_indexed_in_place_and_read_as_wdsvlm_write_would(captions):
    tars, ref, keys = captions
    before = tree_digest(tars)
    result = run_cli("index", tars, "--workers", "2", "-q")
    assert result.returncode == 0, result.stderr
    assert "layout captions (detected: an image member" in result.stdout
    assert "indexed 20 samples (20 images) in 3 shards" in result.stdout
    after = tree_digest(tars)
    assert {n: d for n, d in after.items() if n.endswith(".tar")} == before  # not a byte moved
    sidecars = (n[:-4] + ".idx" for n in before)
    index = json.load(open(os.path.join(tars, "index.json")))
    assert sorted(after) == sorted([*before, "index.json", index["table"]["name"], *sidecars])
    assert index["layout"]["name"] == "captions" and index["version"] == 3
    assert run_cli("verify", tars).returncode == 0

    got, got_keys = one_pass(tars)
    want, _ = one_pass(ref)
    assert got == want  # the same batches, bit for bit
    assert sorted(got_keys) == keys  # every sample once per pass
    bench = run_cli(
        "bench", tars, "--tokenizer", TOKENIZER, "--max-length", "512", "--workers", "0",
        "--batch-size", "4", "--tile-size", "64", "--max-image-side", "128", "--json", "-q",
    )  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    result = json.loads(bench.stdout)  # the naive side reads the captions layout too
    assert result["naive"]["samples"] == 20 and result["wdsvlm"]["samples"] >= 20


def test_the_index_goes_to_output_when_the_tars_place_is_not_to_be_written(captions, tmp_path):
    tars, ref, keys = captions
    before = tree_digest(tars)
    out = str(tmp_path / "index-elsewhere")
    summary = index_tars(tars, output=out, format="captions", show_progress=False)
    assert summary.samples == 20 and summary.detected is None
    assert tree_digest(tars) == before  # nothing written beside the tars
    assert json.load(open(os.path.join(out, "index.json")))["shard_root"] == tars
    got, got_keys = one_pass(out)
    assert got == one_pass(ref)[0] and sorted(got_keys) == keys
    assert run_cli("verify", out).returncode == 0
    shown = run_cli("inspect", out, "--key", keys[3], "--out", str(tmp_path / "sheet"))
    assert shown.returncode == 0, shown.stderr
    assert Layout("captions").prompt(keys[3]) in shown.stdout
    # a relative path to the tars is kept absolute in the index, read from anywhere
    elsewhere = str(tmp_path / "relative")
    relative = os.path.relpath(tars)
    index_tars(relative, output=elsewhere, format="captions", show_progress=False)
    assert json.load(open(os.path.join(elsewhere, "index.json")))["shard_root"] == tars
    # an index there already is kept unless asked to replace it
    with pytest.raises(wdsvlm.errors.DatasetExistsError):
        index_tars(tars, output=out, show_progress=False)


def test_prompts_are_the_users_and_picked_per_key_by_a_seeded_hash(captions, tmp_path):
    tars, _, keys = captions
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Caption this.\nSay what you see.\n\n")
    out = str(tmp_path / "idx")
    args = ["index", tars, "--output", out, "--prompts", str(prompts), "--prompt-seed", "7"]
    assert run_cli(*args, "-q").returncode == 0
    layout = Layout.from_dict(json.load(open(os.path.join(out, "index.json")))["layout"])
    assert layout.prompts == ("Caption this.", "Say what you see.") and layout.seed == 7
    picks = [layout.prompt(k) for k in keys]
    assert set(picks) == set(layout.prompts)  # both used over 20 keys
    assert picks == [Layout("captions", prompts=layout.prompts, seed=7).prompt(k) for k in keys]
    assert picks != [Layout("captions", prompts=layout.prompts, seed=8).prompt(k) for k in keys]
    samples = wdsvlm.tools.samples.inspect_samples(out, keys=[keys[0]])
    assert samples[0].messages[0]["content"] == "<image>\n" + picks[0]


def member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def jpeg(size, seed=0, **save) -> bytes:
    out = io.BytesIO()
    img = Image.new("RGB", size, (40 + seed, 120, 200))
    img.save(out, format="JPEG", **save)
    return out.getvalue()


def test_keys_follow_webdataset():
    assert split_name("000000005.edited.jpg") == ("000000005", "edited.jpg")
    assert split_name("a/b/c.0.JPG") == ("a/b/c", "0.JPG")
    assert split_name("noext") == ("noext", "")


def image_suffixes(suffixes):
    return list(media_members(suffixes).images)


def test_a_members_part_is_its_last_extension_where_no_member_is_named_plainly():
    assert image_suffixes(["edited.jpg", "edited.txt", "edited.json"]) == ["edited.jpg"]
    assert image_suffixes(["jpg", "edited.jpg"]) == ["jpg"]  # the plain one is the image
    assert image_suffixes(["1.png", "0.jpg", "edited.png"]) == ["0.jpg", "1.png"]
    assert find_member(["edited.TXT", "jpg"], TEXT_SUFFIXES, "text") == "edited.TXT"
    assert find_member(["edited.txt", "txt"], TEXT_SUFFIXES, "text") == "txt"
    assert find_member(["a.caption", "b.txt"], TEXT_SUFFIXES, "text") == "b.txt"  # txt first
    assert find_member(["jpg", "txt"], ("json",), "json") is None
    for suffixes, names, kind in (
        (["a.jpg", "b.png", "txt"], None, "images"),
        (["a.txt", "b.txt", "jpg"], TEXT_SUFFIXES, "text"),
        (["a.json", "b.json", "jpg"], ("json",), "json"),
    ):
        with pytest.raises(BadSample) as e:
            image_suffixes(suffixes) if names is None else find_member(suffixes, names, kind)
        assert e.value.reason == f"ambiguous_{kind}" and "a." in str(e.value)


@pytest.fixture
def odd_tars(tmp_path):
    """Hand-made caption tars: a key with an extra dotted member, upper-case extensions, an
    EXIF-rotated image, a sample without its text, one whose image header does not parse,
    one whose image body is cut (its header parses), and a tar whose last member is cut."""
    folder = tmp_path / "odd"
    folder.mkdir()
    rotated = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # turned 90 degrees: displayed 30 x 50
    Image.new("RGB", (50, 30), (200, 10, 10)).save(rotated, format="JPEG", exif=exif)
    noisy = io.BytesIO()
    Image.effect_noise((256, 256), 60).convert("RGB").save(noisy, format="JPEG")
    cut_body = noisy.getvalue()  # about 40 kB: its half ends deep in the scan data
    with tarfile.open(folder / "part-0.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        member(tar, "000000005.jpg", jpeg((40, 30), 1))
        member(tar, "000000005.edited.jpg", jpeg((8, 8), 2))  # key 000000005, not its image
        member(tar, "000000005.txt", b"a blue square")
        member(tar, "shouting.JPG", jpeg((33, 21), 4))
        member(tar, "shouting.TXT", b"upper-case extensions")
        member(tar, "turned.jpg", rotated.getvalue())
        member(tar, "turned.caption", b"a red image, turned")
        member(tar, "notext.jpg", jpeg((20, 20), 5))
        member(tar, "badimage.png", b"\x89PNG not really")
        member(tar, "badimage.txt", b"broken")
        member(tar, "cutbody.jpg", cut_body[: len(cut_body) // 2])
        member(tar, "cutbody.txt", b"the second half is missing")
    with tarfile.open(folder / "part-1.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        member(tar, "later.jpg", jpeg((24, 24), 6))
        member(tar, "later.txt", b"fine")
        member(tar, "last.txt", b"its image is cut")
        member(tar, "last.jpg", jpeg((90, 90), 7))
    with tarfile.open(folder / "part-1.tar") as tar:
        last = tar.getmember("last.jpg")
    data = (folder / "part-1.tar").read_bytes()
    (folder / "part-1.tar").write_bytes(data[: last.offset_data + last.size // 2])
    return str(folder)


def test_bad_samples_stop_the_index_unless_skipped_and_are_listed(odd_tars):
    with pytest.raises(BadInputError) as e:
        index_tars(odd_tars, format="captions", show_progress=False)
    message = str(e.value)
    assert "3 of 8 samples are bad; no index.json was written" in message
    assert "part-0.tar key notext: no caption member" in message
    assert "(missing_text)" in message
    assert "part-0.tar key badimage: image jpg" not in message  # its image is a png
    assert "part-0.tar key badimage: image png:" in message and "(unreadable_image)" in message
    assert "part-1.tar key last: " in message and "(truncated_tar)" in message
    assert not os.path.exists(os.path.join(odd_tars, "index.json"))
    assert not [n for n in os.listdir(odd_tars) if n.endswith(".idx")]

    result = run_cli("index", odd_tars, "--skip-bad", "-q")
    assert result.returncode == 0, result.stderr
    assert "layout captions" in result.stdout
    assert "skipped 3 (missing_text: 1, truncated_tar: 1, unreadable_image: 1)" in result.stdout
    listed = [json.loads(line) for line in open(os.path.join(odd_tars, "index-skipped.jsonl"))]
    assert {(b["shard"], b["key"], b["reason"]) for b in listed} == {
        ("part-0.tar", "notext", "missing_text"),
        ("part-0.tar", "badimage", "unreadable_image"),
        ("part-1.tar", "last", "truncated_tar"),
    }
    index = wdsvlm.format.index.load_index(odd_tars)
    entries = {e["key"]: e for s in index["shards"] for e in s["entries"]}
    assert sorted(entries) == ["000000005", "cutbody", "later", "shouting", "turned"]
    assert entries["000000005"]["images"] == [[40, 30]]  # the bare jpg, not edited.jpg
    assert entries["shouting"]["images"] == [[33, 21]]
    assert entries["turned"]["images"] == [[30, 50]]  # EXIF orientation applied
    assert index["totals"]["skipped"] == {
        "missing_text": 1,
        "truncated_tar": 1,
        "unreadable_image": 1,
    }

    # the Loader: every good sample once per pass; the image cut mid-body is skipped, counted
    loader = wdsvlm.Loader(odd_tars, TOKENIZER, **SMALL)
    keys = [k.rsplit("/", 1)[-1] for b in loader for row in b["sample_keys"] for k in row]
    stats = loader.stats()  # the epoch reads on into pass 1 for its last batch: 1 or 2 times
    assert set(stats["skipped"]) == {"undecodable_image"}
    assert {k.rsplit("/", 1)[-1] for k in stats["skipped_examples"]["undecodable_image"]} == {
        "cutbody"
    }
    assert set(keys) <= {"000000005", "later", "shouting", "turned"}
    assert sorted(one_pass(odd_tars)[1]) == ["000000005", "later", "shouting", "turned"]


def test_dotted_members_play_the_part_of_their_last_extension(tmp_path):
    """``KEY.edited.jpg``, ``KEY.edited.txt``, ``KEY.edited.json``: webdataset's key is
    ``KEY`` and its decoders go by the last extension; with no plain ``jpg``/``txt``/``json``
    beside them they are the sample's image, caption and conversation. Two members that could
    each be the one are still refused."""
    samples, records, root = caption_records(tmp_path, n=8)
    captions = tmp_path / "captions"
    captions.mkdir()
    with tarfile.open(captions / "data-000000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for sample in samples:
            key = sample["__key__"]
            ext = "png" if "png" in sample else "jpg"
            member(tar, f"{key}.edited.{ext}", sample[ext])
            member(tar, f"{key}.edited.txt", sample["txt"].encode())
            member(tar, f"{key}.edited.json", b'{"url": "http://example.invalid/x"}')
        member(tar, "twoimages.a.jpg", jpeg((20, 20)))
        member(tar, "twoimages.b.jpg", jpeg((20, 20)))
        member(tar, "twoimages.txt", b"which picture?")
        member(tar, "twotexts.jpg", jpeg((20, 20)))
        member(tar, "twotexts.a.txt", b"one caption")
        member(tar, "twotexts.b.txt", b"another")
    summary = index_tars(str(captions), skip_bad=True, show_progress=False)
    assert summary.layout == "captions" and "edited." in summary.detected
    assert summary.samples == 8
    assert summary.skipped == {"ambiguous_images": 1, "ambiguous_text": 1}
    ref = str(tmp_path / "captions-ref")
    records_file = write_jsonl(str(tmp_path / "captions.jsonl"), records)
    wdsvlm.write_dataset(records_file, ref, image_root=root, progress=False)
    got, keys = one_pass(str(captions))
    assert got == one_pass(ref)[0]  # the same batches as the same data written by wdsvlm
    assert sorted(keys) == [s["__key__"] for s in samples]

    conversations = tmp_path / "conversations"
    conversations.mkdir()
    with tarfile.open(conversations / "data-000000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for record, sample in zip(records, samples, strict=True):
            image = record["image"]
            doc = {"conversations": record["conversations"]}
            member(tar, f"{record['id']}.edited.json", json.dumps(doc).encode())
            member(tar, f"{record['id']}.edited.{image.rsplit('.', 1)[1]}", sample[image[-3:]])
    summary = index_tars(str(conversations), show_progress=False)
    assert summary.layout == "conversations" and summary.samples == 8 and not summary.skipped
    got, keys = one_pass(str(conversations))
    assert got == one_pass(ref)[0]
    assert sorted(keys) == [r["id"] for r in records]


def test_conversations_in_json_with_numbered_images_read_as_wdsvlm_write_would(tmp_path):
    """LLaVA, Cauldron and `messages` JSON members beside numbered images (0.jpg, 1.png)."""
    root = tmp_path / "images"
    root.mkdir()
    records, tars = [], tmp_path / "conv"
    tars.mkdir()
    with tarfile.open(tars / "data-000000.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(9):
            key = f"{i:09d}"
            n_images = i % 3  # text-only, one image, two images
            names = [f"{i}-{n}.{'png' if n else 'jpg'}" for n in range(n_images)]
            for n, name in enumerate(names):
                make_image(str(root / name), (50 + 9 * i, 40 + 3 * n), "PNG" if n else "JPEG", i)
            question = "<image>" * n_images + f"What is shown in {i}?"
            answer = f"Shapes, number {i}."
            if i % 2:
                doc = {
                    "conversations": [
                        {"from": "human", "value": question},
                        {"from": "gpt", "value": answer},
                    ]
                }
            else:
                parts = [{"type": "image"}] * n_images + [
                    {"type": "text", "text": f"What is shown in {i}?"}
                ]
                doc = {
                    "messages": [
                        {"role": "user", "content": parts},
                        {"role": "assistant", "content": [{"type": "text", "text": answer}]},
                    ]
                }
            member(tar, f"{key}.json", json.dumps(doc).encode())
            for n, name in enumerate(names):
                member(tar, f"{key}.{n}.{name.rsplit('.', 1)[1]}", (root / name).read_bytes())
            records.append(
                {
                    "id": key,
                    "images": names,
                    "conversations": [
                        {"from": "human", "value": question},
                        {"from": "gpt", "value": answer},
                    ],
                }
            )
    summary = index_tars(str(tars), show_progress=False)
    assert summary.layout == "conversations" and "'messages'" in summary.detected
    ref = str(tmp_path / "ref")
    records_file = write_jsonl(str(tmp_path / "r.jsonl"), records)
    wdsvlm.write_dataset(records_file, ref, image_root=str(root), progress=False)
    got, keys = one_pass(str(tars))
    assert got == one_pass(ref)[0]
    assert sorted(keys) == [r["id"] for r in records]


def test_a_brace_pattern_on_s3_is_indexed_into_the_bucket(captions, s3_bucket):
    import fsspec

    tars, ref, keys = captions
    url, options = s3_bucket
    fs = fsspec.filesystem("s3", **options)
    for name in sorted(os.listdir(tars)):
        fs.put_file(os.path.join(tars, name), f"{url}/tars/{name}"[5:])
    summary = index_tars(
        f"{url}/tars/data-{{000000..000002}}.tar",
        storage_options=options,
        workers=2,
        show_progress=False,
    )
    assert summary.layout == "captions" and summary.samples == 20
    got, got_keys = one_pass(f"{url}/tars", storage_options=options)
    assert got == one_pass(ref)[0] and sorted(got_keys) == keys


@pytest.mark.processes
def test_wdsvlm_tars_copied_without_their_index_are_indexed_and_read_as_before(tmp_path):
    """shards_example's tars alone: `auto` finds wdsvlm's own layout, and the Loader, stats
    and verify read them as they read the dataset with the index it was written with."""
    folder = tmp_path / "copied"
    folder.mkdir()
    for name in sorted(os.listdir(EXAMPLE)):
        if name.endswith(".tar"):
            shutil.copy(os.path.join(EXAMPLE, name), folder / name)
    result = run_cli("index", str(folder), "--workers", "2", "-q")
    assert result.returncode == 0, result.stderr
    assert "layout wdsvlm (detected: a json member with wdsvlm's" in result.stdout
    original = wdsvlm.format.index.load_index(EXAMPLE)
    indexed = wdsvlm.format.index.load_index(str(folder))
    for a, b in zip(original["shards"], indexed["shards"], strict=True):
        assert (a["name"], a["bytes"], a["sha256"]) == (b["name"], b["bytes"], b["sha256"])
        assert list(a["entries"]) == list(b["entries"])
    options = {"batches_per_epoch": 6, "max_length": 1024}
    assert one_pass(str(folder), **options)[0] == one_pass(EXAMPLE, **options)[0]
    args = ["--tokenizer", TOKENIZER, "--max-length", "1024", "--limit", "40", "-q"]
    stats = run_cli("stats", str(folder), *args)
    assert stats.returncode == 0 and "samples" in stats.stdout, stats.stderr


def test_a_tar_cut_between_members_or_corrupt_midway_loses_no_sample_silently(tmp_path):
    """tarfile stops quietly at a cut on a header boundary or at a header that does not parse:
    the scan still sees that the tar has no end, and says which samples it could not index."""
    folder = tmp_path / "cut"
    folder.mkdir()

    def write(name, members):
        with tarfile.open(folder / name, "w", format=tarfile.USTAR_FORMAT) as tar:
            for member_name, data in members:
                member(tar, member_name, data)
        with tarfile.open(folder / name) as tar:
            return {i.name: i for i in tar.getmembers()}, (folder / name).read_bytes()

    three = [
        (f"{k}.{s}", jpeg((20, 20)) if s == "jpg" else b"text")
        for k in "abc"
        for s in ("jpg", "txt")
    ]
    infos, data = write("cut.tar", three)
    (folder / "cut.tar").write_bytes(data[: infos["c.txt"].offset])  # c.jpg whole, c.txt gone
    infos, data = write("corrupt.tar", three)
    broken = bytearray(data)
    broken[infos["b.jpg"].offset + 148 : infos["b.jpg"].offset + 156] = b"9999999\0"  # checksum
    (folder / "corrupt.tar").write_bytes(bytes(broken))
    write("nosuffix.tar", [("README", b"not a sample"), *three[:2]])
    summary = index_tars(str(folder), format="captions", skip_bad=True, show_progress=False)
    listed = [json.loads(line) for line in open(folder / "index-skipped.jsonl")]
    found = {(b["shard"], b["key"], b["reason"]) for b in listed}
    assert ("cut.tar", "c", "truncated_tar") in found  # not taken for a caption without text
    assert ("corrupt.tar", "a", "truncated_tar") in found  # it may lack members after the cut
    assert any(
        s == "corrupt.tar" and r == "corrupt_tar" and k.startswith("(from byte ")
        for s, k, r in found
    )
    assert ("nosuffix.tar", "README", "bad_member") in found
    index = wdsvlm.format.index.load_index(str(folder))
    kept = {s["name"]: [e["key"] for e in s["entries"]] for s in index["shards"]}
    assert kept == {"corrupt.tar": [], "cut.tar": ["a", "b"], "nosuffix.tar": ["a"]}
    assert summary.samples == 3
