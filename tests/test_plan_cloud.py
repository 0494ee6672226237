"""wdsvlm plan-cloud: the planner's figures on a small dataset, and a real pass of a Loader over
a counting store that agrees with them."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace

import pytest

import wdsvlm
from wdsvlm.format.index import load_index
from wdsvlm.testing.stores import range_server
from wdsvlm.tools.cli import main
from wdsvlm.tools.cloud_plan import JobShape, described, from_index, plan_cloud

from .conftest import EXAMPLE, REPO, photo, write_jsonl

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"tile_size": 128, "max_image_side": 256, "tokens_per_tile": 16}
SPAN, BLOCK = 32_000, 8192  # chunks of 5 samples of about 6 kB, read in 4 GETs each


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """240 samples of one photo each (about 6 kB), 40 to a shard: 6 shards, index version 3."""
    folder = tmp_path_factory.mktemp("plan-cloud")
    records = []
    for i in range(240):
        path = str(folder / f"{i}.jpg")
        photo(64 + (i % 5) * 16, 64, i).save(path, quality=90)
        question = {"from": "human", "value": f"<image>\nWhat is {i}?"}
        answer = {"from": "gpt", "value": "A photo. " * (1 + i % 4)}
        records.append({"id": f"r{i}", "image": path, "conversations": [question, answer]})
    out = str(folder / "data")
    wdsvlm.write_dataset(
        write_jsonl(str(folder / "in.jsonl"), records), out, samples_per_shard=40, progress=False
    )
    return out


def job(workers: int, sizing: bool = True, span: int = SPAN) -> JobShape:
    return JobShape(1, 1, workers, span_bytes=span, block_bytes=BLOCK, sizing=sizing)


def test_the_plan_of_a_small_dataset_counts_its_chunks_requests_sidecars_and_start_up(dataset):
    shape = from_index(dataset)
    assert (shape.shards, shape.size, shape.prefixes) == (6, 240, 1)
    alone = plan_cloud(shape, job(0))["pass"]
    # 8 chunks of 5 samples a shard, none across shards; 29.6 kB each (3.6 blocks of 8 kB,
    # a few past 4 blocks): 4.06 GETs a chunk
    assert (alone["chunk_samples"], alone["spans"], alone["span_requests"]) == (5, 48, 195)
    sizes = sum(sum(shard["entries"].loaded().size) for shard in load_index(dataset)["shards"])
    assert near(alone["span_bytes"], sizes, 0.001)  # the tars' ends left out
    assert alone["sidecar_requests"] == 0  # the rank's sizing read all 6 sidecars already
    two = plan_cloud(shape, job(2))["pass"]
    assert (two["spans"], two["span_requests"]) == (49, 199)  # the visit the cut falls in
    assert two["sidecar_requests"] == 0  # the node's copies, fetched by the rank's sizing
    unsized = plan_cloud(shape, job(2, sizing=False))["pass"]
    assert unsized["sidecar_requests"] == 6  # the node's copy of each, read by both workers
    uncopied = plan_cloud(shape, replace(job(2), local_bytes=0))["pass"]
    assert uncopied["sidecar_requests"] == 12  # each worker reads each from the store
    start = plan_cloud(shape, job(0))["startup_per_node"]
    # index.json and the table; the sizing: 6 sidecars and every 7th sample (35 of 240)
    assert start["requests"] == 2 + 6 + 35
    assert plan_cloud(shape, job(0, sizing=False))["startup_per_node"]["requests"] == 2


def test_the_command_prints_the_plan_as_text_and_json_with_the_prefixes_that_fit(capsys):
    described_by = ["--samples", "1000000000", "--bytes", "100TB", "--shards", "100000"]
    assert main(["plan-cloud", *described_by, "--nodes", "128", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    limit = plan["prefix_limit"]
    assert plan["job"]["gpus"] == 1024 and limit["exceeded"]
    assert plan["rates"]["busiest_prefix_requests_per_second"] > limit["limit"]
    needed = limit["prefixes_needed"]
    again = ["--nodes", "128", "--prefixes", str(needed), "--json"]
    assert main(["plan-cloud", *described_by, *again]) == 0
    spread = json.loads(capsys.readouterr().out)
    assert not spread["prefix_limit"]["exceeded"]
    assert spread["rates"]["busiest_prefix_requests_per_second"] <= limit["limit"]
    fit = limit["span_fit"]
    assert fit["busiest_prefix_requests_per_second"] <= limit["limit"]
    assert main(["plan-cloud", *described_by, "--nodes", "128"]) == 0
    text = capsys.readouterr().out
    assert "EXCEEDED" in text and f"--prefixes {needed}" in text
    assert "$0.0004 per 1,000" in text


def test_a_command_without_a_dataset_says_what_to_give(capsys):
    assert main(["plan-cloud", "--samples", "1000"]) == 2
    assert "--samples, --bytes and --shards" in capsys.readouterr().err


def counted(server) -> dict[str, int]:
    """What the store sent so far: shard GETs and bytes, sidecar GETs and bytes, index GETs."""
    by_kind = {"tar": [0, 0], "idx": [0, 0], "index": [0, 0]}
    for name, start, stop in server.sent_ranges:
        kind = "index" if name.startswith("index") else name.rsplit(".", 1)[-1]
        by_kind[kind][0] += 1
        by_kind[kind][1] += stop - start
    return {
        f"{kind}_{what}": by_kind[kind][i]
        for kind in by_kind
        for i, what in enumerate(("gets", "bytes"))
    } | {"heads": server.heads}


def near(measured: float, predicted: float, within: float = 0.1) -> bool:
    return abs(measured - predicted) <= within * predicted


@pytest.mark.parametrize(
    "workers, span",
    [(0, SPAN), pytest.param(2, SPAN, marks=pytest.mark.processes), (0, 44_000)],
)
def test_a_real_pass_over_a_counting_store_agrees_with_the_plan_within_10_percent(
    dataset, workers, span, tmp_path
):
    """The Loader's start-up reads, and its requests and bytes a pass (shards: the mean of
    passes 1 to 3, counted between the first batches that hold a sample of each; sidecars:
    the first pass, the node's copies cold: the 6 sidecars once, as the 2 workers share the
    node's copy of each), as the planner predicts them, within 10%. Chunks of 7 samples
    (``span=44_000``) run across the shards' boundaries (40 samples a shard)."""
    shape = from_index(dataset)
    options = {"max_length": 512, "batch_size": 2, "span_bytes": span, "num_workers": workers}
    options |= {"read_policy": wdsvlm.ReadPolicy(block_bytes=BLOCK), "shuffle_buffer": 8, **SMALL}
    with range_server(dataset) as server:  # sized: index, table, sidecars, samples
        wdsvlm.Loader(server.url, TOKENIZER, local_dir=str(tmp_path / "sized"), **options)
        start = counted(server)
    predicted = plan_cloud(shape, job(workers, span=span))["startup_per_node"]
    assert near(start["index_gets"] + start["idx_gets"] + start["tar_gets"], predicted["requests"])
    assert near(start["index_bytes"] + start["idx_bytes"] + start["tar_bytes"], predicted["bytes"])

    plan = plan_cloud(shape, job(workers, sizing=False, span=span))["pass"]
    with range_server(dataset) as server:
        options |= {"local_dir": str(tmp_path / "node"), "batches_per_epoch": 10_000}
        loader = wdsvlm.Loader(server.url, TOKENIZER, **options)
        marks = {}
        for batch in loader:
            newest = max(p for passes in batch["sample_passes"] for p in passes)
            marks.setdefault(newest, counted(server))
            if newest == 4:
                break
        loader.close()
    first, last = marks[1], marks[4]
    shard_gets = (last["tar_gets"] - first["tar_gets"]) / 3
    shard_bytes = (last["tar_bytes"] - first["tar_bytes"]) / 3
    sidecars = first["idx_gets"], first["idx_bytes"]
    figures = f"shards {shard_gets} GETs {shard_bytes} B, sidecars {sidecars}; plan {plan}"
    assert near(shard_gets, plan["span_requests"]), figures
    assert near(shard_bytes, plan["span_bytes"]), figures
    assert sidecars[0] == plan["sidecar_requests"] == 6, figures
    assert near(sidecars[1], plan["sidecar_bytes"]), figures
    assert near(shard_gets + sidecars[0], plan["requests"]), figures
    assert near(shard_bytes + sidecars[1], plan["bytes"]), figures
    assert last["heads"] == 0
    print(f"start-up {start}, predicted {predicted}; {figures}")


