"""Evaluation on a Loader made with ``evaluation=True``: the loss summed over every supervised
token of every validation sample on every rank, divided by their count (not a mean of
per-batch or per-rank means), and the same per source of a mixture.

``evaluation_loss(model, loader)`` works in any loop (plain torchrun, Accelerate); the
``wdsvlm.hf`` Trainers call it from ``evaluate()`` for an ``eval_dataset`` that is such a
Loader. Every rank runs the model on every one of its batches, the empty ones too, so a model
sharded over the ranks (FSDP, DeepSpeed ZeRO-3), whose forward is itself collective, never
waits for a rank that has stopped.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import WdsvlmError
from ..pipeline.collate import segment_ids
from .feed import LoaderFeed


def evaluation_loss(model: Any, loader: Any, device: Any = None) -> dict[str, float]:
    """``{"loss": ..., "tokens": ..., "loss/SOURCE": ..., "tokens/SOURCE": ...}`` over one whole
    pass of ``loader`` (an evaluation Loader) on every rank: the cross-entropy of each
    supervised next token in float32, summed, over the count of those tokens. The sums are
    added over the ranks with ``torch.distributed`` when it is initialized; every rank gets
    the same figures. The per-source figures come with a mixture; a source with no
    supervised token on any rank (its samples all left out) has its ``tokens/SOURCE`` (0) and
    no ``loss/SOURCE``; with no supervised token at all, ``loss`` is NaN."""
    if not loader.settings.evaluation:
        raise WdsvlmError(
            "evaluation takes a Loader made with evaluation=True: one whole pass, every sample "
            "once, the same number of batches on every rank (a training Loader goes on from "
            "where it stands and carries samples over)"
        )
    device = device if device is not None else next(model.parameters()).device
    names = [s.name for s in loader.plan.sources] if loader.plan.mixture else []
    sums = torch.zeros(2 * (1 + len(names)), dtype=torch.float64, device=device)
    feed = LoaderFeed(loader, device, model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in loader:
                inputs = feed.inputs(batch)
                inputs.pop("labels", None)
                logits = model(**inputs).logits
                labels = batch["labels"][:, 1:].to(logits.device)
                losses = torch.nn.functional.cross_entropy(
                    logits[:, :-1].float().transpose(1, 2), labels, ignore_index=-100,
                    reduction="none",
                )  # fmt: skip
                supervised = labels != -100
                sums[0] += losses.sum().double()
                sums[1] += supervised.sum()
                if names:
                    add_by_source(sums, names, batch, losses, supervised)
    finally:
        model.train(was_training)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(sums)
    tokens = int(sums[1])  # a mean over no token is no figure: NaN, never 0.0
    figures = {"loss": (sums[0] / tokens).item() if tokens else float("nan"), "tokens": tokens}
    for k, name in enumerate(names, start=1):
        tokens = int(sums[2 * k + 1])
        if tokens:
            figures[f"loss/{name}"] = (sums[2 * k] / tokens).item()
        figures[f"tokens/{name}"] = tokens
    return figures


def add_by_source(sums, names: list[str], batch: dict, losses, supervised) -> None:
    """Add each token's loss and count to its sample's source: the sample of a label is its
    packed segment's (``segment_ids`` of the row's positions), the source that sample's."""
    positions = batch["position_ids"]
    if positions.dim() == 3:  # the Qwen family's [4, B, L]: row 0 restarts for each sample
        positions = positions[0]
    segments = (segment_ids(positions) - 1)[:, 1:]  # 0: a row's first sample
    number = {name: k for k, name in enumerate(names)}
    table = torch.full((len(batch["sample_sources"]), segments.shape[1] + 1), -1)
    for r, row in enumerate(batch["sample_sources"]):
        for s, source in enumerate(row):
            table[r, s] = number[source]
    source = torch.gather(table, 1, segments).to(losses.device)
    for k in range(len(names)):
        mine = (source == k) & supervised
        sums[2 * (k + 1)] += losses[mine].sum().double()
        sums[2 * (k + 1) + 1] += mine.sum()


def trainer_evaluate(trainer: Any, loader: Any, prefix: str) -> dict[str, float]:
    """What a ``wdsvlm.hf`` Trainer's ``evaluate()`` returns and logs for an evaluation
    Loader: ``{prefix}_loss`` over every supervised token of every rank, per source
    ``{prefix}_loss_{source}`` for a mixture (not for a source with no supervised token), and
    the run time; the callbacks' ``on_evaluate``
    is called as the Trainer calls it. The training Loader is not touched."""
    import time

    from transformers.trainer_utils import speed_metrics

    config, args = loader.worker_config, trainer.args
    if (config.rank, config.world_size) != (args.process_index, args.world_size):
        raise WdsvlmError(
            f"{type(trainer).__name__}: the evaluation Loader was built for rank {config.rank} "
            f"of world size {config.world_size}, but this Trainer runs as rank "
            f"{args.process_index} of world size {args.world_size}: build it after "
            "torch.distributed.init_process_group (or under torchrun)"
        )
    start = time.time()
    figures = evaluation_loss(trainer.model, loader, args.device)
    metrics = {f"{prefix}_loss": figures["loss"]}
    for key, value in figures.items():
        if key.startswith("loss/"):
            metrics[f"{prefix}_loss_{key[5:]}"] = value
    metrics.update(speed_metrics(prefix, start, num_steps=len(loader)))
    trainer.log(metrics)
    trainer.control = trainer.callback_handler.on_evaluate(
        args, trainer.state, trainer.control, metrics
    )
    return metrics
