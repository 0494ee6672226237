"""Evaluation loaders: one pass in the indexes' order, every sample once, and the same number
of batches on every rank.

A Loader made with ``evaluation=True`` reads every sample of every source once (a mixture's
``repeat``, ``choose`` and ``weight`` set aside), in the order the indexes list them, cut into
contiguous near-equal shares of the global workers (``Plan(evaluation=True)``). Nothing is
shuffled, and each iteration is a whole pass from its start: no carry-over. Samples are packed
as in training. Its length is exact: every rank packs every global worker's share of the pass
here, reading and tokenizing it as its stream will (no image is decoded), so all ranks agree
with no collective call. A worker that runs out of packs before the largest share's batches
yields batches of empty rows (no loss tokens, no sample keys): no rank waits in a collective
for another that has no batch left.
"""

from __future__ import annotations

from typing import Any

from ..pipeline.plan import Plan, WorkerConfig


def evaluation_batches(
    plan: Plan, read: Any, tokenize: Any, pack: Any, batch_size: int, worker_config: WorkerConfig
) -> int:
    """``len()`` of an evaluation loader: the batches of the global worker whose share packs
    into the most (``read``, ``tokenize`` and ``pack``: the Loader's stages), times the rank's
    workers (each of them yields that many)."""
    most = 0
    for worker in range(worker_config.global_workers):
        packs = sum(1 for _ in pack(tokenize(read(plan.spans(0, worker)))))
        most = max(most, -(-packs // batch_size))
    return most * worker_config.workers_per_rank
