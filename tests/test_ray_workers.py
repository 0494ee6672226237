"""The Loader's workers as Ray actors (``workers=wdsvlm.RayWorkers(...)``), against a real local
Ray (and a ``ray start`` cluster joined by torchrun ranks, and Ray Train), in a network
namespace that holds only loopback; actors killed with SIGKILL. The Ray side runs in
tests/ray_loader_job.py; here its findings are checked. Nothing may be left behind."""

from __future__ import annotations

import logging

import pytest

from .test_ddp import SHARD_SIZES, write_uneven
from .test_ray import assert_no_ray_process, run_job

pytestmark = pytest.mark.processes
MODULE = "tests.ray_loader_job"


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """47 samples in 7 uneven shards (one empty), as the DDP tests use."""
    work = tmp_path_factory.mktemp("rayloader")
    tmp = work / "tmp"
    tmp.mkdir()
    write_uneven(str(work / "data"), SHARD_SIZES, str(tmp))
    return work


@pytest.fixture(scope="module")
def suite(work):
    return run_job(work, "suite", limit=400, module=MODULE)


# the module's first test: its time includes the suite's run (400 s at most, the job's own limit),
# about 150 s alone and 260 s beside the other tests of `make test`
@pytest.mark.timeout(600)
def test_ray_workers_give_the_local_workers_batches_bit_for_bit(suite):
    for rank in (0, 1):
        local, on_ray = suite[f"same-{rank}"]
        assert len(local) >= 3 * 2 and len(set(local)) == len(local)  # 3 epochs, all distinct
        assert on_ray == local, rank
    assert len(suite["same-0"][0]) == len(suite["same-1"][0])  # equal steps on both ranks
    assert suite["cpus-back-after-epochs"] and suite["cpus-back-at-end"]


def test_a_mixture_gives_the_same_batches_with_ray_workers(suite):
    local, on_ray = suite["mixture"]
    assert len(local) >= 2 and on_ray == local


def test_a_state_saved_with_either_kind_of_worker_resumes_with_the_other(suite):
    names = [n for n in suite if n.startswith(("local-to-ray-", "ray-to-local-"))]
    assert len(names) == 8  # 2 ranks x 2 directions x (mid epoch 0, mid epoch 1)
    for name in names:
        expected, resumed = suite[name]
        assert expected and resumed == expected, name


def test_an_elastic_resume_with_ray_workers_equals_the_local_one(suite):
    local, on_ray = suite["elastic"]
    assert local and on_ray == local


def test_the_object_store_holds_at_most_in_flight_batches_per_actor(suite):
    stream = 100_000  # the pipeline the actors play, put once: about 30 KB here
    for in_flight, seen in suite["backpressure"].items():
        in_flight = int(in_flight)
        assert seen["batch_bytes"] > 200_000  # large enough to live in the store, not inline
        assert seen["before"] == [0, 0], seen
        objects = [n for _, n in seen["sleeping"]]
        held = [b for b, _ in seen["sleeping"]]
        # while the trainer sleeps: each of the 2 actors' in_flight batches and the
        # pipeline, no more
        assert objects[-1] == 2 * in_flight + 1, (in_flight, seen)
        assert held[-1] <= 2 * in_flight * seen["batch_bytes"] + stream, (in_flight, seen)
        # at any time, at most one more: the batch just taken, freed asynchronously
        assert max(objects) <= 2 * in_flight + 2, (in_flight, seen)
        assert max(held) <= (2 * in_flight + 1) * seen["batch_bytes"] + stream, seen
        assert seen["after"][1] == 0, seen  # nothing held once the epoch is taken
    one, three = suite["backpressure"]["1"], suite["backpressure"]["3"]
    assert one["sleeping"][-1][0] < three["sleeping"][-1][0]


def test_actors_end_with_the_epoch_a_break_close_and_the_loader_going(suite):
    stops = suite["stops"]
    assert stops["running"] <= 2  # two of the 4 CPUs taken by the actors while they run
    assert stops["break"] and stops["close"] and stops["gone"]


