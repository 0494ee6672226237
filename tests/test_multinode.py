"""Several nodes, simulated on one machine: two torchrun launches of 2 ranks each (2 workers a
rank), rendezvous on 127.0.0.1, reading a dataset on S3 (a moto server) through one proxy a
node that counts the bytes it serves, with one shard cache a node (tests/multinode_job.py)."""

from __future__ import annotations

import json
import os
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import EXAMPLE, REPO, run_process
from .faults import FaultProxy

JOB = os.path.join(REPO, "tests", "multinode_job.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], store: dict) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "GLOO_SOCKET_IFNAME": "lo",  # the ranks talk over loopback only
        "WDSVLM_TEST_STORE": json.dumps(store),
    }
    run = run_process([TORCHRUN, *args], timeout=480, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_two_nodes_read_every_sample_once_fetch_each_byte_at_most_once_a_node_and_resume_on_one(
    s3_bucket, moto_server, tmp_path
):
    import s3fs

    url, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    shards = {}
    for name in sorted(os.listdir(EXAMPLE)):
        if name.endswith((".tar", ".json", ".idx")):
            fs.put(os.path.join(EXAMPLE, name), f"{url}/ds/{name}")
            if name.endswith(".tar"):
                shards[f"/{url[5:]}/ds/{name}"] = os.path.getsize(os.path.join(EXAMPLE, name))
    upstream = int(moto_server.rsplit(":", 1)[1])
    proxies = [FaultProxy(upstream), FaultProxy(upstream)]
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    try:

        def node(rank: int) -> None:
            store = {
                "url": f"{url}/ds",
                "endpoint": proxies[rank].endpoint,
                "cache_dir": str(tmp_path / f"cache-node-{rank}"),
            }
            launch(
                [
                    "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=2",
                    f"--rdzv-endpoint=127.0.0.1:{port}", JOB, str(out), "train",
                ],
                store,
            )  # fmt: skip

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(node, [0, 1]))
        served = [dict(p.served) for p in proxies]
        store = {"url": f"{url}/ds", "endpoint": moto_server, "cache_dir": str(tmp_path / "c3")}
        launch(["--standalone", "--nproc_per_node=3", JOB, str(out), "resume"], store)
    finally:
        for p in proxies:
            p.close()
    # each node fetched the parts of each shard its 4 workers read, each byte at most once
    for rank in (0, 1):
        got = {path: served[rank].get(path, 0) for path in shards}
        assert all(0 < got[p] <= shards[p] for p in shards), f"node {rank}: {got} of {shards}"
    train = [json.load(open(out / f"train-{r}.json")) for r in range(4)]
    every = sorted(k for k in keys_of_example())
    lengths = {t["len"] for t in train}
    assert lengths == {8} and all(len(t["batches"]) == 16 for t in train)
    pass_0 = [k for t in train for batch in t["batches"] for p, k in batch if p == 0]
    assert sorted(pass_0) == every  # over the 4 ranks of 2 nodes, every sample once
    # resumed onto 1 node of 3 ranks from the states after batch 3: the rest of pass 0 once
    resumed = [json.load(open(out / f"resume-{r}.json")) for r in range(3)]
    before = [k for t in train for batch in t["batches"][:3] for p, k in batch if p == 0]
    after = [k for r in resumed for batch in r["batches"] for p, k in batch if p == 0]
    assert sorted(before + after) == every


def keys_of_example() -> list[str]:
    index = json.load(open(os.path.join(EXAMPLE, "index.json")))
    return [f"{s['name']}/{e['key']}" for s in index["shards"] for e in s["entries"]]
