"""Elastic resume under real DDP (gloo, CPU, real DataLoader workers): the states of all ranks
of a 2 ranks x 2 workers run, saved mid-pass and near a pass end, resumed on 1 rank x 3
workers and on 3 ranks x 1 worker, over a mixture with repeat 2.0 and 0.5. Every key's count
over the two runs is checked against the plan: the interrupted pass exactly once, nothing
yielded twice."""

from __future__ import annotations

import os
import pickle
from collections import Counter

import pytest
import torch.distributed as dist

import wdsvlm
from wdsvlm.pipeline.plan import Plan, WorkerConfig

from .test_ddp import SETTINGS, TOKENIZER, ddp, write_uneven

pytestmark = pytest.mark.processes

EPOCHS = 3


@pytest.fixture(scope="module")
def mixture(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("mixture"))
    big = write_uneven(os.path.join(tmp, "big"), [9, 2, 14, 1, 6, 11, 4], tmp)
    os.makedirs(os.path.join(tmp, "s"))
    small = write_uneven(os.path.join(tmp, "small"), [5, 8, 3], os.path.join(tmp, "s"))
    return [wdsvlm.Source(big, repeat=2.0), wdsvlm.Source(small, repeat=0.5)]


def planned(sources, pass_):
    """The multiset of keys pass ``pass_`` holds, from the plan on one worker."""
    plan = Plan(sources, seed=SETTINGS["seed"], worker_config=WorkerConfig())
    return Counter(f"{s['shard']}/{e['key']}" for s in plan.spans(pass_, 0) for e in s["entries"])


def _collect(batch, seen):
    for keys, passes, sources in zip(
        batch["sample_keys"], batch["sample_passes"], batch["sample_sources"], strict=True
    ):
        for key, p, source in zip(keys, passes, sources, strict=True):
            assert key.startswith(source + "/")
            seen.append((p, key))


def _train(rank, job):
    loader = wdsvlm.Loader(job["sources"], TOKENIZER, **job["loader"], **SETTINGS)
    per_step, states = [], []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for batch in loader:
            total = batch["num_loss_tokens"].clone()
            dist.all_reduce(total)
            seen = []
            _collect(batch, seen)
            per_step.append(seen)
            states.append(loader.state_dict())
    return {"len": len(loader), "per_step": per_step, "states": states}


def _resume(rank, job):
    """For each save point: a loader on this topology, the old run's states of all ranks
    loaded, the README's loop (set_epoch with the saved epoch first) to the last epoch."""
    out = {}
    for k, states in job["states"].items():
        loader = wdsvlm.Loader(job["sources"], TOKENIZER, **job["loader"], **SETTINGS)
        loader.load_state_dict(states)
        seen, steps = [], []
        for epoch in range(states[0]["epoch"], EPOCHS):
            loader.set_epoch(epoch)
            n = 0
            for batch in loader:
                total = batch["num_loss_tokens"].clone()
                dist.all_reduce(total)  # hangs if the new ranks disagree on the steps
                _collect(batch, seen)
                n += 1
            steps.append(n)
        out[k] = {"seen": seen, "steps": steps, "len": len(loader)}
    return out


@pytest.mark.timeout(600)
def test_two_by_two_resumes_exactly_on_one_by_three_and_on_three_by_one(mixture, tmp_path):
    old_options = {"num_workers": 2}
    old = ddp({"run": _train, "sources": mixture, "loader": old_options, "out": str(tmp_path)})
    length = old[0]["len"]
    assert all(len(r["per_step"]) == EPOCHS * length for r in old)
    plan = {p: planned(mixture, p) for p in range(EPOCHS + 1)}
    sizes = {p: sum(c.values()) for p, c in plan.items()}
    assert sizes[0] == 2 * 47 + 8  # repeat 2.0 of 47 samples, 0.5 of 16
    # mid-pass, near the end of pass 0 (within 2 steps of it), and late in pass 1
    ks = [length // 2, length - 2, length + length // 2 + 1]
    states = {k: [r["states"][k - 1] for r in old] for k in ks}
    held = [w for s in states[ks[1]] for w in s["workers"]]
    assert sum(len(w["shuffle"]["held"]) + len(w["window"]["places"]) for w in held) > 0

    for world, workers in [(1, 3), (3, 1)]:
        options = {"num_workers": workers}
        job = {"run": _resume, "sources": mixture, "loader": options, "states": states}
        new = ddp({**job, "out": str(tmp_path)}, world=world)
        for k in ks:
            runs = [r[k] for r in new]
            assert len({r["len"] for r in runs}) == 1  # len(loader): one number on every rank
            assert len({tuple(r["steps"]) for r in runs}) == 1  # equal steps on every rank
            before = Counter((p, key) for r in old for step in r["per_step"][:k] for p, key in step)
            after = Counter(s for r in runs for s in r["seen"])
            total = before + after
            where = f"{world} x {workers}, saved after step {k}"
            first_open = min(p for p, _ in after)
            assert first_open <= 1, where
            for p in range(first_open, 2):  # passes over by the end: exactly the plan
                got = Counter({key: n for (q, key), n in total.items() if q == p})
                assert got == plan[p], f"{where}: pass {p}"
            for (p, key), n in total.items():  # nothing beyond its planned count anywhere
                assert n <= plan[p][key], f"{where}: pass {p}, {key} {n} times"


def test_the_state_holds_places_and_ranges_not_samples(mixture):
    loader = wdsvlm.Loader(mixture, TOKENIZER, num_workers=0, rank=0, world_size=2, **SETTINGS)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    assert len(pickle.dumps(state)) < 20_000
    other = wdsvlm.Loader(mixture, TOKENIZER, num_workers=0, rank=1, world_size=2, **SETTINGS)
    with pytest.raises(ValueError, match="pass the states of all 2 ranks"):
        wdsvlm.Loader(mixture, TOKENIZER, num_workers=0, **SETTINGS).load_state_dict([state])
    with pytest.raises(ValueError, match="not of one run at one step"):
        other_state = other.state_dict()
        bumped = {**other_state, "done": other_state["done"] + 1}
        wdsvlm.Loader(mixture, TOKENIZER, num_workers=0, **SETTINGS).load_state_dict(
            [state, bumped]
        )
