"""The Loader's worker side: one global worker's endless stream of batches, taken a fixed
number of batches per epoch, and the state that resumes it exactly.

A global worker reads its share of pass 0 over the data, then its share of pass 1, and so on,
each pass in its own seeded order. A loader epoch takes a fixed number of batches from that
stream (``len(loader)``, the same on every rank); whatever the epoch did not take (samples
still in the buffers and the rest of the share) is where the next epoch goes on: carried
over, never dropped. So across all ranks and workers every sample comes once per pass.

Three numbers name a worker, each with its own name here:

- ``global_worker``: the unit the plan splits a pass over, ``rank * num_workers + slot``
  (``pipeline.plan.WorkerConfig``); it decides which samples a stream reads.
- ``slot``: which of the rank's ``num_workers`` streams, ``0 <= slot < num_workers``; batch
  ``i`` of an epoch comes from slot ``i % num_workers``, and ``WorkerState`` is kept per slot.
- ``worker_id``: the DataLoader worker process (torch's ``get_worker_info().id``) that plays a
  slot's stream this epoch: slot ``(done + worker_id) % num_workers``, so that a resumed epoch
  goes on in the DataLoader's round-robin order. A Ray actor plays one slot too.

After each batch the worker notes its stream's state (``capture``, a ``state.WorkerState``):
what is left to read (the rest of its share of the current pass, and any places of earlier
passes an elastic resume handed it), and each buffering stage's run state: the places
``[pass, place]`` of the samples in the shuffle buffer, in the tokenizer's batch, in the
packing window and in the packs waiting for a batch. Places are in each pass's global order,
the same on any topology. A stream resumed from that state reads
those samples again by their index offsets and carries on with the same batches, bit for bit;
the cost is bounded by the buffer and window sizes, never a replay of the epoch. States of all
ranks of a run resume on another topology (``elastic.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.utils.data import IterableDataset

from .. import compat
from ..errors import StorageError, WdsvlmError
from ..pipeline.collate import Collate
from ..pipeline.pack import BalanceBatches, BalanceRun, Pack, PackRun, count_held
from ..pipeline.packer import PackStats
from ..pipeline.places import Fetch, Place, place
from ..pipeline.plan import Plan
from ..pipeline.read import ReadSamples
from ..pipeline.shuffle import Shuffle
from ..pipeline.stats import SkipStats
from ..pipeline.timing import StageClock, stretch
from ..pipeline.tokenize import Tokenize
from .state import ReadCursor, WorkerState
from .workers import adopt_environ

compat.check_torch()  # torch's private names the workers use: fail at import, not mid-run

STATE_KEY = "_wdsvlm_state"  # ride on each batch from the worker; the Loader removes them
STATS_KEY = "_wdsvlm_stats"


# what each of ``Stream.stages`` is charged as (``pipeline.timing.STAGES``)
_TIMED_AS = ("shuffle", "tokenize", "pack", "pack")


def quota(done: int, total: int, workers: int, slot: int) -> int:
    """How many of the batches ``[done, total)`` come from ``slot``, when batch ``i`` comes
    from slot ``i % workers``."""
    first = done + (slot - done) % workers
    return 0 if first >= total else (total - 1 - first) // workers + 1


@dataclass
class LiveStream:
    """One slot's running stream: where its reading started (``read``), the reader, the
    stages' runs in pipeline order, the batches, and what its epoch has ``left`` to give.
    ``read_since_batch`` and ``accepted_at`` (what packing had taken in at the last batch)
    are its progress; ``held``, the packs its batches held this epoch."""

    slot: int
    epoch: int
    global_worker: int
    read: ReadCursor
    reader: Any
    runs: list = field(default_factory=list)
    batches: Iterator[dict] = field(default_factory=lambda: iter(()))
    left: int = 0
    read_since_batch: int = 0
    accepted_at: int = 0
    held: PackStats = field(default_factory=PackStats)
    clock: StageClock | None = None

    @property
    def pack(self) -> PackRun:
        return next(run for run in self.runs if isinstance(run, PackRun))

    @property
    def balance(self) -> BalanceRun:
        return next(run for run in self.runs if isinstance(run, BalanceRun))


class Stream(IterableDataset):
    """The dataset a Loader hands its DataLoader: in each worker, its slot's part of the
    epoch's batches, each with the slot's stream state and running stats attached.

    ``job`` (set by the Loader before it starts workers) says which epoch, how many of its
    batches were taken already (``done``) and each slot's ``WorkerState`` at that point.
    DataLoader worker ``worker_id`` then plays slot ``(done + worker_id) % num_workers``. A
    persistent worker (or the training process itself, without workers) keeps its stream
    between epochs and goes straight on when the next epoch follows a whole one.
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
        self.collate = collate
        # the buffering stages, in the order of WorkerState's stage fields
        self.stages = (shuffle, tokenize, pack, balance)
        self.skips = skips
        self.batches_per_epoch = batches_per_epoch
        self.job: dict[str, Any] = {
            "epoch": 0,
            "done": 0,
            "states": [WorkerState.fresh(0)] * self.workers,
        }
        self._live: LiveStream | None = None
        # set by the Loader before workers start: whether workers time their stages and ship
        # the seconds with each batch (``pipeline.timing``), the ``telemetry.StatusBoard`` of
        # the stage each is in, and how many batches of each slot's stream keep a trace's spans
        self.telemetry: bool = True
        self.board: Any = None
        self.trace_batches: int = 0

    def __getstate__(self):
        # What a worker gets: the job, not a running stream; and, for a worker on this machine,
        # this process's environment, whose changes since the fork server started it adopts
        # (``workers.adopt_environ``).
        state = {**self.__dict__, "_live": None}
        if state.pop("local", True):
            state["_environ"] = dict(os.environ)
        return state

    def portable(self) -> Stream:
        """A copy for a worker on another machine (a Ray actor): without a running stream and
        without this process's environment variables."""
        other = Stream.__new__(Stream)
        other.__dict__.update({**self.__dict__, "_live": None, "local": False})
        return other

    def __setstate__(self, state: dict) -> None:
        adopt_environ(state.pop("_environ", {}))
        self.__dict__.update(state)

    @property
    def _source(self) -> str | None:
        """The name a dataset read alone has in the stats (a mixture's spans name theirs)."""
        return None if self.plan.mixture else self.plan.sources[0].name

    @property
    def workers(self) -> int:
        return self.plan.worker_config.workers_per_rank

    def forget(self) -> None:
        """Drop the running stream (its read-ahead thread stops now): the next epoch starts
        from ``job``."""
        live, self._live = self._live, None
        if live is not None:
            live.reader.close()

    def __iter__(self) -> Iterator[dict]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker_id = info.id if info is not None else 0
        epoch = self.plan.epoch
        live = self._live
        # the stats are per epoch; reset before a resumed stream reads its buffers again, so
        # that what it cannot read again is counted
        self.skips.reset()
        if live and live.epoch == epoch - 1 and live.left == 0 and live.slot == worker_id:
            live.epoch = epoch  # the next epoch follows a whole one: go straight on
            live.left = quota(0, self.batches_per_epoch, self.workers, worker_id)
        else:
            job = self.job
            if job["epoch"] != epoch:
                raise WdsvlmError(
                    f"the loader asked for epoch {epoch} but set up epoch {job['epoch']}"
                )
            slot = (job["done"] + worker_id) % self.workers
            live = self._live = self._start(slot, epoch, job["states"][slot])
            live.left = quota(job["done"], self.batches_per_epoch, self.workers, slot)
        return self._take(live)

    def play(self, slot: int, epoch: int, state: WorkerState, left: int) -> Iterator[dict]:
        """The next ``left`` batches of ``slot``'s stream in ``epoch``, from ``state``: what a
        worker running elsewhere (a Ray actor) yields, the same as the DataLoader worker that
        plays ``slot`` would."""
        self.skips.reset()
        live = self._live = self._start(slot, epoch, state)
        live.left = left
        return self._take(live)

    def _take(self, live: LiveStream) -> Iterator[dict]:
        live.pack.stats.reset()
        live.held.reset()
        live.balance.figures = [0, 0, 0]
        # what the stream does beyond the stages (the state, the report) is the collate step's
        collating = stretch(live.clock, "collate")
        while live.left > 0:
            with collating:
                batch = self._batch(live)
            if live.clock is not None:  # this slot's seconds since its last batch
                timing = live.clock.take()
                batch[STATS_KEY]["timing"] = {"pid": os.getpid(), "slot": live.slot, **timing}
            yield batch

    def _batch(self, live: LiveStream) -> dict:
        """The stream's next batch, with its state and its report attached."""
        batch = next(live.batches, None)
        if batch is None and self.plan.evaluation:  # its pass is read: empty rows
            batch = self.collate([])
        elif batch is None:  # the stream is endless: only a bug ends it
            raise WdsvlmError(f"the stream of slot {live.slot} ended")
        live.left -= 1
        live.read_since_batch, live.accepted_at = 0, live.pack.accepted
        batch[STATE_KEY] = {"slot": live.slot, "state": self.capture(live)}
        # drops as read this epoch; packs as this epoch's batches hold them (a pack made
        # in one epoch may wait for a batch of the next)
        packing, held = live.pack.stats, live.held
        batch[STATS_KEY] = {
            "slot": live.slot,
            # rides on every batch: keep it small; reads of a dataset alone under its name
            "skips": self.skips.as_dict(examples=10, source=self._source),
            "packing": packing.as_dict(examples=10, packs=held),
            "tokens": held.tokens,
            "capacity": held.capacity,
            "batch_tiles": list(live.balance.figures),
        }
        return batch

    def _start(self, slot: int, epoch: int, state: WorkerState) -> LiveStream:
        """``slot``'s stream from ``state`` (fresh, or a captured one: the samples its stages
        held are read again, and each stage restored from its state)."""
        global_worker = self.plan.worker_config.global_worker(slot)
        clock = self._clocked(slot)
        with stretch(clock, "read"):  # charged to the stream's first batch
            again = self._read_again(global_worker, state.held_places())
        reader = self.read(self._spans(global_worker, state.read))
        live = LiveStream(slot, epoch, global_worker, state.read, reader, clock=clock)
        upstream: Iterator = reader if clock is None else clock.timed("read", reader)
        upstream = self._watched(upstream, live)
        for k, (stage, saved) in enumerate(zip(self.stages, state.stages(), strict=True)):
            run = stage.restore(saved, upstream, self._fetcher(again, self.stages[:k]))
            live.runs.append(run)
            upstream = run if clock is None else clock.timed(_TIMED_AS[k], run)
        live.batches = map(self.collate, self._counted(upstream, live))
        return live

    def _clocked(self, slot: int) -> StageClock | None:
        """A clock for ``slot``'s stream, handed to the stages that time stretches of their
        own work (reads waiting on the store, the user's functions, decoding); None, and the
        stages' clocks taken away, with telemetry off."""
        clock = StageClock(self.board, slot, self.trace_batches) if self.telemetry else None
        users = (self.tokenize.sample_map, self.collate.image_map)
        for stage in (self.read, self.collate, *(u for u in users if u is not None)):
            stage.clock = clock
        return clock

    def _counted(self, batches: Iterator[list], live: LiveStream) -> Iterator[list]:
        """The balance stage's batches (lists of packs), each pack counted in ``live.held``
        as its batch goes on."""
        for batch in batches:
            for pack in batch:
                count_held(live.held, pack, self.pack.max_length)
            yield batch

    def capture(self, live: LiveStream) -> WorkerState:
        """The stream's state now: small lists of places, no sample bytes. What is left to
        read follows the last sample the first stage (the shuffle buffer) took in."""
        state = WorkerState.of(live.read, [run.state() for run in live.runs])
        state.read = live.read.after(state.shuffle.last, self.plan.share(live.global_worker))
        return state

    def _fetcher(self, again: dict[tuple, dict], before: Sequence[Any]) -> Fetch:
        """The samples at some places as they come into the stage after ``before``: read
        again (``again``), then passed through each of ``before`` (``again()``)."""

        def fetch(places: Sequence[Place]) -> list:
            found = [again.get((p[0], p[1])) for p in places]
            # a piece of a document: the document, asking for that piece only
            found = [
                {**s, "__piece__": p[2]} if s is not None and len(p) == 3 else s
                for s, p in zip(found, places, strict=True)
            ]
            samples = [s for s in found if s is not None]
            for stage in before:
                passed = stage.again(samples)
                if len(passed) != len(samples):
                    kept = {tuple(place(s)) for s in passed}  # (a piece is a new dict)
                    lost = [
                        f"{s.get('__shard__')}/{s.get('__key__')}"
                        for s in samples
                        if tuple(place(s)) not in kept
                    ]
                    raise WdsvlmError(
                        f"cannot resume: samples the saved state holds no longer pass the "
                        f"{type(stage).__name__} stage: {', '.join(lost[:5]) or '?'}"
                    )
                samples = passed
            taken = iter(samples)
            return [None if s is None else next(taken) for s in found]

        return fetch

    def _spans(self, global_worker: int, read: ReadCursor) -> Iterator[dict]:
        for pass_, ranges in read.segments:  # places of earlier passes handed to it
            yield from self.plan.read_spans(pass_, ranges, global_worker)
        pass_ = read.next
        while True:  # pass after pass; every global worker has a share of each
            yield from self.plan.spans(pass_, global_worker)
            if self.plan.evaluation:  # one pass
                return
            pass_ += 1

    def _watched(self, samples: Iterator[dict], live: LiveStream) -> Iterator[dict]:
        """``samples`` as read, counted. The stream is endless, so a share in which no sample
        can be packed (all bad data, or all outside the budgets) would be read for ever:
        once two passes' worth has been read since the last batch, beyond what the stages
        can hold (the shuffle buffer, a tokenizer batch), and packing took in none of it, no
        batch can come, and that is an error. Runs in the consumer's thread, as do the
        counts it reads."""
        start, stop = self.plan.share(live.global_worker)
        share = stop - start
        limit = 2 * share + self.shuffle.buffer_size + self.tokenize.batch_size + 1
        for sample in samples:
            live.read_since_batch += 1
            if live.read_since_batch > limit and live.pack.accepted == live.accepted_at:
                raise WdsvlmError(self._no_progress(live, share))
            yield sample

    def _no_progress(self, live: LiveStream, share: int) -> str:
        skipped = dict(self.skips.counts)
        dropped = dict(live.pack.stats.dropped)
        return (
            f"no batch can come: global worker {live.global_worker} read {live.read_since_batch} "
            f"samples (its share is {share} a pass) and none could be packed: skipped as bad "
            f"data {skipped or 'none'}, dropped for not fitting {dropped or 'none'} "
            f"(max_length {self.pack.max_length}, max_tiles_per_pack "
            f"{self.pack.max_tiles_per_pack}). Raise the budgets, pass truncate=True, or "
            "check the data (wdsvlm stats)"
        )

    def _read_again(self, global_worker: int, places: Sequence[Sequence[int]]) -> dict[tuple, dict]:
        """The samples at ``places``, read again through the index. One that cannot be read
        again (its shard changed or went away since the state was saved) is counted as
        skipped with ``on_shard_error="skip"``, else refused, naming it."""
        by_pass: dict[int, list[int]] = {}
        for p, position in sorted({(p[0], p[1]) for p in places}):  # a document's pieces: once
            by_pass.setdefault(p, []).append(position)
        out, names = {}, {}
        for p, positions in by_pass.items():
            spans = self.plan.locate(p, positions, global_worker)
            for span in spans:
                for entry, position in zip(span["entries"], span["positions"], strict=True):
                    names[(p, position)] = f"{span['shard']}/{entry['key']}"
            try:
                for sample in self.read(iter(spans)):
                    out[(p, sample["__pos__"])] = sample
            except StorageError as e:  # raise mode: a shard of the saved samples is gone
                raise StorageError(
                    f"cannot resume: the saved state (global worker {global_worker}) holds "
                    "samples "
                    f"that cannot be read again: {e}"
                ) from e
        missing = sorted({(p[0], p[1]) for p in places} - set(out))
        if missing and self.read.on_shard_error != "skip":
            shown = ", ".join(names.get(m, f"pass {m[0]} position {m[1]}") for m in missing[:5])
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise StorageError(
                f"cannot resume: {len(missing)} samples the saved state holds (global worker "
                f"{global_worker}) could not be read again: {shown}{more}. Their shards changed or "
                "went away since the state was saved; restore the shards, or pass "
                'on_shard_error="skip" to go on without them (counted as skipped)'
            )
        return out  # in skip mode, the reader counted what is missing as skipped
