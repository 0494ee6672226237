"""The writer on Ray: a real local Ray instance (and a `ray start` cluster joined by address),
in a network namespace of its own that holds only loopback, so Ray and moto listen on
127.0.0.1 and nowhere else; usage statistics off, session files in a folder removed after,
no process left. The Ray side runs in tests/ray_job.py; here its output is compared with the
local writer's."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

import wdsvlm
from wdsvlm.write.tarindex import index_tars

from .conftest import command_lines, run_process, write_jsonl
from .test_tarindex import SMALL, TOKENIZER, one_pass, tree_digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = {"samples_per_shard": 2}
pytestmark = pytest.mark.processes


def in_private_network(args: list[str], timeout: float):
    """``args`` in a new network namespace with only loopback up (root, or a user namespace
    mapped to root where unprivileged namespaces are allowed); killed past ``timeout``."""
    for tool in ("unshare", "ip"):
        assert shutil.which(tool), f"{tool} (util-linux, iproute2) is needed to fence Ray in"
    wrap = ["unshare", "--net"] + ([] if os.geteuid() == 0 else ["--map-root-user"])
    wrap += ["sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    return run_process(wrap + args, timeout, cwd=ROOT)


def noisy_jpeg(path: str, seed: int) -> str:
    img = Image.effect_noise((160 + seed % 5 * 10, 120), 40 + seed).convert("RGB")
    img.save(path, format="JPEG", quality=90)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The inputs: JSON records with image files, a Parquet file with embedded images, a bad
    JSON input, and samples for Ray's own write_webdataset; with the local writer's output."""
    work = tmp_path_factory.mktemp("ray")
    images = work / "images"
    images.mkdir()
    records, rows, webdataset = [], [], []
    for i in range(40):
        path = noisy_jpeg(str(images / f"{i}.jpg"), i)
        question = f"<image>\nWhat is in picture {i}?"
        answer = f"Noise, number {i}."
        record = {
            "id": f"r{i}",
            "source": "noise",
            "image": f"{i}.jpg",
            "conversations": [
                {"from": "human", "value": question},
                {"from": "gpt", "value": answer},
            ],
        }
        records.append(record)
        data = open(path, "rb").read()
        rows.append(
            {
                "images": [{"bytes": data, "path": None}],
                "texts": [{"user": f"Picture {i}?", "assistant": answer, "source": "noise"}],
            }
        )
        if i < 10:
            doc = {"conversations": record["conversations"]}
            webdataset.append({"key": f"{i:09d}", "json": json.dumps(doc), "images": {"jpg": path}})
    json_input = write_jsonl(str(work / "records.jsonl"), records)
    parquet_input = str(work / "rows.parquet")
    pq.write_table(pa.Table.from_pylist(rows), parquet_input, row_group_size=6)
    bad = [dict(r, image=r["image"]) for r in records[:5]]
    bad[3] = dict(bad[3], image="missing.jpg")
    bad_input = write_jsonl(str(images / "bad.jsonl"), bad)
    spec = {
        "json": json_input,
        "parquet": parquet_input,
        "bad": bad_input,
        "image_root": str(images),
        "options": OPTIONS,
        "cli_options": ["--samples-per-shard", "2"],
        "webdataset": webdataset,
    }
    (work / "inputs.json").write_text(json.dumps(spec))
    local = {}
    for kind, path in (("json", json_input), ("parquet", parquet_input)):
        out = str(work / f"local-{kind}")
        wdsvlm.write_dataset(
            path, out, image_root=str(images), workers=2, progress=False, **OPTIONS
        )
        local[kind] = tree_digest(out)
    return work, spec, local


def run_job(work, case: str, limit: float = 300, module: str = "tests.ray_job") -> dict:
    """``python -m MODULE CASE WORK`` in a loopback-only network namespace: what it found.
    It must leave no Ray session files behind."""
    before = set(os.listdir("/tmp"))
    sessions = set(os.listdir("/tmp/ray")) if os.path.isdir("/tmp/ray") else set()
    args = [sys.executable, "-m", module, case, str(work), str(limit - 20)]
    result = in_private_network(args, limit)
    assert result.returncode == 0, f"{case}:\n{result.stdout[-3000:]}\n{result.stderr[-8000:]}"
    left = [n for n in set(os.listdir("/tmp")) - before if n.startswith("wdsvlm-ray-")]
    assert not left, f"Ray session files left behind: {left}"
    now = set(os.listdir("/tmp/ray")) if os.path.isdir("/tmp/ray") else set()
    assert now <= sessions, f"Ray session files left in /tmp/ray: {sorted(now - sessions)}"
    return json.load(open(os.path.join(work, f"{case}.json")))


