"""Plan: which samples one global worker reads in a pass over the data, and in which order.

Everything follows from explicit inputs. ``(sources, seed, pass)`` decide the pass's global
order (``PassOrder``): which samples the pass holds (every source's share, see
``sources.py``) and in which order (``order.py``), the same on every topology. The worker's place
``rank * num_workers + slot`` (``slot``: which of the rank's workers, the DataLoader worker's id
in a plain pipeline) among ``world_size * num_workers`` global workers decides
its share: a contiguous block of that order, read in order. The split is by samples, so any
shard count works with any worker count, and a sample's place ``[pass, place]`` means the same
sample on any topology: that is what lets a checkpoint resume on another one.

The order is built from chunks: runs of about ``span_bytes`` of neighbouring samples and at
most ``span_samples`` samples, visited in a keyed random order, the samples of each visit in a
keyed random order of their own. Plan version 3 (``keyed.py``) computes any place's visit from
closed forms, so a worker plans its block alone; version 2 (``order.PassOrder``, chunks within
one shard, the whole pass's visits shuffled in every worker) is kept to resume runs saved then.
A worker reads each visit with one ranged read (a few, where it takes only a sparse part of
it), several at once (``ReadSamples``).
The chunk's size trades I/O for mixing: a shuffle buffer of ``B`` samples fed chunk by chunk
holds about ``2 B / m`` chunks of ``m`` samples, so about ``m / 2B`` of a worker's consecutive
samples come from one chunk whatever order the buffer draws in; ``SPAN_BYTES`` (1 MiB) keeps
that under 1% for samples of 60 KB and more with the default buffer (docs/performance.md).
Smaller samples would fill a chunk by the hundred: ``SPAN_SAMPLES`` caps a chunk at 32
samples, and the Loader's default buffer holds more of them (``loader/build.py``).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset

from ..errors import ShardFormatError, StorageError
from . import order
from .keyed import KeyedOrder
from .order import SPAN_BYTES, SPAN_SAMPLES, PassOrder, joins, one_read
from .schedule import Schedule
from .sources import DataSource, resolve_sources

log = logging.getLogger("wdsvlm.plan")


@dataclass(frozen=True)
class WorkerConfig:
    """Where this process stands among the data-loading processes of a training job."""

    rank: int = 0
    """This process's rank among ``world_size`` training processes."""
    world_size: int = 1
    """Number of training processes."""
    num_workers: int = 0
    """DataLoader workers per rank; 0 means the rank loads data itself (one worker slot)."""

    def __post_init__(self):
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, not {self.num_workers}")

    @classmethod
    def from_environment(cls, num_workers: int = 0) -> WorkerConfig:
        """rank and world size from ``torch.distributed`` when it is initialized, else from
        the ``RANK`` / ``WORLD_SIZE`` variables torchrun sets, else 0 and 1."""
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return cls(dist.get_rank(), dist.get_world_size(), num_workers)
        except ImportError:  # torch is a dependency, but planning does not need it
            pass
        rank = int(os.environ.get("RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        return cls(rank, world_size, num_workers)

    @property
    def workers_per_rank(self) -> int:
        return max(1, self.num_workers)

    @property
    def global_workers(self) -> int:
        return self.world_size * self.workers_per_rank

    def global_worker(self, slot: int) -> int:
        """The global worker of the rank's ``slot``-th worker."""
        return self.rank * self.workers_per_rank + slot


def current_worker_id(config: WorkerConfig) -> int:
    """The DataLoader worker this code runs in (0 outside workers), checked against config."""
    try:
        from torch.utils.data import get_worker_info
    except ImportError:
        return 0
    info = get_worker_info()
    if info is None:
        return 0
    if info.num_workers != config.workers_per_rank:
        raise ValueError(
            f"the DataLoader has {info.num_workers} workers but the plan was made for "
            f"{config.workers_per_rank}: pass num_workers={info.num_workers} to the plan"
        )
    return info.id


PLAN_VERSION = 3
"""The order of a pass: 3, keyed (``keyed.py``: a worker plans its own block alone); 2, the
pass's visits shuffled in every worker (``order.PassOrder``), kept so that a run saved under it
resumes exactly."""
PLAN_VERSIONS = (2, 3)


def check_version(version: int) -> int:
    if version not in PLAN_VERSIONS:
        raise ValueError(f"plan_version must be one of {PLAN_VERSIONS}, not {version!r}")
    return version


def _resolved(source: Any) -> bool:
    """Whether ``source`` is ``DataSource``s already resolved (rather than what to resolve)."""
    return (
        isinstance(source, Sequence)
        and not isinstance(source, str)
        and bool(source)
        and all(isinstance(s, DataSource) for s in source)
    )


def worker_share(total: int, global_worker: int, global_workers: int) -> tuple[int, int]:
    """``[start, stop)`` of one global worker's contiguous block: sizes differ by at most one."""
    base, extra = divmod(total, global_workers)
    start = global_worker * base + min(global_worker, extra)
    return start, start + base + (global_worker < extra)


class Plan(IterableDataset):
    """Pipeline source: this worker's spans for one pass, ready for ``ReadSamples``.

    ``source`` is a dataset folder or URL, tar URLs (see ``resolve_source``), or a mixture
    (``Source`` list or mixture file; see ``sources.py``), or ``DataSource``s already resolved
    (indexes in memory, each with its share of a pass; ``schedule`` their weight schedule, if
    any). Each pass has one global order (``PassOrder``), the same on every topology; global
    worker ``w`` of ``G`` reads the contiguous block ``worker_share(pass size, w, G)`` of it,
    in that order. A sample's place is ``[pass, place in the pass's order]``. Iterating (or
    calling) a ``Plan`` inside a DataLoader worker yields that worker's share of pass
    ``epoch``. ``mixture``: whether keys name their source; by default yes for a ``Source``
    list, a mixture file and resolved sources, no for one dataset.

    ``evaluation=True``: every sample of every source once a pass (``repeat``, ``choose`` and
    ``weight`` set aside), in the order the indexes list them: sources, shards, samples.
    """

    def __init__(
        self,
        source: Any,
        *,
        seed: int = 0,
        epoch: int = 0,
        worker_config: WorkerConfig | None = None,
        span_bytes: int = SPAN_BYTES,
        span_samples: int | None = SPAN_SAMPLES,
        storage_options: Mapping[str, Any] | None = None,
        read_policy=None,
        samples_per_pass: int | None = None,
        evaluation: bool = False,
        version: int = PLAN_VERSION,
        mixture: bool | None = None,
        schedule: Schedule | None = None,
    ):
        super().__init__()
        if _resolved(source):
            sources, named = list(source), True
        elif schedule is not None:
            raise TypeError("schedule= goes with DataSources already resolved")
        else:
            sources, named, schedule = resolve_sources(
                source, storage_options, read_policy, samples_per_pass
            )
        if evaluation:  # every sample of every source once, as the indexes list them
            for s in sources:
                s.copies, s.extra = 1, 0
            schedule = None
        self.sources = sources
        self.mixture = named if mixture is None else mixture
        self.index, self.urls = sources[0].index, sources[0].urls
        self.seed, self._epoch = seed, epoch
        self.span_bytes, self.span_samples = span_bytes, span_samples
        self.worker_config = worker_config or WorkerConfig.from_environment()
        self.evaluation, self.schedule, self.version = evaluation, schedule, check_version(version)
        self._orders: OrderedDict[int, PassOrder] = OrderedDict()
        for s in self.sources:
            if s.size == 0:
                raise ValueError(f"{s.index.get('source', s.name)}: the dataset has no samples")
        if self.num_samples == 0:
            what = ", ".join(s.name for s in sources) if _resolved(source) else source
            raise ValueError(f"{what}: a pass of the mixture holds no samples")

    def __getstate__(self):
        return {**self.__dict__, "_orders": OrderedDict()}

    @property
    def epoch(self) -> int:
        """The pass iterated next: a plain number, or a shared one (see ``share_epoch``)."""
        return self._epoch if isinstance(self._epoch, int) else self._epoch.value

    @epoch.setter
    def epoch(self, value: int) -> None:
        if isinstance(self._epoch, int):
            self._epoch = value
        else:
            self._epoch.value = value

    def share_epoch(self) -> None:
        """Keep the epoch in shared memory, so that persistent DataLoader workers, which hold
        their own copy of the plan, see ``set_epoch`` of the training process."""
        if isinstance(self._epoch, int):
            import torch.multiprocessing as mp

            value = mp.Value("q", self._epoch, lock=False)
            self._epoch = value

    @property
    def num_samples(self) -> int:
        """Samples in one pass (all workers together; the same every pass)."""
        return sum(s.per_pass for s in self.sources)

    def order(self, pass_: int) -> PassOrder:
        """The global order of pass ``pass_`` (the last few are kept)."""
        order = self._orders.get(pass_)
        if order is None:
            counts = None if self.schedule is None else self.schedule.pass_counts(pass_)
            kind = KeyedOrder if self.version >= 3 else PassOrder
            order = kind(
                self.sources,
                self.seed,
                pass_,
                self.span_bytes,
                self.span_samples,
                ordered=self.evaluation,
                counts=counts,
            )
            self._orders[pass_] = order
            while len(self._orders) > 3:
                self._orders.popitem(last=False)
        return order

    def time_passes(self, samples_per_pass: int, clock: int) -> None:
        """A weight schedule's passes: ``samples_per_pass`` samples each, ``clock`` batches
        of a rank long (``schedule.py``). Every rank and worker must be given the same."""
        schedule = self.schedule
        schedule.samples_per_pass = samples_per_pass
        schedule.set_clock(clock)
        for s, (copies, extra, _) in zip(self.sources, schedule.pass_counts(0), strict=True):
            s.copies, s.extra = copies, extra
        self._orders.clear()

    def share(self, worker: int, global_workers: int | None = None) -> tuple[int, int]:
        """Global worker ``worker``'s block ``[start, stop)`` of every pass's order."""
        return worker_share(
            self.num_samples, worker, global_workers or self.worker_config.global_workers
        )

    def __call__(self, src=None) -> Iterator[dict]:
        return iter(self)

    def __iter__(self) -> Iterator[dict]:
        config = self.worker_config
        worker = config.global_worker(current_worker_id(config))
        yield from self.spans(self.epoch, worker)

    def spans(self, pass_: int, worker: int, start: int | None = None) -> Iterator[dict]:
        """Global worker ``worker``'s spans of pass ``pass_``, from place ``start`` of the
        pass's order on (default: the start of its block)."""
        first, stop = self.share(worker)
        spans = self.read_spans(pass_, [[max(first, start or 0), stop]], worker)
        for span in spans:
            span["whole_share"] = True  # a pass's whole share: all of it bad is an error
            yield span

    def read_spans(self, pass_: int, ranges: Sequence[Sequence[int]], worker: int):
        """The spans that read places ``[a, b)`` of pass ``pass_``'s order, for each range in
        turn (ascending), in order. Each span is one ranged read of one shard; it lists its
        samples (``entries``) and their ``positions`` (places) in reading order. The places
        of one chunk visit, from however many ranges, go into as few reads as they need."""
        order = self.order(pass_)
        visit, places = None, []
        for a, b in ranges:
            while a < b:
                v = order.visit_at(a)
                stop = min(b, order.bounds(v)[1])
                if v != visit and places:
                    yield from self._cut(order, visit, pass_, places, worker)
                    places = []
                visit = v
                places.extend(range(a, stop))
                a = stop
        if places:
            yield from self._cut(order, visit, pass_, places, worker)

    def _cut(self, order, v: int, pass_: int, places: Sequence[int], worker: int):
        """Spans of ascending places of one visit, shard by shard (a visit of plan version 3
        may end in the next shard): one read where they fill it densely enough
        (``order.one_read``; a whole visit always does), else cut where an entry would not
        join (``order.joins``)."""
        begin = order.bounds(v)[0]
        for s, number, numbers in order.pieces(v):
            mine = [p for p in places if begin <= p < begin + len(numbers)]
            if mine:
                yield from self._cut_shard(
                    self.sources[s], number, numbers, begin, mine, pass_, worker
                )
            begin += len(numbers)

    def _cut_shard(self, source, number, numbers, begin, places, pass_, worker):
        shard = source.index["shards"][number]
        try:
            found = [(shard["entries"][int(numbers[p - begin])], p) for p in places]
        except (ShardFormatError, StorageError) as e:  # its sidecar cannot be read
            failed = self._span(
                source,
                number,
                [({"key": "?", "offset": 0, "size": 0}, p) for p in places],
                pass_,
                worker,
            )
            failed["failed"] = e
            yield failed
            return
        if one_read([entry for entry, _ in found]):
            yield self._span(source, number, found, pass_, worker)
        else:
            yield from self._spans_of(source, number, found, pass_, worker)

    def _spans_of(self, source, number: int, found: list[tuple], pass_: int, worker: int):
        """Spans of ``(entry, place)`` of one shard, in their order, a new read wherever the
        next entry does not join the current one."""
        part: list[tuple] = []
        start = stop = used = 0
        for entry, place in found:
            if part and not joins(start, stop, used, entry, self.span_bytes):
                yield self._span(source, number, part, pass_, worker)
                part = []
            if not part:
                start, stop, used = entry["offset"], entry["offset"], 0
            part.append((entry, place))
            start = min(start, entry["offset"])
            stop = max(stop, entry["offset"] + entry["size"])
            used += entry["size"]
        if part:
            yield self._span(source, number, part, pass_, worker)

    def _span(self, source, number: int, part: list[tuple], pass_: int, worker: int) -> dict:
        shard = source.index["shards"][number]
        return order.span(
            source.urls[number],
            f"{source.name}/{shard['name']}" if self.mixture else shard["name"],
            [entry for entry, _ in part],
            positions=[place for _, place in part],
            pass_=pass_,
            worker=worker,
            source=source.name if self.mixture else None,
            shard_bytes=shard["bytes"],
            shard_sha256=shard.get("sha256"),
            storage_options=source.storage_options,
            layout=source.index.get("layout"),
        )

    def locate(self, pass_: int, places: Sequence[int], worker: int = 0) -> list[dict]:
        """Spans that hold the given places of pass ``pass_`` (neighbours in a shard merged
        into one ranged read): how a resumed loader fetches the samples its buffers held."""
        order = self.order(pass_)
        by_shard: dict[tuple, list] = {}
        for place in sorted(set(int(p) for p in places)):
            source, shard, entry = order.entry_at(place)
            entries = self.sources[source].index["shards"][shard]["entries"]
            by_shard.setdefault((source, shard), []).append((entries[entry], place))
        out: list[dict] = []
        for (s, number), found in by_shard.items():
            found.sort(key=lambda f: f[0]["offset"])
            out += self._spans_of(self.sources[s], number, found, pass_, worker)
        return out
