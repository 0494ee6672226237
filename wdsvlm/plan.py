"""Plan: which samples one global worker reads in an epoch, and in which order.

Everything follows from explicit inputs: ``(seed, epoch)`` decide the order, and the worker's
place ``rank * num_workers + worker_id`` among ``world_size * num_workers`` global workers
decides its share. The split is by samples (through the index), so any shard count works with
any worker count.

The epoch order: shards in a seeded random order, each shard's samples in a seeded random
order. The order is cut into contiguous, near-equal blocks, one per global worker. A worker
reads its block shard by shard in *spans*: runs of samples that lie next to each other in the
shard, up to ``span_bytes``, each fetched with one ranged read; spans and the samples inside
them are visited in seeded random order. So the I/O is a few large ranged reads per shard and
the memory held is one span.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import IterableDataset

from .errors import ShardFormatError
from .index import load_index, scan_index
from .storage import join

log = logging.getLogger("wdsvlm.plan")

# Gaps between wanted samples up to this size are read through rather than split into two
# reads: one request costs more than reading a few tens of KB.
_READ_THROUGH_GAP = 64 * 1024


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

    def global_worker(self, worker_id: int) -> int:
        return self.rank * self.workers_per_rank + worker_id


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


def epoch_order(index: Mapping[str, Any], seed: int, epoch: int) -> list[tuple[int, int]]:
    """Every sample of the dataset as ``(shard number, entry number)``, in this epoch's order."""
    rng = random.Random(f"wdsvlm-order/{seed}/{epoch}")
    shards = list(range(len(index["shards"])))
    rng.shuffle(shards)
    order = []
    for s in shards:
        entries = list(range(index["shards"][s]["samples"]))
        rng.shuffle(entries)
        order.extend((s, e) for e in entries)
    return order


def worker_share(total: int, global_worker: int, global_workers: int) -> tuple[int, int]:
    """``[start, stop)`` of one global worker's contiguous block: sizes differ by at most one."""
    base, extra = divmod(total, global_workers)
    start = global_worker * base + min(global_worker, extra)
    return start, start + base + (global_worker < extra)


def worker_spans(
    index: Mapping[str, Any],
    seed: int,
    epoch: int,
    global_worker: int,
    global_workers: int,
    span_bytes: int = 8 * 2**20,
) -> list[dict]:
    """The spans one global worker reads in one epoch, in reading order.

    A span is ``{"shard": number, "start": byte, "stop": byte, "entries": [entry numbers]}``:
    the ranged read ``[start, stop)`` of the shard holds all its entries, which are listed in
    the order they are to be yielded.
    """
    order = epoch_order(index, seed, epoch)
    start, stop = worker_share(len(order), global_worker, global_workers)
    rng = random.Random(f"wdsvlm-spans/{seed}/{epoch}/{global_worker}")
    spans: list[dict] = []
    block = order[start:stop]
    i = 0
    while i < len(block):  # one run of the same shard at a time, in the epoch's shard order
        shard = block[i][0]
        j = i
        while j < len(block) and block[j][0] == shard:
            j += 1
        entries = index["shards"][shard]["entries"]
        wanted = sorted((e for _, e in block[i:j]), key=lambda e: entries[e]["offset"])
        run = _cut_spans(shard, entries, wanted, span_bytes)
        rng.shuffle(run)
        for span in run:
            rng.shuffle(span["entries"])
        spans.extend(run)
        i = j
    return spans


def _cut_spans(shard: int, entries: Sequence[dict], wanted: list[int], span_bytes: int):
    spans: list[dict] = []
    for e in wanted:
        begin = entries[e]["offset"]
        end = begin + entries[e]["size"]
        last = spans[-1] if spans else None
        if last and begin - last["stop"] <= _READ_THROUGH_GAP and end - last["start"] <= span_bytes:
            last["stop"] = end
            last["entries"].append(e)
        else:
            spans.append({"shard": shard, "start": begin, "stop": end, "entries": [e]})
    return spans


def resolve_source(
    source: str | Sequence[str], storage_options: Mapping[str, Any] | None = None, policy=None
) -> tuple[dict, list[str]]:
    """The index of ``source`` and the URL of each of its shards.

    ``source`` is a dataset folder or URL prefix (its ``index.json`` is read), or tar URLs: a
    brace pattern such as ``s3://b/ds/data-{000000..000006}.tar``, or a list. Tar URLs are
    looked up in the ``index.json`` beside them when there is one, else their headers are
    scanned once to build the index in memory.
    """
    if isinstance(source, str) and not source.endswith(".tar"):
        index = load_index(source, storage_options, policy)
        return index, [join(source, s["name"]) for s in index["shards"]]
    urls = _expand(source)
    folder = urls[0].rsplit("/", 1)[0] if "/" in urls[0] else "."
    same_folder = all((u.rsplit("/", 1)[0] if "/" in u else ".") == folder for u in urls)
    full = None
    if same_folder:
        try:
            full = load_index(folder, storage_options, policy)
        except ShardFormatError as e:  # no usable index beside the shards: scan them instead
            log.debug("no index beside %s (%s)", urls[0], e)
    if full is not None:
        by_name = {s["name"]: s for s in full["shards"]}
        names = [u.rsplit("/", 1)[-1] for u in urls]
        if all(n in by_name for n in names):
            return {**full, "shards": [by_name[n] for n in names]}, urls
    log.warning("no index.json lists %s: scanning %d shards to build one", urls[0], len(urls))
    return scan_index(urls, storage_options), urls