def test_the_cloud_page_gives_the_planners_figures_for_8_128_and_1024_gpus():
    page = open(os.path.join(REPO, "docs", "cloud.md")).read()
    shape = described(10**9, 100 * 2**40, 100_000)
    for gpus in (8, 128, 1024):
        plan = plan_cloud(shape, JobShape(nodes=gpus // 8))
        rate = plan["rates"]["requests_per_second"]
        row = re.search(rf"^\| {gpus:,} \|.*$", page, re.M)
        assert row and f"{rate:,.0f}" in row.group(0), (gpus, rate)


def test_a_dataset_written_over_prefixes_spreads_the_requests_over_them(tmp_path):
    """The prefixes of an index are its shards' folders (``write --prefixes``): each takes the
    requests of its shards, and the busiest no more than its share."""
    question = {"from": "human", "value": "Say a word."}
    records = [
        {"id": f"r{i}", "conversations": [question, {"from": "gpt", "value": "word " * (i + 1)}]}
        for i in range(40)
    ]
    out = str(tmp_path / "data")
    source = write_jsonl(str(tmp_path / "in.jsonl"), records)
    wdsvlm.write_dataset(source, out, samples_per_shard=5, prefixes=4, progress=False)
    shape = from_index(out)
    assert (shape.shards, shape.prefixes) == (8, 4)
    plan = plan_cloud(shape, JobShape(nodes=1, gpus_per_node=1, workers=0))
    assert plan["pass"]["busiest_prefix_share"] == pytest.approx(0.25, abs=0.05)
    rates = plan["rates"]
    busiest = rates["busiest_prefix_requests_per_second"]
    assert busiest == pytest.approx(
        rates["requests_per_second"] * plan["pass"]["busiest_prefix_share"]
    )


def test_an_index_scaled_to_its_own_size_plans_as_the_index_itself(dataset, capsys):
    """SOURCE with --samples and --shards: the written sample's sizes, scaled; scaled to its
    own size, the same pass as the index's own plan."""
    shape = ["--nodes", "1", "--gpus-per-node", "1", "--workers", "2", "--span-bytes", "32000"]
    shape += ["--block-bytes", "8192", "--json"]
    assert main(["plan-cloud", dataset, *shape]) == 0
    own = json.loads(capsys.readouterr().out)["pass"]
    assert main(["plan-cloud", dataset, "--samples", "240", "--shards", "6", *shape]) == 0
    scaled = json.loads(capsys.readouterr().out)["pass"]
    assert scaled == own
