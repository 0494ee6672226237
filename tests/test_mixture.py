"""Mixtures: exact per-source counts per pass on any topology, keys and sources in every
batch, mixture files, exact resume mid-pass and after several passes, stats and inspect."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

import wdsvlm
from wdsvlm import Source

from .conftest import run_cli
from .test_ddp import SETTINGS, TOKENIZER, digest, write_uneven


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("mix"))
    for name in ("a", "b"):
        os.makedirs(os.path.join(tmp, "img", name))
    big = write_uneven(
        os.path.join(tmp, "vqa"), [9, 2, 14, 1, 6, 11, 4], os.path.join(tmp, "img", "a")
    )
    small = write_uneven(os.path.join(tmp, "ocr"), [5, 8, 3], os.path.join(tmp, "img", "b"))
    return big, small


def run(sources, epochs, rank=0, world=1, workers=0, **extra):
    """Batches of ``epochs`` epochs: per batch, its ``(pass, source, key)`` and digest."""
    loader = wdsvlm.Loader(
        sources,
        TOKENIZER,
        rank=rank,
        world_size=world,
        num_workers=workers,
        **{**SETTINGS, **extra},
    )
    seen, digests, states = [], [], []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            for keys, passes, names in zip(
                batch["sample_keys"], batch["sample_passes"], batch["sample_sources"], strict=True
            ):
                seen += list(zip(passes, names, keys, strict=True))
            digests.append(digest(batch))
            states.append(loader.state_dict())
    return loader, seen, digests, states


@pytest.mark.processes
def test_a_pass_holds_exactly_each_sources_share_on_every_topology(datasets):
    vqa, ocr = datasets
    sources = [Source(vqa, repeat=2.0), Source(ocr, repeat=0.5)]
    by_topology = {}
    for world, workers in [(1, 0), (1, 2), (2, 2)]:
        seen = []
        for rank in range(world):
            loader, got, _, _ = run(sources, 3, rank, world, workers)
            seen += got
        by_topology[(world, workers)] = seen
        for name, _, key in [(n, p, k) for p, n, k in seen]:
            assert key.startswith(name + "/")  # SOURCE/SHARD/KEY
        for p in (0, 1):  # passes over after 3 epochs
            counts = Counter(key for q, _, key in seen if q == p)
            per_source = Counter(name for q, name, _ in seen if q == p)
            assert per_source == {"vqa": 94, "ocr": 8}, (world, workers, p)
            vqa_counts = {k: n for k, n in counts.items() if k.startswith("vqa/")}
            assert len(vqa_counts) == 47 and set(vqa_counts.values()) == {2}
            assert set(counts.values()) <= {1, 2}
    plans = {
        t: [Counter((p, key) for p, _, key in seen if p in (0, 1))]
        for t, seen in by_topology.items()
    }
    assert len({json.dumps(sorted(v[0].items())) for v in plans.values()}) == 1
    # the half of ocr in pass 0 and the other half in pass 1: the extra copies rotate
    ocr_keys = [{k for p, n, k in by_topology[(1, 0)] if p == q and n == "ocr"} for q in (0, 1)]
    assert not ocr_keys[0] & ocr_keys[1] and len(ocr_keys[0] | ocr_keys[1]) == 16


def test_a_mixture_file_is_the_same_mixture(datasets, tmp_path):
    vqa, ocr = datasets
    folder = os.path.dirname(vqa)
    spec = {"sources": [{"path": "vqa", "repeat": 2.0}, {"path": "ocr", "choose": 8}]}
    as_json = os.path.join(folder, "mix.json")
    with open(as_json, "w") as f:
        json.dump(spec, f)
    as_yaml = os.path.join(folder, "mix.yaml")
    with open(as_yaml, "w") as f:
        f.write("sources:\n  - {path: vqa, repeat: 2.0}\n  - path: ocr\n    choose: 8\n")
    listed = run([Source(vqa, repeat=2.0), Source(ocr, choose=8)], 1)[2]
    assert run(as_json, 1)[2] == listed
    assert run(as_yaml, 1)[2] == listed

    def refused(text, match):
        path = str(tmp_path / "bad.yaml")
        with open(path, "w") as f:
            f.write(text)
        with pytest.raises(ValueError, match=match):
            wdsvlm.Loader(path, TOKENIZER, **SETTINGS)

    refused(
        f"sources:\n  - {{path: {vqa}, repaet: 2}}\n",
        r"bad.yaml: source 0: unknown fields \['repaet'\]",
    )
    refused("sources:\n  - {repeat: 2}\n", "bad.yaml: source 0 needs a path")
    refused(
        f"sources:\n  - {{path: {vqa}, weight: 1}}\n  - {{path: {ocr}}}\n",
        "weight= for every source or for none",
    )
    refused("sources: [\n", "bad.yaml: not a valid mixture file")


def test_weights_split_samples_per_pass(datasets):
    vqa, ocr = datasets
    sources = [Source(vqa, weight=3, name="v"), Source(ocr, weight=1, name="o")]
    loader, seen, _, _ = run(sources, 2, samples_per_pass=40)
    assert loader.plan.num_samples == 40
    assert Counter(n for p, n, _ in seen if p == 0) == {"v": 30, "o": 10}
    # stats(): the shares of the samples the last epoch's batches held, per source
    last = Counter(n for _, n, _ in seen[-loader.stats()["samples"] :])
    assert loader.stats()["sources"] == {n: k / sum(last.values()) for n, k in last.items()}


@pytest.mark.processes
def test_exact_resume_of_a_mixture_mid_pass_and_after_several_passes(datasets):
    vqa, ocr = datasets
    sources = [Source(vqa, repeat=0.5), Source(ocr, repeat=2.0)]
    loader, _, digests, states = run(sources, 4, workers=2)
    length = len(loader)
    for k in (2, length + length // 2, 3 * length - 1):
        resumed = wdsvlm.Loader(sources, TOKENIZER, num_workers=2, **SETTINGS)
        resumed.load_state_dict(states[k - 1])
        got = []
        for epoch in range(states[k - 1]["epoch"], 4):
            resumed.set_epoch(epoch)
            got += [digest(b) for b in resumed]
        assert got == digests[k:], f"after step {k}"


def test_stats_and_inspect_of_a_mixture_file(datasets):
    vqa, _ = datasets
    folder = os.path.dirname(vqa)
    path = os.path.join(folder, "for-cli.yaml")
    with open(path, "w") as f:
        f.write("sources:\n  - {path: vqa, repeat: 0.5, name: v}\n  - {path: ocr, name: o}\n")
    stats = run_cli("stats", path, "--tokenizer", TOKENIZER, "--max-length", "256", "--json", "-q")
    assert stats.returncode == 0, stats.stderr
    found = json.loads(stats.stdout)
    assert found["samples"] == 24 + 16
    assert {k: v["planned"] for k, v in found["sources"].items()} == {"v": 24, "o": 16}
    assert sum(v["read"] for v in found["sources"].values()) == 40
    table = run_cli("stats", path, "--tokenizer", TOKENIZER, "--max-length", "256", "-q")
    assert "source v  " in table.stdout and "24 a pass, 24 read" in table.stdout
    shown = run_cli("inspect", path, "-n", "1", "-q")
    assert shown.returncode == 0, shown.stderr
    assert "v/p" in shown.stdout and "o/p" in shown.stdout


def test_a_mixture_of_an_index_version_1_and_a_version_2_dataset(datasets):
    vqa, _ = datasets
    from .conftest import EXAMPLE

    assert wdsvlm.load_index(EXAMPLE)["version"] == 1 and wdsvlm.load_index(vqa)["version"] == 2
    sources = [Source(EXAMPLE, repeat=0.5, name="ex"), Source(vqa, repeat=2.0)]
    loader, seen, _, _ = run(sources, 3, max_length=1024)
    assert not loader.stats()["dropped"]
    for p in (0, 1):
        counts = Counter(key for q, _, key in seen if q == p)
        assert Counter(name for q, name, _ in seen if q == p) == {"vqa": 94, "ex": 160}
        assert set(counts.values()) == {1, 2}
    halves = [{k for q, n, k in seen if q == p and n == "ex"} for p in (0, 1)]
    assert not halves[0] & halves[1] and len(halves[0] | halves[1]) == 320  # the halves rotate
