"""The first batch from the training process while the DataLoader workers start.

Workers from the fork server cannot start until it has imported torch and the pipeline (about
1.5 s, once per training process; ``spawn``'s workers import at every start), and meanwhile
the training process, which only waits for batches, has nothing to do. So, when the workers
start slowly (``workers.workers_start_slowly``), a thread starts them while this process makes
the epoch's next batch itself, on a copy of the stream of its own, and yields it as soon as it
is made; the DataLoader's batches follow.

The batches are the same, bit for bit, as workers alone would give: batch ``done`` is stream
``done % num_workers``'s next one whoever makes it, and the worker that plays that stream goes
on from the state after it, as a resumed loader does, except that the samples its buffers held
come from here with the state (``Stream.held_samples``: a stage changes a sample in place as
it passes it on, so each comes as its stage holds it) instead of being read and tokenized
again. The workers are started with the job of the batches after that one (``done + 1``), so
that the DataLoader's round robin asks them for those; the worker of the stream played here
waits, at its start, for the state and the samples (``Stream.__iter__``), which the thread
sends over a pipe once the workers are up and the batch is made. That stream has one batch
fewer left to make in the workers; the other workers start as they would without this.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .stream import STATE_KEY, STATS_KEY, Stream

log = logging.getLogger("wdsvlm.loader")

MADE_HERE = "training process"  # the stats of a batch made here are kept apart per stream


def first_batch_here(stream: Stream, dataloader: Any, context: Any, pin: bool) -> Iterator[dict]:
    """The epoch's batches from ``stream.job`` on: the next one made in this process while a
    thread starts ``dataloader``'s workers (``context``: their multiprocessing context), then
    the DataLoader's. ``pin``: pin the batch made here, as the DataLoader pins its own."""
    job = stream.job
    epoch, done, states = job["epoch"], job["done"], list(job["states"])
    role = done % stream.workers
    mine = stream.private_copy()  # the thread pickles `stream` for the workers meanwhile
    receive, send = context.Pipe(duplex=False)
    waiting = list(states)
    waiting[role] = None  # its worker waits for the state after the batch made here
    stream.job = {"epoch": epoch, "done": done + 1, "states": waiting, "handover": receive}
    log.debug("batch %d of epoch %d is made here while the workers start", done, epoch)
    handed: Future = Future()  # the state after the batch made here, and its held samples
    _watch_workers()
    pool = ThreadPoolExecutor(1, thread_name_prefix="wdsvlm-start-workers")
    started = pool.submit(_start_workers, dataloader, receive, send, handed)
    pool.shutdown(wait=False)  # its thread ends once the workers run and have the state
    try:
        batch, held = _one_batch(mine, role, epoch, states[role])
    except BaseException as e:
        handed.set_exception(e)  # the waiting worker gets no state: it stops
        _stop(started)
        raise
    handed.set_result((batch[STATE_KEY]["state"], held))
    try:
        yield _pinned(batch) if pin else batch
    except GeneratorExit:  # no more batches wanted
        _stop(started)
        raise
    workers = started.result()  # raises what starting them raised
    try:
        yield from workers
    except Exception:
        _stop(started)  # now, not when the traceback that holds them goes
        raise


def _watch_workers() -> None:
    """The DataLoader's SIGCHLD handler, which raises at once when a worker dies: torch sets
    it as its workers start, but only on the main thread, and here they start on another
    (without it a dead worker is noticed by the DataLoader's status check, seconds later)."""
    from torch.utils.data._utils import signal_handling

    signal_handling._set_SIGCHLD_handler()  # a no-op off the main thread, as in torch


def _start_workers(dataloader: Any, receive: Any, send: Any, handed: Future) -> Iterator:
    """Start the DataLoader's workers (waiting for the fork server's imports), then send the
    worker that waits for them the state after the batch made here and the samples its
    stream holds; the DataLoader's iterator."""
    try:
        try:
            workers = iter(dataloader)
        finally:
            receive.close()  # the workers hold their copies
        if handed.exception() is None:  # waits for the batch made here
            send.send(handed.result())
        return workers
    finally:
        send.close()  # a worker still waiting for the state sees the end, and stops


def _one_batch(stream: Stream, role: int, epoch: int, state: Any) -> tuple[dict, dict]:
    """Stream ``role``'s next batch from ``state``, and the samples its stages hold after it
    (by place, as they hold them); its reader stops then."""
    try:
        batch = next(stream.play(role, epoch, state, 1, keep=True))
        held = stream.held_samples(batch[STATE_KEY]["state"])
    finally:
        stream.forget()
    batch[STATS_KEY]["worker"] = (MADE_HERE, role)
    return batch, held


def _stop(started: Future) -> None:
    """Stop the DataLoader's workers once started (if they could be)."""
    if started.exception() is None:  # waits for the start
        shutdown = getattr(started.result(), "_shutdown_workers", None)  # torch's, as __del__
        if shutdown is not None:
            shutdown()


def _pinned(batch: dict) -> dict:
    import torch

    return {k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
