"""Loader(map=, image_map=): the user's own steps. A filter and a text augmentation over passes,
on any number of workers and across a resume; pixels edited, a changed size refused; errors
skipped with their key and traceback line, or raised."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import sys
import tarfile
import types
from collections import Counter

import numpy as np
import pytest
import torch

import wdsvlm
from wdsvlm.errors import WdsvlmError

from .conftest import REPO, run_process

DATA = os.path.join(REPO, "shards_example")
SMALL = dict(
    max_length=1024,
    batch_size=2,
    tile_size=64,
    max_image_side=128,
    tokens_per_tile=4,
    shuffle_buffer=64,
    pack_window=64,
)
DROPPED = "shapes_text"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def sources() -> dict[str, str]:
    """ "SHARD/KEY" -> the record's source, read from the tars."""
    found = {}
    for path in sorted(glob.glob(os.path.join(DATA, "*.tar"))):
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    record = json.loads(tar.extractfile(member).read())
                    key = member.name.removesuffix(".json")
                    found[f"{os.path.basename(path)}/{key}"] = record["source"]
    return found


def augment(sample, rng):
    """Drops one source; tags every user turn with a number drawn from rng."""
    if sample["source"] == DROPPED:
        return None
    for message in sample["messages"]:
        if message["role"] == "user":
            message["content"] += f" [tag {rng.integers(10**9)}]"
    return sample


def loader(**extra) -> wdsvlm.Loader:
    return wdsvlm.Loader(DATA, os.path.join(DATA, "tokenizer"), **{**SMALL, **extra})


def samples_of(batch: dict, tokenizer) -> list[tuple[str, int, str]]:
    """(key, pass, text) of each packed sample, split where its position ids restart."""
    out = []
    for row, keys in enumerate(batch["sample_keys"]):
        starts = torch.nonzero(batch["position_ids"][row] == 0).flatten().tolist()
        ends = starts[1:] + [batch["position_ids"].shape[1]]
        for i, key in enumerate(keys):
            ids = batch["input_ids"][row, starts[i] : ends[i]]
            out.append((key, batch["sample_passes"][row][i], tokenizer.decode(ids)))
    return out


def run(data_loader, epochs: int) -> list[tuple[str, int, str]]:
    taken = []
    for epoch in range(epochs):
        data_loader.set_epoch(epoch)
        for batch in data_loader:
            taken += samples_of(batch, data_loader.tokenizer)
    return taken


def tags(text: str) -> list[str]:
    return re.findall(r"\[tag (\d+)\]", text)


@pytest.fixture(scope="module")
def two_passes():
    return run(loader(map=augment), epochs=3)


def test_a_filter_keeps_every_other_sample_exactly_once_per_pass(two_passes):
    by_source = sources()
    kept = sorted(k for k, s in by_source.items() if s != DROPPED)
    for pass_ in (0, 1):
        keys = Counter(k for k, p, _ in two_passes if p == pass_)
        assert sorted(keys) == kept and set(keys.values()) == {1}
    assert not [k for k, _, _ in two_passes if by_source[k] == DROPPED]


@pytest.mark.processes
def test_the_augmentation_draws_per_pass_and_place(two_passes):
    text = {(k, p): t for k, p, t in two_passes}
    pairs = [(text[k, 0], text[k, 1]) for k, p in text if p == 0 and (k, 1) in text]
    assert len(pairs) > 200
    assert all(tags(a) and len(tags(a)) == len(tags(b)) for a, b in pairs)
    differ = sum(tags(a) != tags(b) for a, b in pairs)
    assert differ == len(pairs)  # another pass, other draws
    # the same draws on another topology: two workers take the same text for each sample
    workers = run(loader(map=augment, num_workers=2), epochs=2)
    again = {(k, p): t for k, p, t in workers if p == 0}
    assert again and all(text[kp] == t for kp, t in again.items())


def test_a_resumed_loader_takes_the_same_augmented_text(two_passes):
    first = loader(map=augment)
    first.set_epoch(1)
    batches = iter(first)
    for _ in range(5):
        next(batches)
    state = first.state_dict()
    rest = [b["input_ids"] for b in batches]
    first.set_epoch(2)
    rest += [b["input_ids"] for b in first]
    resumed = loader(map=augment)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    again = [b["input_ids"] for b in resumed]
    resumed.set_epoch(2)
    again += [b["input_ids"] for b in resumed]
    assert len(again) == len(rest)
    assert all(torch.equal(a, b) for a, b in zip(again, rest, strict=True))