def test_an_actors_error_is_raised_in_the_trainer_as_it_was_raised(suite):
    is_storage, is_wdsvlm, message, gone = suite["errors"]["raised"]
    assert is_storage and is_wdsvlm
    assert gone in message.splitlines()[0]  # its own message, not Ray's banner first
    assert "num_workers=1 or more" in suite["errors"]["no-workers"]
    assert "1 cpu_node per worker" in suite["errors"]["no-node"]
    assert "preprocess" in suite["errors"]["no-node"]  # what the nodes do offer


def test_actors_killed_mid_epoch_restart_from_their_state_and_nothing_changes(work):
    found = run_job(work, "faults", limit=300, module=MODULE)
    assert len(found["killed"]) == 2
    assert found["killed-twice"] == found["undisturbed"]
    restarts = [line for line in found["log"] if "restarting it from its state" in line]
    assert len(restarts) == 2, found["log"]
    assert all(line.startswith("Ray worker ") and "global worker" in line for line in restarts)
    assert "(restart 1 of 3)" in restarts[0] and "(restart 2 of 3)" in restarts[1]
    assert "max_restarts" in found["past-max"] and "Ray worker" in found["past-max"]
    assert "ActorDiedError" in found["past-max"] or "RayActorError" in found["past-max"]
    assert found["cpus-back"]
    dies = found["trainer-dies"]  # another trainer on the cluster SIGKILLed mid-epoch
    assert dies["ready"] == "ready" and dies["cpus-mine"] == 2 and dies["cpus-with-other"] == 3
    assert dies["cpus-after"] == 2  # its actor went with it; this trainer's two stayed
    assert dies["same"]  # and this trainer's batches did not change


def test_two_torchrun_ranks_with_ray_workers_and_killed_actors_equal_local_workers(work):
    found = run_job(work, "torchrun", limit=400, module=MODULE)
    on_ray, local = found["ray"], found["local"]
    assert len(on_ray[0]["killed"]) == 2
    for rank in (0, 1):
        assert local[rank]["digests"] and on_ray[rank]["digests"] == local[rank]["digests"]
    assert len(local[0]["digests"]) == len(local[1]["digests"])
    assert found["ray-stderr"].count("restarting it from its state") == 2


def test_the_loader_with_ray_workers_runs_inside_ray_train(work, suite):
    found = run_job(work, "ray_train", limit=300, module=MODULE)
    for rank in (0, 1):
        me, world, backend, digests = found[f"rank{rank}"]
        assert (me, world, backend) == (rank, 2, "gloo")
        assert digests == suite[f"same-{rank}"][0]  # the local workers' batches of that rank


@pytest.fixture(scope="module")
def edges(work):
    return run_job(work, "edges", limit=300, module=MODULE)


def test_a_shape_no_node_offers_now_is_waited_for_with_a_warning_when_get_timeout_is_set(edges):
    name, message, seconds, logged = edges["wait"]
    assert name == "WdsvlmError" and "get_timeout" in message, edges["wait"]  # not refused
    assert seconds >= 3
    assert any("1 cpu_node per worker" in line and "get_timeout=3" in line for line in logged)


def test_an_error_while_an_actor_starts_is_raised_at_once_as_it_is(edges):
    on_ray, local, logged = edges["start-error"]
    assert on_ray[0] == local[0] == "StorageError", edges["start-error"]
    assert "cannot resume" in on_ray[1].splitlines()[0]
    assert on_ray[1].splitlines()[0] in local[1]  # the same message (DataLoader adds a banner)
    assert not [line for line in logged if "restarting" in line]  # no retries


def test_an_address_ignored_for_the_ray_this_process_is_connected_to_is_logged(edges):
    here, logged = edges["address"]
    assert len(logged) == 1, logged  # its own cluster's address, and "auto", are not
    assert "address='127.0.0.1:1'" in logged[0] and here in logged[0]


