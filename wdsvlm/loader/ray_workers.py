"""The Loader's workers as Ray actors: each runs the per-worker stream a DataLoader worker runs
(``Stream.play``), placed by Ray wherever it has free CPUs, and the trainer takes their batches
in the DataLoader's round-robin order: batch ``i`` of an epoch from worker ``i % num_workers``.

- **The same batches.** An actor is started with the stream, its role and the ``WorkerState``
  the Loader holds for that role, and plays exactly what the DataLoader worker of that role
  would; so the batches, and the states riding with them, are the same bit for bit.
- **Backpressure.** Each actor has at most ``in_flight`` requests for a batch outstanding; a
  request is sent when the trainer takes a batch of that actor. So at most ``in_flight``
  finished batches per actor wait in Ray's object store, whatever the trainer's pace.
- **Transfer.** Tensors travel as numpy arrays, which Ray's object store holds without
  pickling (uint8 pixels stay uint8); the trainer copies each out of the store once, so a
  batch it keeps does not pin the store's memory.
- **Faults.** An actor that dies (its process killed, its node lost) is started again from
  the state that rode with the last batch taken from it, asked for what its role has left of
  the epoch: the batches after the fault are those of an undisturbed run. A log line names
  the worker; past ``max_restarts`` in one epoch the error names the worker and the cause. An
  error raised inside the stream (bad data past its limits, a missing shard) is raised here
  as it was raised there, of its type and with its message, from Ray's error that holds the
  remote traceback.
- **Clean stop.** The actors are killed when the epoch's batches are taken, when iteration
  stops early, or when the Loader closes or goes.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import WdsvlmError
from .placement import RayWorkers
from .state import WorkerState
from .stream import STATE_KEY, Stream, quota

log = logging.getLogger("wdsvlm.loader")


class RayWorker:
    """A Ray actor that plays one worker's stream: ``left`` batches of ``epoch`` from
    ``state`` (see ``Stream.play``)."""

    def __init__(self, stream: Stream, role: int, epoch: int, state: WorkerState, left: int):
        self.batches = stream.play(role, epoch, state, left)

    def next(self) -> dict:
        return to_arrays(next(self.batches))


def to_arrays(batch: dict) -> dict:
    """The batch with its tensors as numpy arrays (held by Ray's object store unpickled)."""
    return {
        k: v.numpy() if isinstance(v, torch.Tensor) and v.dtype != torch.bfloat16 else v
        for k, v in batch.items()
    }


def to_tensors(batch: dict, pin: bool = False) -> dict:
    """The batch as the actor's stream made it: its arrays as tensors, copied out of the
    object store (whose buffers are read-only and freed once no one holds them)."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(np.array(v, copy=True))
            if pin:
                v = v.pin_memory()
        out[k] = v
    return out


def raised_there(error: Any) -> BaseException:
    """The exception an actor's stream raised (a ``RayTaskError`` wraps it), with its own type
    and message; Ray's remote traceback is the error it is raised from. One that could not
    cross from the actor: Ray's error, an instance of the original's type too."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, Exception):
        return cause
    return error.as_instanceof_cause()


def connect(options: RayWorkers) -> None:
    """Join the Ray cluster the options name (see ``RayWorkers.address``)."""
    import ray

    if ray.is_initialized():
        return
    extra = dict(options.init_options or {})
    if options.address is None and not os.environ.get("RAY_ADDRESS"):
        extra.setdefault("include_dashboard", False)  # a local Ray of this process's own
    ray.init(address=options.address, **extra)


def check_feasible(options: RayWorkers) -> None:
    """Refuse at once what no node of the cluster can ever hold: an actor that asks for it
    would wait for ever (a cluster that adds nodes on demand can use ``get_timeout``)."""
    import ray

    wanted = {"CPU": options.cpus_per_worker, **dict(options.resources or {})}
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    for name, amount in wanted.items():
        if amount and not any(node.get(name, 0) >= amount for node in nodes):
            offered = sorted({k for node in nodes for k in node if not k.startswith("node:")})
            raise WdsvlmError(
                f"RayWorkers asks for {amount} {name} per worker, and no node of the Ray "
                f"cluster has that many (the nodes offer {', '.join(offered) or 'nothing'}): "
                "start nodes with it (ray start --num-cpus / --resources), or ask for less"
            )


def actor_class():
    import ray

    return ray.remote(RayWorker)


def ray_batches(
    stream: Stream,
    epoch: int,
    done: int,
    states: Sequence[WorkerState],
    total: int,
    options: RayWorkers,
    pin_memory: bool = False,
) -> Iterator[dict]:
    """The batches ``[done, total)`` of ``epoch``, played by one Ray actor per worker from
    ``states`` (one per worker, as the Loader holds them), in round-robin order."""
    import ray
    from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError, RayTaskError

    connect(options)
    check_feasible(options)
    workers = len(states)
    states = list(states)
    left = [quota(done, total, workers, role) for role in range(workers)]
    pending: list[deque] = [deque() for _ in range(workers)]
    actors: dict[int, Any] = {}
    restarts = 0
    shared = ray.put(stream.portable())
    make = actor_class().options(**options.actor_options())

    def start(role: int) -> None:
        pending[role].clear()
        actors[role] = make.remote(shared, role, epoch, states[role], left[role])
        for _ in range(min(options.in_flight, left[role])):
            pending[role].append(actors[role].next.remote())

    def restart(role: int, cause: BaseException) -> None:
        nonlocal restarts
        restarts += 1
        worker = stream.plan.worker_config.global_worker(role)
        if restarts > options.max_restarts:
            raise WdsvlmError(
                f"Ray worker {role} (global worker {worker}) died and {options.max_restarts} "
                f"restarts in epoch {epoch} are used up (RayWorkers max_restarts): "
                f"{type(cause).__name__}: {cause}"
            ) from cause
        log.warning(
            "Ray worker %d (global worker %d) died (%s); restarting it from its state after "
            "its last batch taken, %d batches of epoch %d left for it (restart %d of %d)",
            role,
            worker,
            type(cause).__name__,
            left[role],
            epoch,
            restarts,
            options.max_restarts,
        )
        ray.kill(actors.pop(role), no_restart=True)
        start(role)

    try:
        for role in range(workers):
            if left[role]:
                start(role)
        for i in range(done, total):
            role = i % workers
            while True:
                try:
                    batch = ray.get(pending[role][0], timeout=options.get_timeout)
                    break
                except RayTaskError as e:  # the stream itself raised: as it was raised there
                    raise raised_there(e) from e
                except (RayActorError, ObjectLostError) as e:
                    restart(role, e)
                except GetTimeoutError as e:
                    raise WdsvlmError(
                        f"Ray worker {role} gave no batch in {options.get_timeout} s "
                        "(RayWorkers get_timeout)"
                    ) from e
            pending[role].popleft()
            left[role] -= 1
            states[role] = batch[STATE_KEY]["state"]
            if len(pending[role]) < min(options.in_flight, left[role]):
                pending[role].append(actors[role].next.remote())
            out = to_tensors(batch, pin_memory)
            del batch  # the store's copy goes now, not when the trainer asks for the next
            yield out
    finally:
        for actor in actors.values():
            ray.kill(actor, no_restart=True)
        actors.clear()
        pending.clear()
