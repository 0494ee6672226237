"""Evaluation loaders: one pass in the indexes' order, every sample once, and the same number
of batches on every rank.

A Loader made with ``evaluation=True`` reads every sample of every source once (a mixture's
``repeat``, ``choose`` and ``weight`` set aside), in the order the indexes list them, cut into
contiguous near-equal shares of the global workers (``Plan(evaluation=True)``). Nothing is
shuffled, and each iteration is a whole pass from its start: no carry-over. Samples are packed
as in training. A worker that runs out of packs before the largest share's batches yields
batches of empty rows (no loss tokens, no sample keys): no rank waits in a collective for
another that has no batch left.

Its length is the batches of the share that packs into the most, and finding it means reading
and tokenizing the shares as the stream will (no image is decoded): the index says how many
images and characters a sample has, not how many tokens the tokenizer, the chat template and
the family make of it. It is counted once, at the first ``len()`` or iteration, not when the
Loader is built:

- under ``torch.distributed``, when the Loader's world is the process group's, each rank
  counts its own share only and one ``all_reduce(MAX)`` gives every rank the same length: the
  store is read once over all ranks, not once a rank. The step count is the one figure every
  rank receives, so no read that differs between ranks can make them disagree. A share in
  which a shard could not be read while counting (``on_shard_error="skip"``; the stream may
  read it later) counts as one sample a row (``share_bound``), which no reading of it can
  exceed, so no sample is left out for want of batches. A rank whose count fails makes every
  rank raise, none waits;
- otherwise (one rank, or ranks given as ``rank=``/``world_size=`` with no matching process
  group) every rank counts every share, with no collective call; there, with more than one
  rank, a shard that cannot be read while counting is an error rather than a length that
  another rank, which read it, would not share.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Any

from ..errors import StorageError, WdsvlmError
from ..pipeline.plan import Plan, WorkerConfig
from ..pipeline.stats import SkipStats

log = logging.getLogger("wdsvlm.evaluation")

# Read faults that another read may not meet: a share that met one while counting is bounded.
UNREAD = ("unreadable_shard", "unreadable_sidecar")


def evaluation_batches(
    plan: Plan, read: Any, tokenize: Any, pack: Any, batch_size: int, worker_config: WorkerConfig
) -> int:
    """``len()`` of an evaluation loader: the batches of the global worker whose share packs
    into the most (``read``, ``tokenize`` and ``pack``: the Loader's stages), times the rank's
    workers (each of them yields that many); see the module for who counts what."""
    workers = worker_config.workers_per_rank
    group = process_group_rank(worker_config)
    if group is None:
        counted = [
            share_batches(plan, read, tokenize, pack, batch_size, w)
            for w in range(worker_config.global_workers)
        ]
        unread = sorted({name for _, names in counted for name in names})
        if unread and worker_config.world_size > 1:
            raise StorageError(
                f"the evaluation loader's length cannot be counted: {', '.join(unread[:5])} "
                "could not be read; another rank that read it would count another length, and "
                "the ranks would hang at the end of the pass. Try again, or build the Loader "
                "under torch.distributed (its ranks then agree on the length)"
            )
        return max(n for n, _ in counted) * workers
    own = range(group * workers, (group + 1) * workers)  # this process's share to count
    caught: Exception | None = None
    try:
        most = max(share_batches(plan, read, tokenize, pack, batch_size, w)[0] for w in own)
    except Exception as e:  # noqa: BLE001 - told to every rank first, then raised here
        caught, most = e, 0
    most, failed = all_ranks_most(most, 0 if caught is None else group + 1)
    if caught is not None:
        raise caught
    if failed:
        raise WdsvlmError(
            f"rank {failed - 1} could not count its share of the evaluation pass (its error says "
            "why); every rank stops here rather than wait for it"
        )
    return most * workers


def share_batches(
    plan: Plan, read: Any, tokenize: Any, pack: Any, batch_size: int, worker: int
) -> tuple[int, list[str]]:
    """The batches global worker ``worker``'s share of the pass packs into, and the shards
    that could not be read while counting it (then the batches are ``share_bound``)."""
    reader = copy.copy(read)  # its own count of what it skips
    reader.stats = SkipStats(read.stats.max_consecutive)
    packs = sum(1 for _ in pack(tokenize(reader(plan.spans(0, worker)))))
    samples = [name for reason in UNREAD for name in reader.stats.examples.get(reason, ())]
    unread = sorted({name.rsplit("/", 1)[0] for name in samples})  # "SHARD/KEY": the shards
    if not unread:
        return -(-packs // batch_size), []
    bound = share_bound(plan, worker, batch_size)
    log.warning(
        "global worker %d: %s could not be read while counting the evaluation pass; its share "
        "counts as one sample a row: %d batches (%d from what was read)",
        worker,
        ", ".join(unread[:5]),
        bound,
        -(-packs // batch_size),
    )
    return bound, unread


def share_bound(plan: Plan, worker: int, batch_size: int) -> int:
    """The most batches ``worker``'s share can pack into, whatever of it can be read: every
    pack holds a sample at least, so one sample a row."""
    start, stop = plan.share(worker)
    return -(-(stop - start) // batch_size)


def process_group_rank(worker_config: WorkerConfig) -> int | None:
    """This process's rank in ``torch.distributed``'s group when the loader's world is that
    group (more than one rank, as many as the group's), else ``None``: the ranks then count
    together. Decided alike on every rank of the group (by the world size alone)."""
    import torch.distributed as dist

    if worker_config.world_size < 2 or not (dist.is_available() and dist.is_initialized()):
        return None
    if dist.get_world_size() != worker_config.world_size:
        return None
    return dist.get_rank()


def all_ranks_most(*figures: int) -> list[int]:
    """Each figure's largest value over the ranks of the process group (one all_reduce, on
    the device the backend needs)."""
    import torch
    import torch.distributed as dist

    values = torch.tensor(figures, dtype=torch.long, device=collective_device(dist.get_backend()))
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def collective_device(backend: str) -> Any:
    """Where a tensor for a collective call of ``backend`` lies: NCCL's on this process's GPU,
    the one ``LOCAL_RANK`` names when the launcher (torchrun) set it, so that a script that
    never called ``torch.cuda.set_device`` does not put every rank on ``cuda:0``; else the
    current device. Any other backend (gloo): the CPU."""
    import torch

    if backend != "nccl":
        return torch.device("cpu")
    local_rank = os.environ.get("LOCAL_RANK")
    index = int(local_rank) if local_rank is not None else torch.cuda.current_device()
    return torch.device("cuda", index)
