"""The Ray side of tests/test_ray_workers.py, run as ``python -m tests.ray_loader_job CASE WORKDIR
LIMIT`` inside a network namespace that holds only loopback (so Ray listens on 127.0.0.1 and
nowhere else). It writes what it found to ``WORKDIR/CASE.json``; the test asserts on it. Past
``LIMIT`` seconds it prints every thread's stack and exits.

The ``rank`` case is one torchrun rank of the ``torchrun`` case."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage statistics
os.environ["RAY_AUTH_MODE"] = "disabled"  # no token written to ~/.ray

import ray  # noqa: E402

import wdsvlm  # noqa: E402

from .conftest import command_lines  # noqa: E402
from .ray_job import ray_cluster, ray_session, run_case  # noqa: E402
from .test_ddp import SETTINGS, TOKENIZER, digest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPOCHS = 3
ACTOR_TITLE = b"ray::RayWorker"  # the process title Ray gives an actor of ray_workers.RayWorker


def run(data, workers, epochs=EPOCHS, state=None, each=None, **options) -> tuple[list, list]:
    """The digests of every batch of ``epochs`` epochs and the loader's state after each
    (from ``state``, if given: the loop a restarted job runs); ``each(step, loader)`` after
    each."""
    loader = wdsvlm.Loader(data, TOKENIZER, workers=workers, **{**SETTINGS, **options})
    first = 0
    if state is not None:
        loader.load_state_dict(state)
        first = state["epoch"] if isinstance(state, dict) else state[0]["epoch"]
    digests, states = [], []
    for epoch in range(first, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            digests.append(digest(batch))
            states.append(loader.state_dict())
            if each is not None:
                each(len(digests), loader)
    return digests, states


def cpus_back(total: float, limit: float = 20) -> bool:
    """Whether every CPU of the local Ray is free again within ``limit`` seconds: each actor
    holds one while it lives."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0) == total:
            return True
        time.sleep(0.1)
    return False


def store_usage() -> tuple[int, int]:
    """Bytes and objects in Ray's object store now (the cluster's own count)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    stats = get_memory_info_reply(get_state_from_address()).store_stats
    return stats.object_store_bytes_used, stats.num_local_objects


def settled(objects: int, limit: float = 10) -> tuple[int, int]:
    """The object store's usage once it holds at most ``objects`` objects (frees are
    asynchronous), or as it is after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while (usage := store_usage())[1] > objects and time.monotonic() < deadline:
        time.sleep(0.1)
    return usage


def actor_processes() -> list[int]:
    """The pids of the processes that hold an actor of the loader's Ray workers now."""
    return [pid for pid, title in command_lines().items() if title.startswith(ACTOR_TITLE)]


