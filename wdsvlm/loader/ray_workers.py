"""The Loader's workers as Ray actors: each runs the per-worker stream a DataLoader worker runs
(``Stream.play``), placed by Ray wherever it has free CPUs, and the trainer takes their batches
in the DataLoader's round-robin order: batch ``i`` of an epoch from worker ``i % num_workers``.

- **The same batches.** An actor is started with the stream, its slot and the ``WorkerState``
  the Loader holds for that slot, and plays exactly what the DataLoader worker of that slot
  would; so the batches, and the states riding with them, are the same bit for bit.
- **Backpressure.** Each actor has at most ``in_flight`` requests for a batch outstanding; a
  request is sent when the trainer takes a batch of that actor. So at most ``in_flight``
  finished batches per actor wait in Ray's object store, whatever the trainer's pace.
- **Transfer.** Tensors travel as numpy arrays, which Ray's object store holds without
  pickling (uint8 pixels stay uint8); the trainer copies each out of the store once, so a
  batch it keeps does not pin the store's memory.
- **Faults.** An actor that dies (its process killed, its node lost) is started again from
  the state that rode with the last batch taken from it, asked for what its slot has left of
  the epoch: the batches after the fault are those of an undisturbed run, and the skip and
  packing counts its predecessors reported are carried over into the new actor's reports
  (which count from its start), so ``stats()`` counts the epoch as an undisturbed run does.
  A log line names the worker; past ``max_restarts`` in one epoch the error names the worker
  and the cause. An error raised inside the stream (bad data past its limits, a missing
  shard, a state that cannot resume), also while it starts, is raised here at once as it
  was raised there, of its type and with its message, from Ray's error that holds the remote
  traceback: it is not a dead actor, and a restart would raise it again.
- **Connecting.** ``address=None`` in a job of several ranks with no ``RAY_ADDRESS`` and no
  Ray connected is refused (each rank would start a local Ray claiming every CPU of its
  node); an ``address`` ignored because this process is connected to another Ray already is
  logged. A cluster none of whose nodes running now can hold an actor is refused, unless it
  may still come (``get_timeout`` set, or a node that could hold it has left: an autoscaler
  may start it again), which is logged.
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
from .stream import STATE_KEY, STATS_KEY, Stream, quota

log = logging.getLogger("wdsvlm.loader")

EXAMPLES = 10  # "SHARD/KEY" examples per reason a stream's report holds (Stream._take)


class RayWorker:
    """A Ray actor that plays one worker's stream: ``left`` batches of ``epoch`` from
    ``state`` (see ``Stream.play``). The stream starts with the first ``next()``, not in the
    constructor: an error while it starts (a state that cannot resume) is then the error of a
    call, raised in the trainer as it is, where one in the constructor kills the actor and
    reads as a dead actor."""

    def __init__(self, stream: Stream, slot: int, epoch: int, state: WorkerState, left: int):
        self.stream = stream
        self.start = (slot, epoch, state, left)
        self.batches: Iterator[dict] | None = None

    def next(self) -> dict:
        if self.batches is None:
            self.batches = self.stream.play(*self.start)
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


_connected: dict[str, Any] = {}  # the address connect() gave ray.init, and the GCS it reached


def world_size() -> int:
    """The number of processes of this training job: ``WORLD_SIZE`` (torchrun and other
    launchers set it), or ``torch.distributed``'s world size once it is initialised."""
    try:
        size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        size = 1
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        size = max(size, dist.get_world_size())
    return size


def _host_port(address: str) -> tuple[str, str]:
    """``address`` (``HOST:PORT``, maybe ``ray://``) as (IP address, port)."""
    import socket

    host, _, port = address.split("://", 1)[-1].rstrip("/").rpartition(":")
    try:
        host = socket.gethostbyname(host)
    except OSError:
        pass
    return host, port


def same_cluster(address: str, gcs: str | None) -> bool:
    """Whether ``ray.init(address=address)`` would reach the cluster whose GCS is at
    ``gcs``, as far as the address tells: ``"auto"`` does; a ``ray://`` address names
    the client server, whose port is not the GCS's, so only its host is compared."""
    if address == "auto" or gcs is None:
        return address == "auto"
    host, port = _host_port(address)
    there_host, there_port = _host_port(gcs)
    if address.startswith("ray://"):
        return host == there_host
    return (host, port) == (there_host, there_port)