@pytest.fixture(scope="module")
def suite(inputs):
    work, _, _ = inputs
    return run_job(work, "suite")


def test_ray_writes_the_local_writers_bytes_for_any_number_of_workers(inputs, suite):
    _, _, local = inputs
    assert local["json"]["index.json"]  # 20 shards, their sidecars, the table and the index
    assert len(local["json"]) == 42 and len(local["parquet"]) == 42
    for cpus in (1, 2):
        assert suite[f"ray{cpus}-json"] == local["json"], cpus
        assert suite[f"ray{cpus}-parquet"] == local["parquet"], cpus
    assert suite["ray-dataset"] == local["json"]  # a ray.data.Dataset of the same records
    assert suite["s3"] == local["json"]  # straight into a bucket
    assert suite["ray-http"] == local["json"]  # the images fetched over http by the tasks
    assert suite["cli-workers"] == [0, local["json"]]  # --engine ray --workers 2
    assert suite["cli-address"] == [0, local["json"]]  # --ray-address of a running cluster


def test_ray_spreads_shards_over_prefix_folders_as_the_local_writer(inputs, suite):
    work, spec, _ = inputs
    local = str(work / "local-prefixes")
    wdsvlm.write_dataset(
        spec["json"], local, image_root=spec["image_root"], prefixes=4, progress=False, **OPTIONS
    )
    found = {}
    for folder, _, names in os.walk(local):
        for name in names:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, local)] = hashlib.sha256(
                open(path, "rb").read()
            ).hexdigest()
    assert "4/data-000001.tar" in found and "c/data-000019.idx" in found
    assert suite["ray-prefixes"] == found


def test_bad_input_on_ray_is_named_or_skipped_and_listed(suite):
    assert "1 of 5 input records are bad" in suite["bad-error"]
    assert "bad.jsonl line 4 (id 'r3'): image file" in suite["bad-error"]
    assert "missing.jpg not found" in suite["bad-error"]
    assert suite["bad-skipped"] == {"missing_image": 1}
    listed = [json.loads(line) for line in suite["bad-listed"].splitlines()]
    assert [b["where"] for b in listed] == ["bad.jsonl line 4 (id 'r3')"]


def test_tars_of_ray_write_webdataset_are_indexed_and_read_as_wdsvlm_write_would(
    inputs, suite, tmp_path
):
    work, spec, _ = inputs
    tars = str(work / "rwds")
    names = [n for n in os.listdir(tars) if n.endswith(".tar")]
    assert len(names) == 1
    out = str(tmp_path / "index")
    summary = index_tars(tars, output=out, show_progress=False)
    assert summary.layout == "conversations" and summary.samples == 10
    records = [json.loads(line) for line in open(spec["json"])][:10]
    for n, r in enumerate(records):
        r["id"] = f"{n:09d}"
    ref = str(tmp_path / "ref")
    wdsvlm.write_dataset(
        write_jsonl(str(tmp_path / "r.jsonl"), records),
        ref,
        image_root=spec["image_root"],
        progress=False,
    )
    assert sorted(one_pass(out)[1]) == [f"{n:09d}" for n in range(10)]  # each once a pass
    left, right = batches(out), batches(ref)  # the same batches, but for the shard's name
    assert len(left) == len(right) > 0
    for (t1, k1), (t2, k2) in zip(left, right, strict=True):
        assert k1 == k2
        assert t1.keys() == t2.keys() and all(torch.equal(t1[k], t2[k]) for k in t1)


def batches(source) -> list[tuple[dict, list]]:
    """Every tensor of each batch of an epoch, and its samples' keys without shard names."""
    out = []
    for batch in wdsvlm.Loader(source, TOKENIZER, **SMALL):
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        out.append((tensors, [[k.rsplit("/", 1)[-1] for k in row] for row in batch["sample_keys"]]))
    return out


def test_a_worker_killed_mid_write_is_run_again_and_the_output_is_the_same(inputs):
    work, _, local = inputs
    found = run_job(work, "kill_worker")
    assert found["killed"], "no Ray worker was caught writing a shard: nothing was tested"
    assert found["shards"] == 20
    assert found["s3"] == local["json"]


def test_ray_leaves_no_process_behind(suite):
    assert_no_ray_process()


def assert_no_ray_process() -> None:
    left = [
        cmdline[:120]
        for cmdline in command_lines().values()
        if b"wdsvlm-ray-" in cmdline or cmdline.startswith(b"ray::")
    ]
    assert not left, left