def no_actors_left(limit: float = 30) -> bool:
    """Whether every actor process of the loaders before has exited within ``limit``
    seconds (a killed actor's process outlives ``close()`` a little)."""
    deadline = time.monotonic() + limit
    while actor_processes():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_an_actor() -> int:
    """SIGKILL one running actor of the loader's Ray workers, the newest (not one of an
    epoch before, being stopped); its pid."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        actors = actor_processes()
        if actors:
            os.kill(max(actors), signal.SIGKILL)
            return max(actors)
        time.sleep(0.05)
    raise AssertionError("no Ray worker actor process found to kill")


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def suite(work: str) -> dict:
    """Ray workers against local workers on 2 simulated ranks: the same batches over three
    epochs, resume either way, elastic resume, backpressure, clean stop, errors."""
    data = os.path.join(work, "data")
    found: dict = {}
    ray_workers = wdsvlm.RayWorkers(in_flight=2, resources={"preprocess": 1})
    with ray_session(4, resources={"preprocess": 4}):
        total = ray.available_resources()["CPU"]
        for rank in (0, 1):
            two = {"rank": rank, "world_size": 2, "num_workers": 2}
            local, local_states = run(data, "local", **two)
            on_ray, ray_states = run(data, ray_workers, **two)
            found[f"same-{rank}"] = [local, on_ray]
            # a state saved with one kind of worker resumes with the other (mid epoch 0,
            # and mid epoch 1)
            for k in (1, len(local) // EPOCHS + 1):
                found[f"local-to-ray-{rank}-{k}"] = [
                    local[k + 1 :],
                    run(data, ray_workers, state=local_states[k], **two)[0],
                ]
                found[f"ray-to-local-{rank}-{k}"] = [
                    local[k + 1 :],
                    run(data, "local", state=ray_states[k], **two)[0],
                ]
            found[f"states-{rank}"] = local_states
        found["cpus-back-after-epochs"] = cpus_back(total)
        # elastic: both ranks' states at step 2 onto one rank of 3 workers, local and Ray
        states = [found["states-0"][2], found["states-1"][2]]
        one = {"rank": 0, "world_size": 1, "num_workers": 3}
        found["elastic"] = [
            run(data, "local", state=states, **one)[0],
            run(data, ray_workers, state=states, **one)[0],
        ]
        # a mixture: one source repeated 1.5 times a pass, 20 samples a pass of another
        other = os.path.join(work, "other")
        shutil.copytree(data, other)
        mixture = [wdsvlm.Source(data, repeat=1.5, name="a"), wdsvlm.Source(other, choose=20)]
        two = {"rank": 1, "world_size": 2, "num_workers": 2}
        found["mixture"] = [
            run(mixture, "local", epochs=2, **two)[0],
            run(mixture, ray_workers, epochs=2, **two)[0],
        ]
        found["backpressure"] = backpressure(data)
        found["stops"] = stops(data, ray_workers, total)
        found["errors"] = errors(work, data, ray_workers)
        found["cpus-back-at-end"] = cpus_back(total)
    for rank in (0, 1):
        del found[f"states-{rank}"]
    return found


def backpressure(data: str) -> dict:
    """A trainer that sleeps after its first batch: the object store holds at most
    ``in_flight`` finished batches per actor, whatever the wait."""
    out = {}
    big = {"tile_size": 256, "max_image_side": 512, "max_length": 1024}  # in the store
    big["batches_per_epoch"] = 12  # more than the actors may hold ahead
    for in_flight in (1, 3):
        workers = wdsvlm.RayWorkers(in_flight=in_flight)
        settings = {**SETTINGS, **big, "num_workers": 2}
        loader = wdsvlm.Loader(data, TOKENIZER, workers=workers, **settings)
        before = settled(0)  # what earlier loaders held is freed asynchronously
        batches = iter(loader)
        first = next(batches)
        seen = []
        for _ in range(6):  # the trainer sleeps: the actors fill their in_flight and wait
            time.sleep(0.5)
            seen.append(store_usage())
        sizes = [nbytes(first)] + [nbytes(b) for b in batches]
        out[in_flight] = {
            "before": before,
            "sleeping": seen,
            "batch_bytes": max(sizes),
            "batches": len(sizes),
            "after": settled(before[1]),
        }
    return out


def nbytes(batch: dict) -> int:
    return sum(v.nbytes for v in batch.values() if hasattr(v, "nbytes"))


def stops(data: str, workers, total: float) -> dict:
    """Actors end with a whole epoch, an iteration broken off, ``close()`` and the loader
    going away."""
    out = {}
    loader = wdsvlm.Loader(data, TOKENIZER, num_workers=2, workers=workers, **SETTINGS)
    batches = iter(loader)
    next(batches)
    out["running"] = ray.available_resources().get("CPU", 0)
    batches.close()  # a `break` out of the loop
    out["break"] = cpus_back(total)
    batches = iter(loader)
    next(batches)
    loader.close()
    out["close"] = cpus_back(total)
    batches = iter(loader)
    next(batches)
    del batches, loader
    out["gone"] = cpus_back(total)
    return out


def errors(work: str, data: str, workers) -> dict:
    """A shard gone after the loader was built: the actor's error is raised in the trainer,
    of its own type and naming the shard; num_workers=0 is refused."""
    out = {}
    broken = os.path.join(work, "broken")
    shutil.copytree(data, broken)
    gone = sorted(n for n in os.listdir(broken) if n.endswith(".tar"))[0]
    loader = wdsvlm.Loader(broken, TOKENIZER, num_workers=2, workers=workers, **SETTINGS)
    os.remove(os.path.join(broken, gone))
    try:
        for _ in loader:
            pass
    except Exception as e:  # noqa: BLE001 - what the trainer sees
        out["raised"] = [
            isinstance(e, wdsvlm.StorageError),
            isinstance(e, wdsvlm.WdsvlmError),
            str(e),
            gone,
        ]
    try:
        wdsvlm.Loader(data, TOKENIZER, num_workers=0, workers=workers, **SETTINGS)
    except ValueError as e:
        out["no-workers"] = str(e)
    nowhere = wdsvlm.RayWorkers(resources={"cpu_node": 1})  # no node offers it: not a hang
    loader = wdsvlm.Loader(data, TOKENIZER, num_workers=2, workers=nowhere, **SETTINGS)
    try:
        next(iter(loader))
    except wdsvlm.WdsvlmError as e:
        out["no-node"] = str(e)
    return out


def faults(work: str) -> dict:
    """Actors killed with SIGKILL mid-epoch: the batches equal an undisturbed run, a log line
    names each restart; past max_restarts, an error names the worker."""
    data = os.path.join(work, "data")
    found: dict = {}
    lines = Lines()
    logging.getLogger("wdsvlm.loader").addHandler(lines)
    options = {"num_workers": 2, "world_size": 1, "rank": 0}
    with ray_session(3):
        total = ray.available_resources()["CPU"]
        found["undisturbed"] = run(data, "local", epochs=2, **options)[0]
        killed = []

        def kill_at(steps):
            def each(step, loader):
                if step in steps:
                    killed.append(kill_an_actor())

            return each

        workers = wdsvlm.RayWorkers(max_restarts=3)
        found["killed-twice"] = run(data, workers, epochs=2, each=kill_at({2, 5}), **options)[0]
        found["killed"] = killed[:]
        found["log"] = lines.lines[:]
        lines.lines.clear()
        try:
            few = wdsvlm.RayWorkers(max_restarts=1)
            run(data, few, epochs=1, each=kill_at({1, 3}), **options)
        except wdsvlm.WdsvlmError as e:
            found["past-max"] = str(e)
        found["cpus-back"] = cpus_back(total)
        found["trainer-dies"] = trainer_dies(data, total, options)
    return found


def edges(work: str) -> dict:
    """A shape no node offers now, with get_timeout set (an autoscaler may add the node); an
    error raised while an actor's stream starts; an address ignored because Ray is connected
    already; the stats of an epoch in which an actor was killed."""
    from wdsvlm.loader.ray_workers import connect

    data = os.path.join(work, "data")
    found: dict = {}
    lines = Lines()
    logging.getLogger("wdsvlm.loader").addHandler(lines)
    options = {"num_workers": 2, "world_size": 1, "rank": 0}
    with ray_session(3):
        # no node offers cpu_node now; with get_timeout set: a warning, then the timeout
        waits = wdsvlm.RayWorkers(resources={"cpu_node": 1}, get_timeout=3)
        loader = wdsvlm.Loader(data, TOKENIZER, workers=waits, **SETTINGS, **options)
        started = time.monotonic()
        try:
            next(iter(loader))
            found["wait"] = ["no error"]
        except Exception as e:  # noqa: BLE001 - what the trainer sees
            found["wait"] = [type(e).__name__, str(e), time.monotonic() - started, lines.lines[:]]
        loader.close()
        lines.lines.clear()
        # an address other than the cluster this process is connected to: ignored, said so
        here = ray.get_runtime_context().gcs_address
        for address in ("127.0.0.1:1", here, "auto"):
            connect(wdsvlm.RayWorkers(address=address))
        found["address"] = [here, lines.lines[:]]
        lines.lines.clear()
        found["start-error"] = start_error(work, options)
        found["start-error"].append(lines.lines[:])
        lines.lines.clear()
        # an actor killed mid-epoch: the epoch's stats equal an undisturbed run's
        drops = {**SETTINGS, "max_tiles_per_pack": 3, "max_length": 96, "batch_size": 1}
        killed = []

        def stats(each=None) -> tuple[dict, int]:
            # the actors of the loaders before are gone: the one killed is of this loader
            found.setdefault("stats-alone", []).append(no_actors_left())
            loader = wdsvlm.Loader(data, TOKENIZER, workers=wdsvlm.RayWorkers(), **drops, **options)
            step = 0
            for step, _ in enumerate(loader, 1):
                if each is not None:
                    each(step)
            figures = loader.stats()
            loader.close()
            return figures, step

        found["stats-undisturbed"], found["stats-batches"] = stats()
        found["stats-killed"] = stats(lambda step: step == 2 and killed.append(kill_an_actor()))[0]
        found["stats-restarts"] = [line for line in lines.lines if "restarting" in line]
    return found


def start_error(work: str, options: dict) -> list:
    """A state whose held samples' shard went away since: the stream of the worker asked
    first cannot resume. With Ray workers (3 restarts allowed) and with local workers: the
    error's type, message and how long it took."""
    data = os.path.join(work, "shard-gone")
    shutil.copytree(os.path.join(work, "data"), data)
    loader = wdsvlm.Loader(data, TOKENIZER, workers="local", **SETTINGS, **options)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    loader.close()
    first = 3 % options["num_workers"]  # the worker the resumed epoch asks first
    place = state["workers"][first]["window"]["places"][0]  # a sample its window holds
    shard = wdsvlm.pipeline.plan.Plan(data).locate(place[0], [place[1]])[0]["shard"]
    os.remove(os.path.join(data, shard))
    out = []
    for workers in (wdsvlm.RayWorkers(max_restarts=3), "local"):
        resumed = wdsvlm.Loader(data, TOKENIZER, workers=workers, **SETTINGS, **options)
        resumed.load_state_dict(state)
        started = time.monotonic()
        try:
            next(iter(resumed))
            out.append(["no error"])
        except Exception as e:  # noqa: BLE001 - what the trainer sees
            out.append([type(e).__name__, str(e), time.monotonic() - started])
        resumed.close()
    return out


