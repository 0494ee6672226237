"""The requests and bytes a training job asks of an object store, computed before it runs.

From a dataset's shape (its index, or a description of one not written yet) and a job's shape
(nodes, GPUs per node, DataLoader workers per GPU, samples a second per GPU, the Loader's
``span_bytes``, ``span_samples`` and ``ReadPolicy.block_bytes``), ``plan_cloud`` works out
what the Loader's reads come to: requests and bytes a pass, requests and bytes a second, in
all and per prefix of the store, what a pass costs at given prices, what a node reads before
its first batch, and whether the store's limit of requests a second per prefix holds (with
the ``--prefixes`` or ``span_bytes`` that would make it hold).

The model follows the code, a single dataset read once a pass (``repeat=1``, no mixture):

- **Chunks** (``keyed.chunk_size``): runs of ``m`` consecutive samples of the dataset's
  numbering, ``m`` = ``span_bytes`` of the mean sample, at most ``span_samples`` and the mean
  shard's samples. A chunk that runs across a shard boundary is one ranged read per shard it
  touches (``KeyedOrder.pieces``), so the reads of a pass are the pieces of every shard cut at
  the multiples of ``m``, counted shard by shard from the index's sample counts.
- **Workers**: a pass's order is split into ``G`` contiguous blocks (``G`` = GPUs x
  max(1, workers)); each of the ``G - 1`` cuts falls inside a chunk visit, which two workers
  then both read (each its part, read as one span: about the whole chunk, so counted so).
- **Requests**: a span of ``s`` bytes is ``ceil(s / block_bytes)`` GETs (``fs.read_range``),
  averaged over the sizes a span of ``n`` samples takes (normal, of mean ``n`` samples and a
  deviation of ``sqrt(n)`` times the samples'; ``request_table``). A sample's bytes are its
  shard's bytes less the tar's end (measured on up to 4 shards of an index; else two zero
  blocks and half of tarfile's 10240-byte record) over its samples. No HEAD is sent (the
  ranged GETs of s3fs, gcsfs and fsspec's HTTP need none).
- **Sidecars** (index versions 2 and 3): a process reads a shard's sidecar (one GET where it
  reads it from the store) the first time it reads the shard, and keeps the last 256
  (``sidecar._CACHED``). Chunk visits land on a worker at random, so a worker reads ``D =
  sum over shards of 1 - (1 - 1/G)^pieces`` sidecars a pass, plus, where ``D`` passes 256,
  each repeat visit to a shard with the chance ``1 - 256 / D`` that it was evicted meanwhile.
  That is a first pass (cold caches: a Loader's DataLoader workers are new processes each
  epoch unless ``persistent_workers``); a dataset of at most 256 shards read by persistent
  workers reads its sidecars once. With ``num_workers=0`` the rank's sizing (below) warms the
  cache.
- **The node's copies** (``storage.node``, ``local_bytes``): those reads go to the node's
  copy of the sidecar; only the copy's fetch is a GET. A node's ranks hold a contiguous
  ``1/nodes`` of the pass's order, so a node reads shard ``s`` at all with the chance ``1 - (1
  - 1/nodes)^pieces``: its first read fetches the copy (the shards its ranks sized at
  start-up are there already). The node holds ``C = local_bytes / mean sidecar bytes`` copies
  (least recently used out first); of the ``D_node`` sidecars a node reads, a later read by
  another process of the node (or the same one, after its own cache let it go) finds its copy
  with the chance ``min(1, C / D_node)``, else fetches it again. ``local_bytes=0`` (and a
  sidecar larger than ``local_bytes``): every process reads from the store, as above.
- **Start-up, per node**: ``index.json`` by each rank (DataLoader workers take the rank's
  copy), the shard table (version 3) once (the node-local copy); then each rank sizes its
  epochs (``loader/sizing.py``): the sidecars of up to 64 shards spread over the list (once a
  node, the node's copies; else once a rank) and every ``k``-th sample of them (about 32,
  ``ceil(bytes / block_bytes)`` GETs each). ``--no-sizing`` (the Loader is given
  ``batches_per_epoch``) leaves that out.
- **Prefixes**: the store partitions its request rate by key prefix (S3: about 5,500 GET/s
  per partitioned prefix); a shard and its sidecar lie under the shard's folder
  (``wdsvlm write --prefixes N``), so each prefix takes the share of the requests of its
  shards. ``prefixes=N`` for a dataset described (or asked of an index: what if it were
  written so) spreads the shards evenly over ``N``.
- **Not counted**: retries and throttled answers (none when the limit holds), the re-reads
  of a resumed Loader (its buffered samples, once), a ``cache_dir`` that serves repeat reads
  from local disk, neighbouring spans joined into one request (``pipeline/coalesce.py``: only
  where a worker reads them one after the other, rare in a training pass's keyed order).
- **Rates**: a pass takes ``samples / (GPUs x samples a second per GPU)`` seconds; requests
  and bytes are spread evenly over it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..format import sidecar as sidecar_format
from ..pipeline.keyed import chunk_size
from ..pipeline.order import SPAN_BYTES, SPAN_SAMPLES
from ..pipeline.token_weights import MEASURED_SHARDS, spread_shards
from ..storage.fs import ReadPolicy
from ..storage.node import LOCAL_BYTES
from .cloud_dataset import ChunkSource, DatasetShape, described, from_index

__all__ = ["DatasetShape", "JobShape", "Prices", "described", "from_index", "plan_cloud"]

SIDECAR_CACHE = sidecar_format._CACHED  # sidecars a process keeps
SIZING_SAMPLES = 32  # sizing.sample_numbers measures every (len // 32)-th sample
S3_GET_PRICE = 0.0004  # $ per 1,000 GET requests, S3 Standard (us-east-1)
EGRESS_PRICES = (0.0, 0.02, 0.09)  # $/GB: same region, another region, the internet
PREFIX_LIMIT = 5500  # GET/s per partitioned prefix (S3's documented figure)


@dataclass(frozen=True)
class JobShape:
    """A training job's readers and pace, and the Loader's read settings."""

    nodes: int = 1
    gpus_per_node: int = 8
    workers: int = 8
    """DataLoader workers per GPU (0: the training process reads)."""
    samples_per_second: float = 100.0
    """Samples a second each GPU trains on."""
    span_bytes: int = SPAN_BYTES
    span_samples: int | None = SPAN_SAMPLES
    block_bytes: int = ReadPolicy.block_bytes
    sizing: bool = True
    """Whether each rank sizes its epochs at start-up (no ``batches_per_epoch`` given)."""
    local_bytes: int = LOCAL_BYTES
    """Bytes the node's copies of sidecars may take (the Loader's ``local_bytes``; 0: none)."""

    def __post_init__(self):
        if min(self.nodes, self.gpus_per_node, self.span_bytes, self.block_bytes) < 1:
            raise ValueError(f"a job needs at least one node, GPU and byte: {self}")
        if self.workers < 0 or self.local_bytes < 0 or self.samples_per_second <= 0:
            raise ValueError(f"workers >= 0 and samples_per_second > 0, not {self}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def readers(self) -> int:
        """Global workers: the blocks a pass is split into."""
        return self.gpus * max(1, self.workers)


@dataclass(frozen=True)
class Prices:
    """What the store charges: per 1,000 GETs, and per GB (2^30 bytes) sent out, one or more
    egress prices to compare. Inputs, not looked up: check your provider's price list."""

    get_per_1000: float = S3_GET_PRICE
    egress_per_gb: tuple[float, ...] = field(default=EGRESS_PRICES)