def blackout(pixels, rng):
    pixels[:] = 0
    return pixels


def noise(pixels, rng):
    return np.clip(pixels + rng.integers(-20, 21, pixels.shape), 0, 255).astype(np.uint8)


def crop(pixels, rng):
    return pixels[1:]


def first_batch(**extra) -> dict:
    return next(iter(loader(**extra)))


def test_image_map_edits_each_image_before_it_is_resized():
    plain, dark = first_batch(), first_batch(image_map=blackout)
    assert plain["pixel_values"].shape == dark["pixel_values"].shape
    assert plain["pixel_values"].any() and not dark["pixel_values"].any()
    assert torch.equal(plain["input_ids"], dark["input_ids"])
    noisy = [first_batch(image_map=noise)["pixel_values"] for _ in range(2)]
    assert torch.equal(noisy[0], noisy[1]) and not torch.equal(noisy[0], plain["pixel_values"])


def test_an_image_map_that_changes_the_size_is_an_error_naming_the_sample():
    with pytest.raises(WdsvlmError, match=r"image_map crop made image 0 of shapes-\d+\.tar/\d+"):
        first_batch(image_map=crop)


def fails_on_vqa(sample, rng):
    if sample["source"] == "shapes_vqa":
        return sample["no such field"]
    return sample


def fails_on_some_images(pixels, rng):
    if rng.random() < 0.2:
        raise ValueError("a bad image")
    return pixels


def test_an_exception_skips_the_sample_with_its_key_and_traceback_line(caplog):
    data_loader = loader(map=fails_on_vqa)
    with caplog.at_level(logging.WARNING):
        keys = [k for b in data_loader for row in b["sample_keys"] for k in row]
    stats = data_loader.stats()
    assert stats["skipped"]["map_error"] >= 101  # every shapes_vqa sample, once per pass read
    by_source = sources()
    assert all(by_source[k] == "shapes_vqa" for k in stats["skipped_examples"]["map_error"])
    assert not [k for k in keys if by_source[k] == "shapes_vqa"]
    logged = [r.getMessage() for r in caplog.records if "map_error" in r.getMessage()]
    assert re.search(
        r"map fails_on_vqa raised on shapes-\d+\.tar/\d+: KeyError: 'no such field' "
        r"\(at .*test_map\.py:\d+ in fails_on_vqa: return sample\[\"no such field\"\]\)",
        logged[0],
    )
    images = loader(image_map=fails_on_some_images)
    for _ in images:
        pass
    assert images.stats()["skipped"]["map_error"] > 0


def test_an_exception_raises_when_asked_naming_the_sample():
    with pytest.raises(WdsvlmError, match=r"map fails_on_vqa raised on shapes-\d+\.tar/\d+"):
        for _ in loader(map=fails_on_vqa, map_errors="raise"):
            pass


def test_a_map_the_workers_cannot_get_is_refused_at_once():
    with pytest.raises(ValueError, match="cannot be pickled.*top level of a module"):
        loader(map=lambda sample, rng: sample, num_workers=1)
    with pytest.raises(ValueError, match='map_errors must be "skip" or "raise"'):
        loader(map=augment, map_errors="ignore")
    with pytest.raises(ValueError, match="image_map must be a function"):
        loader(image_map=3)


def test_a_negative_seed_seeds_the_map_as_any_other():
    # the seed is hashed, as the pass's order hashes it: a negative one is a seed like another
    taken = {}
    for seed in (-1, -1, 5):
        data_loader = loader(map=augment, image_map=noise, seed=seed, batches_per_epoch=4)
        batches = list(data_loader)
        assert set(data_loader.stats()["skipped"]) == {"filtered"}  # augment's drops alone
        taken.setdefault(seed, []).append(batches)
    runs = taken[-1]
    assert all(
        torch.equal(a[name], b[name])
        for a, b in zip(*runs, strict=True)
        for name in ("input_ids", "pixel_values")
    )
    assert not torch.equal(runs[0][0]["input_ids"], taken[5][0][0]["input_ids"])


def content_as_list(sample, rng):
    """A mistake of the map's: shapes_vqa's messages with list content."""
    if sample["source"] == "shapes_vqa":
        for message in sample["messages"]:
            message["content"] = [message["content"]]
    return sample