def _expand(source: str | Sequence[str]) -> list[str]:
    import braceexpand

    patterns = [source] if isinstance(source, str) else list(source)
    urls = [u for p in patterns for u in braceexpand.braceexpand(p)]
    if not urls:
        raise ValueError(f"no shard URLs in {source!r}")
    return urls


class Plan(IterableDataset):
    """Pipeline source: this worker's spans for one epoch, ready for ``read_samples``.

    ``source`` is a dataset folder or URL, or tar URLs (see ``resolve_source``). Iterating
    (or calling) a ``Plan`` inside a DataLoader worker yields that worker's share. Each span
    carries its shard's URL and the context later stages seed themselves from.
    """

    def __init__(
        self,
        source: str | Sequence[str],
        *,
        seed: int = 0,
        epoch: int = 0,
        worker_config: WorkerConfig | None = None,
        span_bytes: int = 8 * 2**20,
        storage_options: Mapping[str, Any] | None = None,
        read_policy=None,
    ):
        super().__init__()
        self.index, self.urls = resolve_source(source, storage_options, read_policy)
        self.seed = seed
        self._epoch = epoch
        self.worker_config = worker_config or WorkerConfig.from_environment()
        self.span_bytes = span_bytes
        if self.index["totals"]["samples"] == 0:
            raise ValueError(f"{source}: the dataset has no samples")

    @property
    def epoch(self) -> int:
        """The epoch iterated next: a plain number, or a shared one (see ``share_epoch``)."""
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
        """Samples in the whole dataset (all workers together)."""
        return sum(s["samples"] for s in self.index["shards"])

    def __call__(self, src=None) -> Iterator[dict]:
        return iter(self)

    def __iter__(self) -> Iterator[dict]:
        config = self.worker_config
        worker = config.global_worker(current_worker_id(config))
        yield from self.spans(self.epoch, worker)

    def spans(self, epoch: int, worker: int, start: int = 0) -> Iterator[dict]:
        """Global worker ``worker``'s spans of pass ``epoch``, from its sample number
        ``start`` on (a span cut by ``start`` keeps only its later samples). Each span lists
        its samples' positions in the worker's reading order of that pass."""
        config = self.worker_config
        spans = worker_spans(
            self.index, self.seed, epoch, worker, config.global_workers, self.span_bytes
        )
        position = 0
        for span in spans:
            first, position = position, position + len(span["entries"])
            if position <= start:
                continue
            shard = self.index["shards"][span["shard"]]
            entries = [shard["entries"][e] for e in span["entries"]]
            positions = list(range(first, position))
            if first < start:  # resuming inside this span: read only what is left of it
                entries, positions = entries[start - first :], positions[start - first :]
            yield {
                "url": self.urls[span["shard"]],
                "shard": shard["name"],
                "shard_bytes": shard["bytes"],
                "start": min(e["offset"] for e in entries),
                "stop": max(e["offset"] + e["size"] for e in entries),
                "entries": entries,
                "positions": positions,
                "epoch": epoch,
                "worker": worker,
            }

    def locate(self, epoch: int, worker: int, positions: Sequence[int]) -> list[dict]:
        """Spans that hold the given positions of a worker's pass ``epoch`` (neighbours in a
        shard merged into one ranged read, as the plan merges them): how a resumed loader
        fetches the samples its buffers held."""
        wanted = set(positions)
        by_shard: dict[str, list] = {}
        for span in self.spans(epoch, worker):
            for position, entry in zip(span["positions"], span["entries"], strict=True):
                if position in wanted:
                    by_shard.setdefault(span["url"], []).append((entry, position, span))
        out: list[dict] = []
        for found in by_shard.values():
            found.sort(key=lambda f: f[0]["offset"])
            for entry, position, span in found:
                last = out[-1] if out and out[-1]["url"] == span["url"] else None
                end = entry["offset"] + entry["size"]
                if (
                    last is not None
                    and entry["offset"] - last["stop"] <= _READ_THROUGH_GAP
                    and end - last["start"] <= self.span_bytes
                ):
                    last["stop"] = max(last["stop"], end)
                    last["entries"].append(entry)
                    last["positions"].append(position)
                else:
                    out.append(
                        {
                            **span,
                            "start": entry["offset"],
                            "stop": end,
                            "entries": [entry],
                            "positions": [position],
                        }
                    )
        return out
