"""The Loader under real DDP: 2 ranks (torch.multiprocessing, gloo, CPU), each with real
DataLoader workers. Equal steps, every sample once per pass, exact resume, topology checks,
and faults that end in a clear error instead of a hang."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image

import wdsvlm
from wdsvlm.format.index import shard_summary, sidecar_entry
from wdsvlm.format.sidecar import pack_entries, sidecar_name

from .conftest import EXAMPLE, write_jsonl

pytestmark = pytest.mark.processes  # DDP ranks and their DataLoader workers, for real

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SETTINGS = {
    "max_length": 256,
    "batch_size": 2,
    "tile_size": 32,
    "max_image_side": 64,
    "tokens_per_tile": 4,
    "shuffle_buffer": 12,
    "pack_window": 10,
    "seed": 3,
}
SHARD_SIZES = [9, 2, 14, 1, 6, 11, 4]  # 47 samples in 7 uneven shards
RANK_TIME_LIMIT = 200  # seconds: well past what a rank takes, well under the test's limit


def write_uneven(folder, sizes, tmp) -> str:
    """A dataset whose shards hold ``sizes`` samples: one dataset written per shard, then the
    shards renamed into one folder under one index (what the writer makes, shard by shard)."""
    rng = random.Random(len(sizes))
    os.makedirs(folder)
    shards, n = [], 0
    for s, size in enumerate(sizes):
        records = []
        for _ in range(size):
            image = os.path.join(tmp, f"img{n}.png")
            w, h = rng.randint(8, 200), rng.randint(8, 200)
            Image.effect_noise((w, h), 60).convert("RGB").save(image)
            records.append(
                {
                    "id": f"s{n}",
                    "image": image,
                    "conversations": [
                        {"from": "human", "value": "<image>\n" + "Why? " * rng.randint(1, 10)},
                        {"from": "gpt", "value": "Because. " * rng.randint(1, 12)},
                    ],
                }
            )
            n += 1
        part = os.path.join(tmp, f"part{s}")
        if records:
            jsonl = write_jsonl(os.path.join(tmp, f"part{s}.jsonl"), records)
            wdsvlm.write_dataset(jsonl, part, prefix=f"p{s}", progress=False, index_version=2)
            index = json.load(open(os.path.join(part, "index.json")))
            for shard in index["shards"]:  # the shard and its sidecar
                for name in (shard["name"], shard["sidecar"]["name"]):
                    os.rename(os.path.join(part, name), os.path.join(folder, name))
                shards.append(shard)
        else:  # an empty shard: a tar of end-of-archive blocks only, and an empty sidecar
            name = f"p{s}-000000.tar"
            with open(os.path.join(folder, name), "wb") as f:
                f.write(b"\0" * 1024)
            digest = hashlib.sha256(b"\0" * 1024).hexdigest()
            sidecar = pack_entries([])
            with open(os.path.join(folder, sidecar_name(name)), "wb") as f:
                f.write(sidecar)
            shards.append(
                {
                    "name": name,
                    "samples": 0,
                    "bytes": 1024,
                    "sha256": digest,
                    "sidecar": sidecar_entry(sidecar_name(name), sidecar),
                    **shard_summary([]),
                }
            )
    index["shards"] = shards
    index["totals"] = {**index["totals"], "samples": n, "shards": len(shards)}
    index["totals"]["images"] = n
    with open(os.path.join(folder, "index.json"), "w") as f:
        json.dump(index, f)
    return folder


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("uneven"))
    return write_uneven(os.path.join(tmp, "ds"), SHARD_SIZES, tmp)


def as_version_1(folder: str, out: str) -> str:
    """A copy of the dataset at ``folder`` with a version-1 index (every sample's entry in
    index.json, no sidecars): the tars are the same."""
    import shutil

    index = wdsvlm.load_index(folder)
    os.makedirs(out)
    shards = []
    for shard in index["shards"]:
        shutil.copy(os.path.join(folder, shard["name"]), os.path.join(out, shard["name"]))
        kept = {k: shard[k] for k in ("name", "samples", "bytes", "sha256")}
        shards.append({**kept, "entries": list(shard["entries"])})
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump({**index, "version": 1, "shards": shards}, f)
    return out


def all_keys(folder) -> list[str]:
    index = wdsvlm.load_index(folder)
    return sorted(f"{s['name']}/{e['key']}" for s in index["shards"] for e in s["entries"])


def digest(batch: dict) -> str:
    """Every tensor of a batch, bit for bit, and its keys."""
    h = hashlib.sha256()
    for name in sorted(batch):
        value = batch[name]
        if isinstance(value, torch.Tensor):
            h.update(name.encode() + str(value.dtype).encode() + str(tuple(value.shape)).encode())
            h.update(value.contiguous().numpy().tobytes())
        else:
            h.update(name.encode() + json.dumps(value).encode())
    return h.hexdigest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world, port, job):
    import faulthandler

    # a rank stuck for good prints every thread's stack and exits: a red test with evidence
    faulthandler.dump_traceback_later(RANK_TIME_LIMIT, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = job["run"](rank, job)
        with open(os.path.join(job["out"], f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
    finally:
        dist.destroy_process_group()


def ddp(job: dict, world: int = 2, limit: float | None = None) -> list:
    """Run ``job["run"](rank, job)`` in ``world`` new processes of one gloo process group;
    their results, by rank. Past ``limit`` seconds the test fails. Whatever happens (a failed
    rank, a time limit), no rank is left behind."""
    context = mp.start_processes(
        _rank_main, args=(world, _free_port(), job), nprocs=world, start_method="spawn", join=False
    )
    deadline = None if limit is None else time.monotonic() + limit
    try:
        while not context.join(timeout=None if limit is None else 1):
            if deadline is not None and time.monotonic() > deadline:
                pytest.fail(f"the {world} ranks did not finish in {limit} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [pickle.load(open(os.path.join(job["out"], f"rank{r}.pkl"), "rb")) for r in range(world)]


def _train(rank, job):
    """The training loop of the README: set_epoch, iterate, all-reduce every step; the
    loader's state after every step is kept for the resume tests."""
    loader = wdsvlm.Loader(job["data"], TOKENIZER, **job["loader"], **SETTINGS)
    assert (loader.worker_config.rank, loader.worker_config.world_size) == (rank, 2)
    steps, seen, digests, states = [], [], [], []
    for epoch in range(job["epochs"]):
        loader.set_epoch(epoch)
        n = 0
        for batch in loader:
            total = batch["num_loss_tokens"].clone()
            dist.all_reduce(total)  # hangs if the ranks disagree on the number of steps
            for keys, passes in zip(batch["sample_keys"], batch["sample_passes"], strict=True):
                seen += [(p, k) for p, k in zip(passes, keys, strict=True)]
            digests.append(digest(batch))
            states.append(loader.state_dict())
            n += 1
        steps.append(n)
    return {"len": len(loader), "steps": steps, "seen": seen, "digests": digests, "states": states}