def request_table(m: int, shape: DatasetShape, block: int) -> np.ndarray:
    """``[n]``: the mean GETs of a read of ``n`` samples (0 to ``m``) in ``block``-byte
    requests: ``E[ceil(S / block)] = sum over k >= 0 of P(S > k block)``, ``S`` the bytes of
    ``n`` samples, taken as normal (mean ``n x mean``, deviation ``sqrt(n) x cv x mean``)."""
    mean, cv = shape.mean_sample, shape.sample_cv
    out = np.zeros(m + 1)
    for n in range(1, m + 1):
        mu, sigma = n * mean, math.sqrt(n) * cv * mean
        top = int((mu + 8 * sigma) // block) + 1
        for k in range(top + 1):
            if sigma == 0:
                out[n] += mu > k * block
            else:
                out[n] += 0.5 * math.erfc((k * block - mu) / (sigma * math.sqrt(2)))
    return out


def pass_reads(shape: DatasetShape, job: JobShape) -> dict[str, Any]:
    """Spans, requests and bytes of one pass: the chunks' reads, the sidecars' reads, per
    prefix; with the chunk size ``m``."""
    m = chunk_size(ChunkSource(shape), job.span_bytes, job.span_samples)
    ends = shape.sample_ends
    first, stop = ends[:-1], ends[1:]
    mean, table = shape.sample_bytes, request_table(m, shape, job.block_bytes)
    head_end = np.minimum(-(-first // m) * m, stop)  # the first multiple of m, within the shard
    tail_start = np.maximum(stop // m * m, head_end)
    head, tail = head_end - first, stop - tail_start
    full = (tail_start - head_end) // m
    pieces = (head > 0) + full + (tail > 0)
    requests = table[head] + full * table[m] + table[tail]
    spans = int(pieces.sum())
    # each cut between two workers' blocks makes a chunk visit two reads of about a chunk
    cuts = min(job.readers - 1, spans) if m > 1 else 0
    chunk_bytes = shape.mean_sample * m
    cut_requests = cuts * table[m]
    sidecar_reads, sidecar_bytes = _sidecar_reads(shape, job, pieces, spans + cuts)
    by_prefix = np.bincount(shape.prefix, requests + sidecar_reads, minlength=shape.prefixes)
    span_requests = int(round(requests.sum() + cut_requests))
    return {
        "chunk_samples": int(m),
        "chunk_bytes": chunk_bytes,
        "spans": spans + cuts,
        "span_requests": span_requests,
        "span_bytes": int((mean * shape.samples).sum() + cuts * chunk_bytes),
        "sidecar_requests": int(round(sidecar_reads.sum())),
        "sidecar_bytes": int(round(sidecar_bytes)),
        "busiest_prefix_share": float(by_prefix.max() / max(1e-9, by_prefix.sum())),
    }


def _sidecar_reads(shape: DatasetShape, job: JobShape, pieces: np.ndarray, spans: int):
    """Per shard, the expected sidecar reads of all workers in a pass (cold caches), and their
    bytes in all."""
    if not shape.sidecar_bytes.any():  # index version 1: the entries are in index.json
        return np.zeros(shape.shards), 0.0
    g = job.readers
    # chance that a worker reads shard s at all: one of its pieces falls in the worker's block
    touched = 1.0 - np.exp(pieces * math.log1p(-1.0 / g)) if g > 1 else (pieces > 0) * 1.0
    distinct = float(touched.sum())
    per_worker = touched
    if job.workers == 0 and job.sizing:  # sizing read these into the rank's cache first
        warm = min(shape.shards, MEASURED_SHARDS)
        if distinct + warm <= SIDECAR_CACHE:
            per_worker = touched * (1 - warm / shape.shards)
    if distinct > SIDECAR_CACHE:  # a repeat visit finds its sidecar evicted meanwhile
        visits = spans / g
        again = (visits - distinct) * (1 - SIDECAR_CACHE / distinct)
        per_worker = per_worker * (1 + max(0.0, again) / distinct)
    reads = per_worker * g
    kept = (shape.sidecar_bytes <= job.local_bytes) & (job.local_bytes > 0)
    if kept.any():  # the node's copies: the processes' reads of a kept sidecar, fetched
        reads = np.where(kept, _node_fetches(shape, job, pieces, reads, kept), reads)
    return reads, float((reads * shape.sidecar_bytes).sum())


def _node_fetches(shape, job, pieces, reads, kept) -> np.ndarray:
    """Per shard, the fetches of its sidecar by all nodes in a pass, where ``reads`` are the
    reads of all processes, each node keeping the copies of ``kept`` sidecars."""
    n = job.nodes
    touched = 1.0 - np.exp(pieces * math.log1p(-1.0 / n)) if n > 1 else (pieces > 0) * 1.0
    first = touched.copy()
    if job.sizing:  # fetched at start-up (``startup_reads``)
        first[spread_shards(shape.shards, MEASURED_SHARDS)] = 0.0
    distinct = float(touched[kept].sum())
    held = max(1.0, float(shape.sidecar_bytes[kept].mean()))
    found = min(1.0, job.local_bytes / held / distinct) if distinct else 1.0
    again = np.maximum(0.0, reads / n - first)
    return n * (first + again * (1.0 - found))


def startup_reads(shape: DatasetShape, job: JobShape) -> dict[str, int]:
    """GETs and bytes a node sends before its first batch: ``index.json`` by each rank, the
    table once, and each rank's sizing: the sidecars of the measured shards (once a node,
    into its copies, where ``local_bytes`` holds them) and a few samples."""
    ranks = job.gpus_per_node
    requests = ranks + (shape.table_bytes > 0)
    nbytes = ranks * shape.index_bytes + shape.table_bytes
    sizing_requests = sizing_bytes = sidecar_requests = sidecar_bytes = 0
    if job.sizing:
        measured = spread_shards(shape.shards, MEASURED_SHARDS)
        held = int(shape.samples[measured].sum())
        chosen = -(-held // max(1, held // SIZING_SAMPLES))
        sidecar_requests = len(measured) * bool(shape.sidecar_bytes.any())
        sidecar_bytes = int(shape.sidecar_bytes[measured].sum())
        sizing_requests = round(chosen * request_table(1, shape, job.block_bytes)[1])
        sizing_bytes = int(chosen * shape.mean_sample)
        if shape.sidecar_bytes[measured].max(initial=0) > job.local_bytes:  # once a rank
            sizing_requests += sidecar_requests
            sizing_bytes += sidecar_bytes
            sidecar_requests = sidecar_bytes = 0
    return {
        "index_bytes": shape.index_bytes,
        "table_bytes": shape.table_bytes,
        "sidecar_requests": sidecar_requests,
        "sidecar_bytes": sidecar_bytes,
        "sizing_requests_per_rank": sizing_requests,
        "sizing_bytes_per_rank": sizing_bytes,
        "requests": requests + sidecar_requests + ranks * sizing_requests,
        "bytes": nbytes + sidecar_bytes + ranks * sizing_bytes,
    }


def plan_cloud(
    shape: DatasetShape,
    job: JobShape,
    prices: Prices | None = None,
    prefix_limit: float = PREFIX_LIMIT,
    prefixes: int | None = None,
) -> dict[str, Any]:
    """The whole plan (a JSON-ready dict): the dataset and job, a pass's reads, the rates,
    the cost of a pass at ``prices``, the start-up reads per node, the per-prefix check
    against ``prefix_limit`` GET/s and what would fit it. ``prefixes``: the shards spread
    evenly over that many (what if the dataset were written with ``--prefixes``)."""
    prices = prices or Prices()
    if prefixes is not None:
        shape = shape.spread(prefixes)
    reads = pass_reads(shape, job)
    seconds = shape.size / (job.gpus * job.samples_per_second)
    requests = reads["span_requests"] + reads["sidecar_requests"]
    egress = reads["span_bytes"] + reads["sidecar_bytes"]
    rate = requests / seconds
    busiest = rate * reads["busiest_prefix_share"]
    plan = {
        "dataset": {
            "name": shape.name,
            "samples": shape.size,
            "shards": shape.shards,
            "bytes": shape.total_bytes,
            "prefixes": shape.prefixes,
        },
        "job": {**job.__dict__, "gpus": job.gpus, "readers": job.readers},
        "pass": {"seconds": seconds, **reads, "requests": requests, "bytes": egress},
        "rates": {
            "requests_per_second": rate,
            "bytes_per_second": egress / seconds,
            "busiest_prefix_requests_per_second": busiest,
        },
        "cost_per_pass": {
            "prices": {"get_per_1000": prices.get_per_1000, "egress_per_gb": prices.egress_per_gb},
            "gets": requests / 1000 * prices.get_per_1000,
            "egress": [egress / 2**30 * p for p in prices.egress_per_gb],
        },
        "startup_per_node": startup_reads(shape, job),
        "prefix_limit": {"limit": prefix_limit, "exceeded": busiest > prefix_limit},
    }
    plan["prefix_limit"].update(_fits(shape, job, rate, reads, prefix_limit, seconds))
    return plan


def _fits(shape, job, rate, reads, limit, seconds) -> dict[str, Any]:
    """The prefixes (shards spread evenly) that keep each under ``limit`` at this job's rate,
    and the smallest ``span_bytes`` (doubled from the job's, ``span_samples`` and
    ``block_bytes`` raised with it so neither binds) that does on the dataset's prefixes."""
    out: dict[str, Any] = {"prefixes_needed": max(1, math.ceil(rate / limit))}
    if rate * reads["busiest_prefix_share"] <= limit:
        return out
    sample = shape.mean_sample
    span = job.span_bytes
    for _ in range(12):
        span *= 2
        cap = max(job.span_samples or 0, math.ceil(span / sample))
        block = max(span, job.block_bytes)
        trial = replace(job, span_bytes=span, span_samples=cap, block_bytes=block)
        got = pass_reads(shape, trial)
        busiest = (got["span_requests"] + got["sidecar_requests"]) / seconds
        busiest *= got["busiest_prefix_share"]
        if busiest <= limit:
            out["span_fit"] = {
                "span_bytes": span,
                "span_samples": cap,
                "block_bytes": trial.block_bytes,
                "busiest_prefix_requests_per_second": busiest,
            }
            break
    return out