def connect(options: RayWorkers) -> None:
    """Join the Ray cluster the options name (see ``RayWorkers.address``).

    Already connected: that Ray is used whatever ``address`` says (Ray holds one connection per
    process); an ``address`` that names another cluster is logged as ignored. Not connected,
    no ``address`` and no ``RAY_ADDRESS``: a local Ray is started, and refused in a job of
    several processes, each of which would start its own claiming every CPU of the node."""
    import ray

    if ray.is_initialized():
        address = options.address
        if address is None:
            return
        here = gcs_address()
        if _connected.get("address") == address and _connected.get("gcs") == here:
            return  # connected by this function, with this address (an epoch before)
        if not same_cluster(address, here):
            log.warning(
                "RayWorkers(address=%r) is ignored: this process is connected to the Ray "
                "cluster at %s already (ray.init was called before), and its Ray workers run "
                "there; call ray.shutdown() first to join another",
                address,
                here or "an address Ray does not tell",
            )
        return
    extra = dict(options.init_options or {})
    if options.address is None and not os.environ.get("RAY_ADDRESS"):
        processes = world_size()
        if processes > 1:
            raise WdsvlmError(
                f"RayWorkers(address=None) in a job of {processes} processes (WORLD_SIZE, or "
                "torch.distributed's world size), with no RAY_ADDRESS and no Ray connected, "
                "would start a local Ray in each process, each claiming every CPU of its "
                "node: start a Ray cluster (ray start --head, and ray start --address on "
                "the other nodes) and set RAY_ADDRESS=HEAD_IP:6379 for every rank, or pass "
                "RayWorkers(address=...)"
            )
        extra.setdefault("include_dashboard", False)  # a local Ray of this process's own
    ray.init(address=options.address, **extra)
    _connected.update(address=options.address, gcs=gcs_address())


def gcs_address() -> str | None:
    """The GCS address of the Ray cluster this process is connected to, if Ray tells."""
    import ray

    if not ray.is_initialized():  # get_runtime_context() would start a local Ray
        return None
    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - a Ray Client connection, say: the address unknown
        return None


def check_feasible(options: RayWorkers) -> None:
    """Refuse at once what no node of the cluster can hold: an actor that asks for it would
    wait for ever. Unless such a node may still come: with ``get_timeout`` set (the user
    waits for nodes added on demand, and the wait is bounded), or when a node that could
    hold it has left the cluster (an autoscaler that stopped idle nodes starts them again on
    demand); then a warning says what is missing.

    Ray has no public call that says whether a cluster has an autoscaler (its status is
    read through Ray's internal GCS client, and ``ray start --head`` runs the autoscaler's
    monitor even on a fixed cluster), so those two are the signs used."""
    import ray

    wanted = {"CPU": options.cpus_per_worker, **dict(options.resources or {})}
    nodes = ray.nodes()
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive")]
    gone = [n.get("Resources", {}) for n in nodes if not n.get("Alive")]
    for name, amount in wanted.items():
        if not amount or any(node.get(name, 0) >= amount for node in alive):
            continue
        offered = sorted({k for node in alive for k in node if not k.startswith("node:")})
        missing = (
            f"RayWorkers asks for {amount} {name} per worker, and no node of the Ray cluster "
            f"running now has that many (the nodes offer {', '.join(offered) or 'nothing'})"
        )
        left = any(node.get(name, 0) >= amount for node in gone)
        if options.get_timeout is None and not left:
            raise WdsvlmError(
                f"{missing}: start nodes with it (ray start --num-cpus / --resources), or ask "
                "for less; on a cluster that adds nodes on demand (an autoscaler), set "
                "RayWorkers(get_timeout=...) to wait for them"
            )
        log.warning(
            "%s; the actors wait for a node that has (%s)",
            missing,
            f"at most get_timeout={options.get_timeout} s for each batch"
            if options.get_timeout is not None
            else "a node that had it left the cluster, an autoscaler may start it again; "
            "without get_timeout the wait has no limit",
        )


def carried_over(before: dict, after: dict) -> dict:
    """The stats report ``after`` of a restarted actor's stream (counted from its start) with
    ``before``, the report of the last batch taken from its predecessors, added in: what one
    undisturbed stream would report. Counts add, per reason too; example lists are joined up
    to the length a stream keeps; the packing ratios are computed again. The stage seconds
    (``timing``) are each batch's own, since the slot's batch before: ``after``'s as they are."""
    out = _added(before, after)
    if "slot" in after:
        out["slot"] = after["slot"]
    out.pop("timing", None)  # not added: each batch's own
    if "timing" in after:
        out["timing"] = after["timing"]
    packing, was, now = out.get("packing"), before.get("packing"), after.get("packing")
    if isinstance(packing, dict) and isinstance(was, dict) and isinstance(now, dict):
        packs = packing.get("packs", 0)
        if packs and "samples_per_pack" in packing:
            packing["samples_per_pack"] = packing.get("samples", 0) / packs
        if packs and "tiles_per_pack" in packing:
            tiles = sum(r.get("tiles_per_pack", 0) * r.get("packs", 0) for r in (was, now))
            packing["tiles_per_pack"] = tiles / packs
        if "fill" in packing and out.get("capacity"):
            packing["fill"] = out.get("tokens", 0) / out["capacity"]
    return out