def _resume(rank, job):
    """For each saved step k: a new loader, its state loaded, the loop as a restarted job runs
    it (set_epoch with the saved epoch first); the digests of what follows."""
    out = {}
    for k, states in job["states"].items():
        loader = wdsvlm.Loader(job["data"], TOKENIZER, **job["loader"], **SETTINGS)
        state = states[rank]
        loader.load_state_dict(state)
        digests = []
        for epoch in range(state["epoch"], job["epochs"]):
            loader.set_epoch(epoch)
            for batch in loader:
                total = batch["num_loss_tokens"].clone()
                dist.all_reduce(total)
                digests.append(digest(batch))
        out[k] = digests
    return out


@pytest.mark.parametrize(
    "workers,persistent,version",
    [(2, False, 2), (3, True, 2), (2, False, 1)],
    ids=["2-workers", "3-persistent-workers", "2-workers-index-version-1"],
)
def test_two_ranks_equal_steps_every_sample_once_per_pass_and_exact_resume(
    uneven, tmp_path, workers, persistent, version
):
    data = uneven if version == 2 else as_version_1(uneven, str(tmp_path / "v1"))
    epochs = 3
    options = {"num_workers": workers, "persistent_workers": persistent}
    job = {"run": _train, "data": data, "loader": options, "epochs": epochs}
    ranks = ddp({**job, "out": str(tmp_path)})
    length = ranks[0]["len"]
    for r in ranks:  # the same number of batches on every rank, and len() says it
        assert r["len"] == length and r["steps"] == [length] * epochs
    every = all_keys(data)
    seen = [s for r in ranks for s in r["seen"]]
    for p in (0, 1):  # passes 0 and 1 are over after 3 epochs: each key exactly once in each
        assert sorted(k for q, k in seen if q == p) == every, f"pass {p}"
    for p in {q for q, _ in seen} - {0, 1}:  # the passes still going on: no key twice
        later = [k for q, k in seen if q == p]
        assert len(later) == len(set(later)), f"pass {p}"

    # resume: inside the first window, mid-epoch, right after an epoch boundary, near the end
    ks = sorted({1, 3, length // 2, length, length + 1, epochs * length - 2})
    states = {k: [r["states"][k - 1] for r in ranks] for k in ks}
    assert states[length][0]["done"] == length  # the state right after epoch 0's last step
    resumed = ddp(
        {
            "run": _resume,
            "data": data,
            "loader": options,
            "epochs": epochs,
            "states": states,
            "out": str(tmp_path),
        }
    )
    for rank in range(2):
        for k in ks:
            assert resumed[rank][k] == ranks[rank]["digests"][k:], f"rank {rank}, step {k}"


def _rank_zero_alone(rank, job):
    """Rank 0 builds a Loader (an evaluation loader, say), takes its length and a batch; rank 1
    builds none and waits outside any collective until rank 0 is through. Then both build
    one. The lengths of each."""
    through = os.path.join(job["out"], "rank0-through")
    alone = None
    if rank == 0:
        loader = wdsvlm.Loader(job["data"], TOKENIZER, num_workers=0, **SETTINGS)
        alone = len(loader)
        assert next(iter(loader))["input_ids"].shape == (SETTINGS["batch_size"], 256)
        open(through, "w").close()
    else:
        while not os.path.exists(through):  # ddp's time limit ends this if rank 0 hangs
            time.sleep(0.1)
    dist.barrier()  # the process group is still in step
    both = wdsvlm.Loader(job["data"], TOKENIZER, num_workers=0, **SETTINGS)
    return {"alone": alone, "both": len(both)}


def test_a_loader_built_on_one_rank_only_does_not_wait_for_the_others(uneven, tmp_path):
    """len(loader) is worked out from the index and the settings alone, the same on every
    rank, with no collective call: a Loader on some ranks only must not hang."""
    ranks = ddp({"run": _rank_zero_alone, "data": uneven, "out": str(tmp_path)}, limit=180)
    assert ranks[0]["alone"] > 0 and ranks[1]["alone"] is None
    assert ranks[0]["both"] == ranks[1]["both"] == ranks[0]["alone"]


def one_rank(data, rank, workers, epochs=2, **extra):
    """Loader of rank ``rank`` of 2 (no process group: rank and world size given), run for
    ``epochs``; its length and the ``(pass, key)`` of every sample it yielded."""
    loader = wdsvlm.Loader(
        data, TOKENIZER, num_workers=workers, rank=rank, world_size=2, **{**SETTINGS, **extra}
    )
    seen, steps = [], []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        n = 0
        for batch in loader:
            for keys, passes in zip(batch["sample_keys"], batch["sample_passes"], strict=True):
                seen += [(p, k) for p, k in zip(passes, keys, strict=True)]
            n += 1
        steps.append(n)
    return len(loader), steps, seen


@pytest.mark.parametrize("sizes", [[13], [5, 0, 9]], ids=["one-shard", "an-empty-shard"])
def test_one_shard_over_four_global_workers_and_an_empty_shard(tmp_path, sizes):
    data = write_uneven(str(tmp_path / "ds"), sizes, str(tmp_path))
    runs = [one_rank(data, rank, workers=2) for rank in range(2)]
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1] == [runs[0][0]] * 2
    seen = runs[0][2] + runs[1][2]
    assert sorted(k for p, k in seen if p == 0) == all_keys(data)


def test_more_global_workers_than_samples_is_refused_clearly(tmp_path):
    data = write_uneven(str(tmp_path / "ds"), [3], str(tmp_path))
    with pytest.raises(ValueError, match="3 samples for 4 global workers"):
        wdsvlm.Loader(data, TOKENIZER, num_workers=2, rank=0, world_size=2)


def test_a_restore_onto_another_topology_or_other_settings_is_refused(uneven):
    loader = wdsvlm.Loader(uneven, TOKENIZER, num_workers=0, rank=1, world_size=2, **SETTINGS)
    next(iter(loader))
    state = loader.state_dict()
    assert len(pickle.dumps(state)) < 20_000  # places, not sample bytes

    def load(**change):
        options = {"num_workers": 0, "rank": 1, "world_size": 2, **SETTINGS, **change}
        wdsvlm.Loader(uneven, TOKENIZER, **options).load_state_dict(state)

    load()  # the same topology and settings: fine
    with pytest.raises(ValueError, match="num_workers 0 -> 2"):
        load(num_workers=2)
    with pytest.raises(ValueError, match="world_size 2 -> 1.*rank 1 -> 0|rank 1 -> 0.*world_size"):
        load(rank=0, world_size=1)
    with pytest.raises(ValueError, match="max_length 256 -> 512"):
        load(max_length=512)
    with pytest.raises(ValueError, match="seed"):
        load(seed=4)


def test_a_dead_worker_is_a_clear_error_not_a_hang():
    import multiprocessing
    import signal

    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, num_workers=2, **SETTINGS)
    before = {p.pid for p in multiprocessing.active_children()}
    batches = iter(loader)
    next(batches)
    workers = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert len(workers) == 2
    os.kill(workers[0].pid, signal.SIGKILL)
    # torch words it by where it noticed: "exited unexpectedly" or "is killed by signal"; a
    # worker killed while the training process takes its batch's shared memory over (a
    # connection reset) is worded by the Loader as the first
    with pytest.raises(RuntimeError, match=r"DataLoader worker .*(exited unexpectedly|is killed)"):
        for _ in batches:
            pass


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shard_that_cannot_be_read_is_reported_with_its_url(tmp_path, workers):
    import shutil

    data = str(tmp_path / "ds")
    shutil.copytree(EXAMPLE, data)
    loader = wdsvlm.Loader(data, TOKENIZER, num_workers=workers, **SETTINGS)
    os.remove(os.path.join(data, "shapes-000002.tar"))
    with pytest.raises(wdsvlm.StorageError, match=r"ds/shapes-000002\.tar.*FileNotFoundError"):
        for _ in loader:
            pass
