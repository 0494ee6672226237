"""The Loader's worker side: one global worker's endless stream of batches, taken a fixed
number of batches per epoch, and the state that resumes it exactly.

A global worker reads its share of pass 0 over the data, then its share of pass 1, and so on,
each pass in its own seeded order. A loader epoch takes a fixed number of batches from that
stream (``len(loader)``, the same on every rank); whatever the epoch did not take (samples
still in the buffers and the rest of the share) is where the next epoch goes on: carried
over, never dropped. So across all ranks and workers every sample comes once per pass.

Batch ``i`` of an epoch comes from the rank's DataLoader worker ``i % num_workers`` (the
DataLoader's round-robin); each worker yields exactly its part of the epoch and stops.

After each batch the worker notes its stream's state (``capture``): what is left to read (the
rest of its share of the current pass, and any places of earlier passes an elastic resume
handed it), and the places ``[pass, place]`` of the samples in the shuffle buffer, in the
tokenizer's batch, in the packing window and in the packs waiting for a batch. Places are in
each pass's global order, the same on any topology. A stream resumed from that state reads
those samples again by their index offsets and carries on with the same batches, bit for bit;
the cost is bounded by the buffer and window sizes, never a replay of the epoch. States of all
ranks of a run resume on another topology (``elastic.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from ..errors import StorageError, WdsvlmError
from ..pipeline.collate import Collate
from ..pipeline.pack import BalanceBatches, Pack
from ..pipeline.plan import Plan
from ..pipeline.read import ReadSamples
from ..pipeline.shuffle import Shuffle
from ..pipeline.stats import SkipStats
from ..pipeline.tokenize import Tokenize

STATE_KEY = "_wdsvlm_state"  # ride on each batch from the worker; the Loader removes them
STATS_KEY = "_wdsvlm_stats"


def place(sample: dict) -> list[int]:
    """A sample's place: ``[pass, place in the pass's global order]`` (the same on any
    topology)."""
    return [sample["__pass__"], sample["__pos__"]]


def fresh_state(epoch: int, segments: list | None = None) -> dict:
    """A stream's state at the start of pass ``epoch``, with empty buffers; or, with
    ``segments`` (``[[pass, [[a, b], ...]], ...]``, passes before ``epoch``), first those
    places of earlier passes (what an elastic resume hands this worker)."""
    return {
        "read": {"segments": segments or [], "next": epoch},
        "shuffle": {"held": [], "draws": 0, "stream": None, "last": None},
        "tokenize": [],
        "window": {"places": [], "came": [], "emitted": 0, "ready": []},
        "balance": [],
    }


def quota(done: int, total: int, workers: int, role: int) -> int:
    """How many of the batches ``[done, total)`` come from worker ``role``, when batch ``i``
    comes from worker ``i % workers``."""
    first = done + (role - done) % workers
    return 0 if first >= total else (total - 1 - first) // workers + 1


def unread(read: dict, last: Sequence[int] | None, share: tuple[int, int]) -> dict:
    """What is left of a worker's reading (``{"segments", "next"}``, see ``fresh_state``)
    once the sample at place ``last`` (``[pass, place]``) was taken: the reading order is
    ascending in ``(pass, place)``, so that is everything after it."""
    if last is None:
        return read
    last_pass, after = last[0], last[1] + 1
    if last_pass >= read["next"]:  # in the worker's own share of a pass: segments all read
        left = [[last_pass, [[after, share[1]]]]] if after < share[1] else []
        return {"segments": left, "next": last_pass + 1}
    segments = []
    for pass_, ranges in read["segments"]:
        if pass_ == last_pass:
            ranges = [[max(a, after), b] for a, b in ranges if b > after]
        if pass_ >= last_pass and ranges:
            segments.append([pass_, ranges])
    return {"segments": segments, "next": read["next"]}


class Stream(IterableDataset):
    """The dataset a Loader hands its DataLoader: in each worker, that worker's part of the
    epoch's batches, each with the worker's stream state and running stats attached.

    ``job`` (set by the Loader before it starts workers) says which epoch, how many of its
    batches were taken already (``done``) and each worker's stream state at that point.
    Worker ``w`` then plays the stream ``(done + w) % num_workers``, so that a resumed epoch
    goes on in the DataLoader's round-robin order. A persistent worker (or the training
    process itself, without workers) keeps its stream between epochs and goes straight on
    when the next epoch follows a whole one.
    """

    def __init__(
        self,
        plan: Plan,
        read: ReadSamples,
        shuffle: Shuffle,
        tokenize: Tokenize,
        pack: Pack,
        balance: BalanceBatches,
        collate: Collate,
        skips: SkipStats,
        batches_per_epoch: int,
    ):
        super().__init__()
        self.plan = plan
        self.read = read
        self.shuffle = shuffle
        self.tokenize = tokenize
        self.pack = pack
        self.balance = balance
        self.collate = collate
        self.skips = skips
        self.batches_per_epoch = batches_per_epoch
        self.job: dict[str, Any] = {
            "epoch": 0,
            "done": 0,
            "states": [fresh_state(0)] * self.workers,
        }
        self._live: dict | None = None
        self._read_since_batch = 0  # samples read since the last batch, and what packing
        self._accepted_at = 0  # had taken in at that batch: the stream's progress

    def __getstate__(self):
        # What a worker gets: the job, not a running stream; and the environment as it is
        # now (credentials set after the fork server started, say), as a forked worker has.
        return {**self.__dict__, "_live": None, "_environ": dict(os.environ)}

    def __setstate__(self, state: dict) -> None:
        environ = state.pop("_environ", None)
        if environ is not None and environ != dict(os.environ):
            os.environ.clear()
            os.environ.update(environ)
        self.__dict__.update(state)

    @property
    def workers(self) -> int:
        return self.plan.worker_config.workers_per_rank

    def forget(self) -> None:
        """Drop the running stream (its read-ahead thread stops now): the next epoch starts
        from ``job``."""
        live, self._live = self._live, None
        if live is not None:
            live["reader"].close()

    def __iter__(self) -> Iterator[dict]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker = info.id if info is not None else 0
        epoch = self.plan.epoch
        live = self._live
        # the stats are per epoch; reset before a resumed stream reads its buffers again, so
        # that what it cannot read again is counted
        self.skips.reset()
        if live and live["epoch"] == epoch - 1 and live["left"] == 0 and live["role"] == worker:
            live["epoch"] = epoch  # the next epoch follows a whole one: go straight on
            live["left"] = quota(0, self.batches_per_epoch, self.workers, worker)
        else:
            job = self.job
            if job["epoch"] != epoch:
                raise WdsvlmError(
                    f"the loader asked for epoch {epoch} but set up epoch {job['epoch']}"
                )
            role = (job["done"] + worker) % self.workers
            self._read_since_batch, self._accepted_at = 0, self.pack.accepted
            live = self._live = self._start(role, epoch, job["states"][role])
            live["left"] = quota(job["done"], self.batches_per_epoch, self.workers, role)
        self.pack.pack_stats.reset()
        self.balance.figures = [0, 0, 0]
        while live["left"] > 0:
            batch = next(live["batches"], None)
            if batch is None:  # the stream is endless: only a bug ends it
                raise WdsvlmError(f"the stream of worker {live['role']} ended")
            live["left"] -= 1
            self._read_since_batch, self._accepted_at = 0, self.pack.accepted
            batch[STATE_KEY] = {"role": live["role"], "state": self.capture(live)}
            batch[STATS_KEY] = {
                "worker": live["role"],
                "skips": self.skips.as_dict(examples=10),  # rides on every batch: keep it small
                "packing": self.pack.pack_stats.as_dict(examples=10),
                "tokens": self.pack.pack_stats.tokens,
                "capacity": self.pack.pack_stats.capacity,
                "batch_tiles": list(self.balance.figures),
            }
            yield batch

    def _start(self, role: int, epoch: int, state: dict) -> dict:
        """The stream of worker ``role`` from ``state`` (``fresh_state``, or a captured one:
        the samples its buffers held are read again)."""
        worker = self.plan.worker_config.global_worker(role)
        held = state["shuffle"]["held"]
        window = state["window"]["places"]
        packs = state["window"]["ready"] + state["balance"]
        again = self._read_again(
            worker, held + state["tokenize"] + window + [p for pack in packs for p in pack]
        )

        def found(places):  # the samples read again (in skip mode, some may be gone)
            return [again[tuple(p)] for p in places if tuple(p) in again]

        came = [
            c for p, c in zip(window, state["window"]["came"], strict=True) if tuple(p) in again
        ]
        reader = self.read(self._spans(worker, state["read"]))
        stages = self.shuffle(
            self._watched(reader, worker), resume={**state["shuffle"], "held": found(held)}
        )
        stages = self.tokenize(stages, resume=found(state["tokenize"]))
        stages = self.pack(
            stages,
            resume={
                "waiting": self._tokenized(found(window)),
                "came": came,
                "emitted": state["window"]["emitted"],
                "ready": [
                    pack
                    for pack in (self._tokenized(found(p)) for p in state["window"]["ready"])
                    if pack
                ],
            },
        )
        waiting = [
            [self.pack.fit(s)[0] for s in self._tokenized(found(pack))] for pack in state["balance"]
        ]
        stages = self.balance(stages, resume=[pack for pack in waiting if pack])
        return {
            "role": role,
            "epoch": epoch,
            "read": state["read"],
            "worker": worker,
            "batches": map(self.collate, stages),
            "reader": reader,
        }

    def _spans(self, worker: int, read: dict) -> Iterator[dict]:
        for pass_, ranges in read["segments"]:  # places of earlier passes handed to it
            yield from self.plan.read_spans(pass_, ranges, worker)
        pass_ = read["next"]
        while True:  # pass after pass; every global worker has a share of each
            yield from self.plan.spans(pass_, worker)
            pass_ += 1

    def _watched(self, samples: Iterator[dict], worker: int) -> Iterator[dict]:
        """``samples`` as read, counted. The stream is endless, so a share in which no sample
        can be packed (all bad data, or all outside the budgets) would be read for ever:
        once two passes' worth has been read since the last batch, beyond what the stages
        can hold (the shuffle buffer, a tokenizer batch), and packing took in none of it, no
        batch can come, and that is an error. Runs in the consumer's thread, as do the
        counts it reads."""
        start, stop = self.plan.share(worker)
        share = stop - start
        limit = 2 * share + self.shuffle.buffer_size + self.tokenize.batch_size + 1
        for sample in samples:
            self._read_since_batch += 1
            if self._read_since_batch > limit and self.pack.accepted == self._accepted_at:
                raise WdsvlmError(self._no_progress(worker, share))
            yield sample

    def _no_progress(self, worker: int, share: int) -> str:
        skipped = dict(self.skips.counts)
        dropped = dict(self.pack.pack_stats.dropped)
        return (
            f"no batch can come: global worker {worker} read {self._read_since_batch} samples "
            f"(its share is {share} a pass) and none could be packed: skipped as bad data "
            f"{skipped or 'none'}, dropped for not fitting {dropped or 'none'} (max_length "
            f"{self.pack.max_length}, max_tiles_per_pack {self.pack.max_tiles_per_pack}). "
            "Raise the budgets, pass truncate=True, or check the data (wdsvlm stats)"
        )

    def _read_again(self, worker: int, places: Sequence[Sequence[int]]) -> dict[tuple, dict]:
        """The samples at ``places``, read again through the index. One that cannot be read
        again (its shard changed or went away since the state was saved) is counted as
        skipped with ``on_shard_error="skip"``, else refused, naming it."""
        by_pass: dict[int, list[int]] = {}
        for p, position in places:
            by_pass.setdefault(p, []).append(position)
        out, names = {}, {}
        for p, positions in by_pass.items():
            spans = self.plan.locate(p, positions, worker)
            for span in spans:
                for entry, position in zip(span["entries"], span["positions"], strict=True):
                    names[(p, position)] = f"{span['shard']}/{entry['key']}"
            try:
                for sample in self.read(iter(spans)):
                    out[(p, sample["__pos__"])] = sample
            except StorageError as e:  # raise mode: a shard of the saved samples is gone
                raise StorageError(
                    f"cannot resume: the saved state (global worker {worker}) holds samples "
                    f"that cannot be read again: {e}"
                ) from e
        missing = [tuple(p) for p in places if tuple(p) not in out]
        if missing and self.read.on_shard_error != "skip":
            shown = ", ".join(names.get(m, f"pass {m[0]} position {m[1]}") for m in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise StorageError(
                f"cannot resume: {len(missing)} samples the saved state holds (global worker "
                f"{worker}) could not be read again: {shown}{more}. Their shards changed or "
                "went away since the state was saved; restore the shards, or pass "
                'on_shard_error="skip" to go on without them (counted as skipped)'
            )
        return out  # in skip mode, the reader counted what is missing as skipped

    def _tokenized(self, samples: list[dict]) -> list[dict]:
        out = self.tokenize.encode(samples)
        if len(out) != len(samples):
            raise WdsvlmError("cannot resume: a sample of the saved state no longer tokenizes")
        return out

    def capture(self, live: dict) -> dict:
        """The stream's state now: small lists of places, no sample bytes."""
        shuffle = self.shuffle.state()
        last = shuffle["last"]
        window = self.pack.state()
        return {
            "read": unread(live["read"], last, self.plan.share(live["worker"])),
            "shuffle": {**shuffle, "held": [place(s) for s in shuffle["held"]]},
            "tokenize": [place(s) for s in self.tokenize.held()],
            "window": {
                "places": [place(s) for s in window["waiting"]],
                "came": window["came"],
                "emitted": window["emitted"],
                "ready": [[place(s) for s in pack] for pack in window["ready"]],
            },
            "balance": [[place(s) for s in pack] for pack in self.balance.held()],
        }