def test_the_stats_of_an_epoch_with_a_restarted_actor_count_what_came_before(edges):
    import wdsvlm

    # the kill at batch 2 hits an actor of this loader that has more batches to be asked for
    # than in_flight (2 actors, one batch of each taken): it dies before it could finish
    assert edges["stats-alone"] == [True, True], edges["stats-alone"]
    assert edges["stats-batches"] > 2 * (1 + wdsvlm.RayWorkers().in_flight), edges["stats-batches"]
    assert len(edges["stats-restarts"]) == 1, edges["stats-restarts"]
    undisturbed, killed = edges["stats-undisturbed"], edges["stats-killed"]
    assert sum(undisturbed["dropped"].values()) > 20, undisturbed
    # the requests differ: the restarted actor reads the samples its state holds again
    requests = [figures.pop("requests") for figures in (undisturbed, killed)]
    assert killed == undisturbed
    for figures in requests:  # the actors' reads, added up under the dataset's name
        assert list(figures) == ["data"] and figures["data"]["bytes"] > 0, requests


def fake_ray(monkeypatch, connected: bool = False, nodes=()):
    """Ray's calls that ``connect`` and ``check_feasible`` make, without a Ray: what was
    asked of ``ray.init`` is recorded, nothing starts."""
    import ray

    inits = []
    monkeypatch.setattr(ray, "is_initialized", lambda: connected)
    monkeypatch.setattr(ray, "init", lambda **kw: inits.append(kw))
    monkeypatch.setattr(ray, "nodes", lambda: list(nodes))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return inits


@pytest.mark.parametrize("world", ["env", "torch.distributed"])
def test_no_address_in_a_job_of_several_ranks_is_refused_not_a_local_ray_each(monkeypatch, world):
    import torch.distributed as dist

    import wdsvlm
    from wdsvlm.loader.ray_workers import connect

    inits = fake_ray(monkeypatch)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if world == "env":
        monkeypatch.setenv("WORLD_SIZE", "2")  # what torchrun sets
    else:
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda *a, **k: 4)
    with pytest.raises(wdsvlm.WdsvlmError, match="RAY_ADDRESS") as raised:
        connect(wdsvlm.RayWorkers())
    assert "ray start --head" in str(raised.value) and "address=" in str(raised.value)
    assert not inits  # no local Ray started
    connect(wdsvlm.RayWorkers(address="10.0.0.5:6379"))  # a cluster named: joined
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.5:6379")
    connect(wdsvlm.RayWorkers())
    assert [i["address"] for i in inits] == ["10.0.0.5:6379", None]


def test_no_address_in_a_job_of_one_process_starts_a_local_ray(monkeypatch):
    import wdsvlm
    from wdsvlm.loader.ray_workers import connect

    inits = fake_ray(monkeypatch)
    monkeypatch.setenv("WORLD_SIZE", "1")
    connect(wdsvlm.RayWorkers())
    assert inits == [{"address": None, "include_dashboard": False}]


def node(alive: bool, **resources) -> dict:
    return {"Alive": alive, "Resources": {"CPU": 8.0, "node:10.0.0.1": 1.0, **resources}}


@pytest.mark.parametrize(
    "nodes, get_timeout, refused",
    [
        ([node(True)], None, True),  # nothing offers it, nothing may come: refused at once
        ([node(True)], 600, False),  # waits for it, at most get_timeout
        ([node(True), node(False, preprocess=4.0)], None, False),  # left: an autoscaler's
        ([node(True), node(False, other=4.0)], None, True),
    ],
)
def test_a_shape_no_running_node_offers_is_refused_unless_one_may_come(
    monkeypatch, caplog, nodes, get_timeout, refused
):
    import wdsvlm
    from wdsvlm.loader.ray_workers import check_feasible

    fake_ray(monkeypatch, connected=True, nodes=nodes)
    options = wdsvlm.RayWorkers(resources={"preprocess": 1}, get_timeout=get_timeout)
    with caplog.at_level(logging.WARNING, logger="wdsvlm.loader"):
        if refused:
            with pytest.raises(wdsvlm.WdsvlmError, match="1 preprocess per worker.*get_timeout"):
                check_feasible(options)
        else:
            check_feasible(options)
    warned = [r.getMessage() for r in caplog.records if r.name == "wdsvlm.loader"]
    assert len(warned) == (0 if refused else 1), warned
    if not refused:
        assert "1 preprocess per worker" in warned[0] and "CPU" in warned[0]


def test_ray_workers_leave_no_process_behind(suite, edges):
    assert_no_ray_process()