DRIVER = """
import os, sys, time, wdsvlm
from tests.test_ddp import SETTINGS, TOKENIZER
loader = wdsvlm.Loader(sys.argv[1], TOKENIZER, num_workers=1, workers=wdsvlm.RayWorkers(),
                       **SETTINGS)
batches = iter(loader)
next(batches)
print("ready", flush=True)
time.sleep(600)
"""


def trainer_dies(data: str, total: float, options: dict) -> dict:
    """Another trainer process on the same cluster, SIGKILLed while its Ray worker runs: its
    actor goes with it; this process's loader goes on undisturbed."""
    undisturbed = run(data, "local", epochs=1, **options)[0]
    loader = wdsvlm.Loader(data, TOKENIZER, workers=wdsvlm.RayWorkers(), **SETTINGS, **options)
    batches = iter(loader)
    digests = [digest(next(batches))]
    mine = total - ray.available_resources().get("CPU", 0)  # this loader's actors
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    other = subprocess.Popen(
        [sys.executable, "-c", DRIVER, data], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        ready = other.stdout.readline().strip()
        held = total - ray.available_resources().get("CPU", 0)
        other.send_signal(signal.SIGKILL)
        other.wait(30)
    finally:
        other.kill()
    deadline = time.monotonic() + 30  # its actor goes; these stay
    while time.monotonic() < deadline:
        if total - ray.available_resources().get("CPU", 0) == mine:
            break
        time.sleep(0.1)
    after = total - ray.available_resources().get("CPU", 0)
    digests += [digest(b) for b in batches]
    return {
        "ready": ready,
        "cpus-mine": mine,
        "cpus-with-other": held,
        "cpus-after": after,
        "same": digests == undisturbed,
    }


def ray_train(work: str) -> dict:
    """The Loader with Ray workers inside Ray Train's TorchTrainer: 2 CPU training workers
    on gloo, each rank's digests written to WORKDIR."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    data = os.path.join(work, "data")

    def train(config):
        import torch.distributed as dist

        options = {"num_workers": 2}
        digests = run(config["data"], wdsvlm.RayWorkers(), **options)[0]
        rank = dist.get_rank()
        facts = [rank, dist.get_world_size(), dist.get_backend(), digests]
        with open(os.path.join(config["work"], f"train-rank{rank}.json"), "w") as f:
            json.dump(facts, f)

    with ray_session(6) as temp:
        trainer = TorchTrainer(
            train,
            train_loop_config={"data": data, "work": work},
            scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
            run_config=RunConfig(storage_path=os.path.join(temp, "train")),
        )
        result = trainer.fit()
        assert result.error is None, result.error
    return {f"rank{r}": json.load(open(os.path.join(work, f"train-rank{r}.json"))) for r in (0, 1)}


def torchrun(work: str) -> dict:
    """2 ranks x 2 Ray workers under torchrun, joined to a ``ray start --head`` cluster by
    RAY_ADDRESS; rank 0 kills an actor mid-epoch, in each of the 2 epochs. Then the same
    with local workers."""
    found: dict = {}
    with ray_cluster(4, port=6391) as address:
        for mode in ("ray", "local"):
            env = {**os.environ, "RAY_ADDRESS": address, "JOB_MODE": mode}
            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
            command += ["--master_addr=127.0.0.1", "--master_port=29531"]
            command += ["-m", "tests.ray_loader_job", "rank", work, "150"]
            done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
            assert done.returncode == 0, f"{mode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
            ranks = [os.path.join(work, f"{mode}-rank{r}.json") for r in (0, 1)]
            found[mode] = [json.load(open(path)) for path in ranks]
            found[f"{mode}-stderr"] = done.stderr[-20000:]
    return found


def rank(work: str) -> None:
    """One torchrun rank: 2 epochs, an all-reduce every step (a hang if the ranks disagree on
    the number of steps); with Ray workers, rank 0 kills an actor after the first step of each
    epoch (the other actor of rank 0 still owes it batches of that epoch)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    me = dist.get_rank()
    mode = os.environ["JOB_MODE"]
    killed = []

    def each(step, loader):
        total = torch.tensor([step])
        dist.all_reduce(total)
        if mode == "ray" and me == 0 and step % len(loader) == 1:
            killed.append(kill_an_actor())

    workers = wdsvlm.RayWorkers() if mode == "ray" else "local"
    digests = run(os.path.join(work, "data"), workers, epochs=2, each=each, num_workers=2)[0]
    with open(os.path.join(work, f"{mode}-rank{me}.json"), "w") as f:
        json.dump({"digests": digests, "killed": killed}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "rank":  # one torchrun rank of the torchrun case
        faulthandler.dump_traceback_later(float(sys.argv[3]), exit=True)
        rank(sys.argv[2])
    else:
        cases = {"suite": suite, "faults": faults, "edges": edges}
        run_case({**cases, "ray_train": ray_train, "torchrun": torchrun})