def _added(before: Any, after: Any, key: str | None = None) -> Any:
    if isinstance(after, dict) and isinstance(before, dict):
        out = dict(before)
        for name, value in after.items():
            out[name] = _added(before[name], value, name) if name in before else value
        return out
    if isinstance(after, bool) or isinstance(before, bool):
        return after
    if isinstance(after, int) and isinstance(before, int):
        return before + after
    if key == "seconds" and isinstance(after, float) and isinstance(before, (int, float)):
        return before + after  # the requests' seconds (other floats are ratios)
    if isinstance(after, list) and isinstance(before, list):
        numbers = (int, float)
        if all(isinstance(v, numbers) for v in before + after) and len(before) == len(after):
            return [a + b for a, b in zip(before, after, strict=True)]  # batch_tiles figures
        return (before + after)[: max(EXAMPLES, len(before), len(after))]  # "SHARD/KEY"s
    return after  # a ratio (computed again by the caller), the slot


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
    left = [quota(done, total, workers, slot) for slot in range(workers)]
    pending: list[deque] = [deque() for _ in range(workers)]
    reports: list[dict | None] = [None] * workers  # of the last batch taken from each slot
    carried: list[dict | None] = [None] * workers  # that of a restarted slot's predecessors
    actors: dict[int, Any] = {}
    restarts = 0
    shared = ray.put(stream.portable())
    make = actor_class().options(**options.actor_options())

    def start(slot: int) -> None:
        pending[slot].clear()
        actors[slot] = make.remote(shared, slot, epoch, states[slot], left[slot])
        for _ in range(min(options.in_flight, left[slot])):
            pending[slot].append(actors[slot].next.remote())

    def restart(slot: int, cause: BaseException) -> None:
        nonlocal restarts
        restarts += 1
        worker = stream.plan.worker_config.global_worker(slot)
        if restarts > options.max_restarts:
            raise WdsvlmError(
                f"Ray worker {slot} (global worker {worker}) died and {options.max_restarts} "
                f"restarts in epoch {epoch} are used up (RayWorkers max_restarts): "
                f"{type(cause).__name__}: {cause}"
            ) from cause
        log.warning(
            "Ray worker %d (global worker %d) died (%s); restarting it from its state after "
            "its last batch taken, %d batches of epoch %d left for it (restart %d of %d)",
            slot,
            worker,
            type(cause).__name__,
            left[slot],
            epoch,
            restarts,
            options.max_restarts,
        )
        ray.kill(actors.pop(slot), no_restart=True)
        carried[slot] = reports[slot]  # the new actor's reports count from its start
        start(slot)

    try:
        for slot in range(workers):
            if left[slot]:
                start(slot)
        for i in range(done, total):
            slot = i % workers
            while True:
                try:
                    batch = ray.get(pending[slot][0], timeout=options.get_timeout)
                    break
                except RayTaskError as e:  # the stream itself raised: as it was raised there
                    raise raised_there(e) from e
                except (RayActorError, ObjectLostError) as e:
                    if getattr(e, "actor_init_failed", False):  # not a death: it would again
                        worker = stream.plan.worker_config.global_worker(slot)
                        raise WdsvlmError(
                            f"Ray worker {slot} (global worker {worker}) could not start: {e}"
                        ) from e
                    restart(slot, e)
                except GetTimeoutError as e:
                    raise WdsvlmError(
                        f"Ray worker {slot} gave no batch in {options.get_timeout} s "
                        "(RayWorkers get_timeout)"
                    ) from e
            pending[slot].popleft()
            left[slot] -= 1
            states[slot] = batch[STATE_KEY]["state"]
            if carried[slot] is not None and isinstance(batch.get(STATS_KEY), dict):
                batch[STATS_KEY] = carried_over(carried[slot], batch[STATS_KEY])
            reports[slot] = batch.get(STATS_KEY)
            if len(pending[slot]) < min(options.in_flight, left[slot]):
                pending[slot].append(actors[slot].next.remote())
            out = to_tensors(batch, pin_memory)
            del batch  # the store's copy goes now, not when the trainer asks for the next
            yield out
    finally:
        for actor in actors.values():
            ray.kill(actor, no_restart=True)
        actors.clear()
        pending.clear()