def test_messages_a_map_spoils_are_its_error_and_broken_json_is_still_invalid_json(tmp_path):
    data = shutil.copytree(DATA, tmp_path / "data", ignore=shutil.ignore_patterns("tokenizer"))
    shard = os.path.join(data, "shapes-000000.tar")
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(".json"))
    raw = bytearray(open(shard, "rb").read())
    raw[member.offset_data] = ord("#")  # the record's first byte: its JSON no longer parses
    open(shard, "wb").write(bytes(raw))
    broken = f"shapes-000000.tar/{member.name.removesuffix('.json')}"
    spoiled = wdsvlm.Loader(
        str(data), os.path.join(DATA, "tokenizer"), map=content_as_list, **SMALL
    )
    for _ in spoiled:
        pass
    stats = spoiled.stats()
    by_source = sources()
    assert stats["skipped"]["map_error"] >= 101  # every shapes_vqa sample, once per pass read
    assert {by_source[k] for k in stats["skipped_examples"]["map_error"]} == {"shapes_vqa"}
    assert set(stats["skipped_examples"]["invalid_json"]) == {broken}
    with pytest.raises(WdsvlmError, match=r"map content_as_list returned .*shapes-\d+\.tar/\d+"):
        for _ in loader(map=content_as_list, map_errors="raise"):
            pass


MAIN_MAPS = """
import functools, os, sys
import wdsvlm

DATA = sys.argv[1]
SMALL = dict(max_length=1024, batch_size=2, tile_size=64, max_image_side=128,
             tokens_per_tile=4, shuffle_buffer=64, pack_window=64, batches_per_epoch=2)

def in_main(sample, rng):
    return sample

class Jitter:
    def __call__(self, pixels, rng):
        return pixels

def build(**extra):
    try:
        data_loader = wdsvlm.Loader(DATA, os.path.join(DATA, "tokenizer"), **SMALL, **extra)
    except ValueError as e:
        print("refused:", e, flush=True)
        return None
    print("built", flush=True)
    return data_loader

build(map=in_main, num_workers=1)
build(image_map=Jitter(), num_workers=1, multiprocessing_context="spawn")
build(map=functools.partial(in_main), num_workers=1)
build(map=lambda sample, rng: sample, num_workers=1)
build(map=in_main)
forked = build(map=in_main, image_map=lambda pixels, rng: pixels, num_workers=1,
               multiprocessing_context="fork")
print("batches", len(list(forked)), flush=True)
"""


@pytest.mark.processes
def test_a_function_of_a_notebook_is_refused_at_build_with_the_fix():
    # python -c: a __main__ without a file, as in a notebook, that spawn and fork server
    # workers cannot import; fork workers inherit it, and no workers need nothing
    out = run_process(
        [sys.executable, "-c", MAIN_MAPS, DATA], timeout=240, env={**os.environ, **OFFLINE}
    )
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert len(lines) == 7, out.stdout
    fixes = r"num_workers=0.*multiprocessing_context=\"fork\""
    assert re.match(rf"refused: map=in_main is defined in __main__ .*{fixes}", lines[0])
    assert "forkserver" in lines[0] and "a module" in lines[0]
    assert re.match(rf"refused: image_map=.*Jitter.* __main__.*'spawn'.*{fixes}", lines[1])
    assert re.match(rf"refused: map=functools.partial.* uses __main__.in_main.*{fixes}", lines[2])
    assert re.match(rf"refused: map=<lambda> cannot be pickled.*{fixes}", lines[3])
    assert lines[4:] == ["built", "built", "batches 2"]


def test_the_check_follows_what_workers_can_import(monkeypatch):
    from wdsvlm.pipeline.usermap import check_workers_get

    notebook = types.ModuleType("__main__")  # no file, as a notebook's
    exec("def fn(sample, rng):\n    return sample\n", notebook.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    fn = notebook.fn
    with pytest.raises(ValueError, match="map=fn is defined in __main__"):
        check_workers_get(fn, "map", "forkserver")
    check_workers_get(fn, "map", "fork")  # fork workers inherit it
    check_workers_get(augment, "map", "spawn")  # a module's: imported by name
    notebook.__file__ = "/somewhere/train.py"  # a script's: workers import it again
    check_workers_get(fn, "map", "spawn")
