"""Where a Loader's workers run: ``"local"`` (DataLoader processes on the training node, the
default) or ``RayWorkers(...)`` (Ray actors, wherever a Ray cluster has free CPUs).

Both run the same per-worker stream (``stream.py``) and hand back (batch, state) the same way,
so the batches are the same bit for bit and a ``state_dict()`` of one resumes with the other.
This module holds only the options; ``ray_workers.py`` runs them. Ray itself is imported only
when Ray workers start.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import WdsvlmError

LOCAL = "local"


@dataclass(frozen=True)
class RayWorkers:
    """Run each of a rank's ``num_workers`` workers as a Ray actor.

    ``address``: what ``ray.init(address=...)`` takes (``"HOST:PORT"`` of a ``ray start
    --head`` cluster, ``"auto"``, a ``ray://`` client address); None joins the Ray this process
    is connected to already (``ray.init`` was called, or it runs inside Ray Train), else the
    cluster ``RAY_ADDRESS`` names, else starts a local one: in a job of several processes
    (``WORLD_SIZE`` or ``torch.distributed``'s world size over 1) that is refused, as each rank
    would start its own Ray claiming every CPU of its node. A process connected to Ray already
    keeps that connection: an ``address`` naming another cluster is ignored, with a warning.
    ``init_options`` go to ``ray.init`` when this connects.
    ``cpus_per_worker``: the CPUs each actor reserves. ``resources`` (custom resources, e.g.
    ``{"preprocess": 1}`` for nodes started with ``--resources``), ``label_selector`` (node
    labels), ``scheduling_strategy`` (e.g. Ray's ``NodeAffinitySchedulingStrategy``) and
    ``runtime_env`` pin the actors to nodes and set their environment: the trainer's
    environment variables are not copied to them.
    ``in_flight``: batches each actor may have finished and waiting for the trainer (in Ray's
    object store); a slow trainer slows the actors instead of growing memory.
    ``max_restarts``: actors that die (their process killed, their node lost) in one epoch of
    one rank and are started again from the state that rode with the last batch taken from
    them; one more and the Loader raises, naming the worker and the cause. An error the
    stream raises (also while it starts: a state that cannot resume) is not a death: it is
    raised at once, as local workers raise it.
    ``get_timeout``: seconds to wait for one batch before raising (None: no limit; a dead
    actor is noticed by Ray whatever this is). Actors no node running now can hold are
    refused at once, unless ``get_timeout`` is set or a node that could hold them has left
    the cluster: then a warning, and the actors wait for an autoscaler to add such a node
    (the first batch's wait includes the node's start: allow for it).
    """

    address: str | None = None
    cpus_per_worker: float = 1
    in_flight: int = 2
    max_restarts: int = 3
    resources: Mapping[str, float] | None = field(default=None, hash=False)
    label_selector: Mapping[str, str] | None = field(default=None, hash=False)
    scheduling_strategy: Any = field(default=None, hash=False)
    runtime_env: Mapping[str, Any] | None = field(default=None, hash=False)
    init_options: Mapping[str, Any] | None = field(default=None, hash=False)
    get_timeout: float | None = None

    def __post_init__(self):
        if not isinstance(self.in_flight, int) or isinstance(self.in_flight, bool):
            raise ValueError(f"RayWorkers in_flight must be a whole number, not {self.in_flight!r}")
        if self.in_flight < 1:
            raise ValueError(f"RayWorkers in_flight must be at least 1, not {self.in_flight}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(
                f"RayWorkers max_restarts must be a whole number of at least 0, "
                f"not {self.max_restarts!r}"
            )
        if not isinstance(self.cpus_per_worker, (int, float)) or self.cpus_per_worker < 0:
            raise ValueError(
                f"RayWorkers cpus_per_worker must be a number of at least 0, "
                f"not {self.cpus_per_worker!r}"
            )
        if self.get_timeout is not None and not self.get_timeout > 0:
            raise ValueError(f"RayWorkers get_timeout must be positive, not {self.get_timeout!r}")

    def actor_options(self) -> dict[str, Any]:
        """The options each actor is created with (``ActorClass.options(...)``)."""
        options: dict[str, Any] = {"num_cpus": self.cpus_per_worker, "max_restarts": 0}
        for name in ("resources", "label_selector", "runtime_env"):
            value = getattr(self, name)
            if value:
                options[name] = dict(value)
        if self.scheduling_strategy is not None:
            options["scheduling_strategy"] = self.scheduling_strategy
        return options


def check_workers(workers: Any, num_workers: int) -> None:
    """Refuse a ``workers=`` setting that cannot work, saying what would."""
    if isinstance(workers, RayWorkers):
        if num_workers < 1:
            raise ValueError(
                "workers=RayWorkers(...) runs num_workers Ray actors per rank: pass "
                "num_workers=1 or more"
            )
        return
    if workers != LOCAL:
        raise ValueError(
            f'workers must be "local" (DataLoader processes) or wdsvlm.RayWorkers(...), '
            f"not {workers!r}"
        )


def check_ranks(config: Any, settings: Any) -> None:
    """At each iteration of a Loader: the rank and world size it read from the environment when
    it was built must agree with ``torch.distributed``'s now (a Loader built before
    ``init_process_group`` in a launcher that sets no ``RANK`` believes it is rank 0 of 1,
    and every rank would read the whole dataset). Those given as ``rank=`` and
    ``world_size=`` are the user's (a data-parallel group's, say): not checked."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    here = (config.rank, config.world_size)
    there = (dist.get_rank(), dist.get_world_size())
    read = (settings.rank is None, settings.world_size is None)
    if any(r and a != b for r, a, b in zip(read, here, there, strict=True)):
        raise WdsvlmError(
            f"this Loader was built as rank {here[0]} of {here[1]} (read from the "
            "environment when it was built), but torch.distributed says this process is "
            f"rank {there[0]} of {there[1]}: each rank would read the wrong share of the "
            "data. Build the Loader after init_process_group, or pass it rank= and "
            "world_size="
        )
