"""Where a loader goes on from saved states: its own rank's state on the same topology (exactly
as saved), or the states of all ranks of a run, on any topology (``elastic.py``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..pipeline.plan import WorkerConfig
from .elastic import check_states, remap
from .fingerprint import comparable
from .settings import check_resume, upgrade_state
from .state import LoaderState, WorkerState

log = logging.getLogger("wdsvlm.loader")


@dataclass
class ResumePoint:
    """Where the loader goes on: the epoch, its batches already taken, each worker's stream
    state and the epoch length (the saved run's, on the same topology)."""

    epoch: int
    done: int
    workers: list[WorkerState]
    batches_per_epoch: int


def topology_of(config: WorkerConfig) -> dict[str, int]:
    """The topology a state records: rank, world size and workers per rank."""
    return {
        "rank": config.rank,
        "world_size": config.world_size,
        "num_workers": config.num_workers,
    }


def resume_point(
    saved: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    worker_config: WorkerConfig,
    config: dict[str, Any],
    plan: Any,
    batches_per_epoch: int,
) -> ResumePoint:
    """Where a loader of ``worker_config``, resume ``config`` and ``plan`` (its epoch
    ``batches_per_epoch`` long) goes on from ``saved``: one rank's ``state_dict()``, or the
    list of all ranks' (see ``Loader.load_state_dict``). A state of another topology, of other
    settings or of another dataset is refused, naming the difference. Once accepted, a weight
    schedule's passes take the saved run's length in batches (``schedule.py``), on any
    topology."""
    first = saved if isinstance(saved, Mapping) else saved[0]
    # the dataset's facts in the form the state records them (a state of an index of version
    # 1 or 2: every shard's row, read only now)
    here = comparable(first.get("config", {}), config, plan)
    point = checked_point(saved, worker_config, here, plan.num_samples, batches_per_epoch)
    clock = first["config"].get("schedule_clock")
    if clock is not None and plan.schedule is not None:
        plan.time_passes(plan.schedule.samples_per_pass, clock)
        config["schedule_clock"] = clock
    return point


def checked_point(
    saved: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    worker_config: WorkerConfig,
    config: Mapping[str, Any],
    pass_size: int,
    batches_per_epoch: int,
) -> ResumePoint:
    """``resume_point`` for a pass of ``pass_size`` samples, the schedule's clock aside."""
    here = topology_of(worker_config)
    if isinstance(saved, Sequence) and not isinstance(saved, Mapping):
        states = [LoaderState.from_saved(upgrade_state(s)) for s in saved]
        check_states(states)
        old = states[0].topology
        if (old["world_size"], old["num_workers"]) != (here["world_size"], here["num_workers"]):
            return elsewhere(states, worker_config, config, pass_size, batches_per_epoch)
        state = states[here["rank"]]  # the same topology: exactly as saved
    else:
        state = LoaderState.from_saved(upgrade_state(saved))
    if state.topology != here:
        diff = ", ".join(
            f"{k} {state.topology.get(k)} -> {v}"
            for k, v in here.items()
            if state.topology.get(k) != v
        )
        raise ValueError(
            f"cannot resume: the loader state was saved with a different topology ({diff}). "
            "One rank's state resumes only on the same rank, world_size and num_workers. "
            "To change them, pass the list of the states of all ranks of the old run "
            "instead (for example gathered on rank 0 with all_gather_object when saving)"
        )
    check_resume(state.config, config)
    saved_length = state.config["batches_per_epoch"] or batches_per_epoch  # 0: not counted
    if saved_length != batches_per_epoch:  # the saved run's epochs go on as they were
        log.info("len(loader) is %d as saved (estimated %d now)", saved_length, batches_per_epoch)
    return ResumePoint(state.epoch, state.done, state.workers, saved_length)


def elsewhere(
    states: list[LoaderState],
    worker_config: WorkerConfig,
    config: Mapping[str, Any],
    pass_size: int,
    batches_per_epoch: int,
) -> ResumePoint:
    """The states of all ranks of a run, resumed on ``worker_config``, another topology: the
    epoch keeps the share of its batches already taken, at this loader's epoch length."""
    first = states[0]
    # 0: an evaluation loader's state saved before its length was counted (it restarts anyway)
    saved_length = first.config["batches_per_epoch"] or batches_per_epoch
    check_resume(first.config, config)
    workers = remap(
        states,
        pass_size,
        worker_config.rank,
        worker_config.world_size,
        worker_config.workers_per_rank,
    )
    done = min(batches_per_epoch, round(first.done * batches_per_epoch / saved_length))
    log.info(
        "resumed %d ranks x %d workers on %d x %d: epoch %d goes on at batch %d of %d "
        "(%d of %d as saved)",
        first.topology["world_size"],
        first.topology["num_workers"],
        worker_config.world_size,
        worker_config.num_workers,
        first.epoch,
        done,
        batches_per_epoch,
        first.done,
        saved_length,
    )
    return ResumePoint(first.epoch, done, workers, batches_per_epoch)
