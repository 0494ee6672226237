"""The shape of a dataset as the cloud planner (``cloud_plan.py``) sees it: per shard, its
samples, bytes, sidecar bytes and prefix, read from an index or described before it is
written."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..format.index import load_index
from ..storage.fs import ReadPolicy, join, read_bytes

# a written sidecar of samples of one image and two turns: 57 bytes each and 2 kB of headers
SIDECAR_BYTES_PER_SAMPLE, SIDECAR_HEADERS = 57, 2000
# a tar's end: two zero blocks, then padding to tarfile's 10240-byte record (half on average)
TAR_TRAILER = 1024 + 5120


@dataclass
class DatasetShape:
    """A dataset as the planner sees it: per shard, its samples, bytes, sidecar bytes and
    prefix (a number below ``prefixes``); the sizes of ``index.json`` and the shard table."""

    name: str
    samples: np.ndarray
    bytes: np.ndarray
    sidecar_bytes: np.ndarray
    prefix: np.ndarray
    prefixes: int
    index_bytes: int
    table_bytes: int = 0
    sample_cv: float = 0.3
    """How much sample sizes vary: their standard deviation over their mean."""
    trailer: float = TAR_TRAILER
    """Bytes of a shard that are no sample's: the tar's end."""

    @property
    def shards(self) -> int:
        return len(self.samples)

    # what ``keyed.chunk_size`` reads of a source
    @property
    def sample_ends(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.samples)])

    @property
    def size(self) -> int:
        return int(self.samples.sum())

    @property
    def total_bytes(self) -> int:
        return int(self.bytes.sum())

    @property
    def sample_bytes(self) -> np.ndarray:
        """Per shard, the mean bytes of its samples: its bytes less the tar's trailer."""
        held = np.maximum(self.bytes - self.trailer * (self.samples > 0), self.samples)
        return np.divide(held, self.samples, out=np.zeros(self.shards), where=self.samples > 0)

    @property
    def mean_sample(self) -> float:
        return float((self.sample_bytes * self.samples).sum()) / max(1, self.size)

    def chunk_cap(self, span_samples: int | None) -> int | None:
        return span_samples

    def spread(self, prefixes: int) -> DatasetShape:
        """The same shards placed evenly over ``prefixes`` folders."""
        even = np.arange(self.shards) % prefixes
        return replace(self, prefix=even, prefixes=prefixes)


class ChunkSource:
    """A ``DatasetShape`` as ``keyed.chunk_size`` takes a source (``bytes`` its total)."""

    def __init__(self, shape: DatasetShape):
        self.sample_ends, self.size, self.bytes = shape.sample_ends, shape.size, shape.total_bytes
        self.chunk_cap = shape.chunk_cap


def described(
    samples: int,
    total_bytes: int,
    shards: int,
    prefixes: int = 1,
    sidecar_per_sample: float = SIDECAR_BYTES_PER_SAMPLE,
    name: str = "described",
    sample_cv: float = 0.3,
) -> DatasetShape:
    """A dataset not written yet: ``samples`` over ``shards`` equal shards (the last ones one
    sample fewer where it does not divide), ``total_bytes`` in all (sizes varying by
    ``sample_cv``), spread over ``prefixes``; ``index.json`` of about 1 kB and a shard
    table of about 190 bytes a shard (version 3)."""
    if min(samples, total_bytes, shards, prefixes) < 1 or shards > samples:
        raise ValueError(
            f"a dataset needs at least one sample a shard: {samples} samples, {shards} shards, "
            f"{total_bytes} bytes, {prefixes} prefixes"
        )
    base, extra = divmod(samples, shards)
    counts = np.full(shards, base, dtype=np.int64)
    counts[:extra] += 1
    shape = DatasetShape(
        name,
        counts,
        counts * (total_bytes / samples),
        (counts * sidecar_per_sample).astype(np.int64) + SIDECAR_HEADERS,
        np.zeros(shards, dtype=np.int64),
        1,
        index_bytes=1024,
        table_bytes=190 * shards,
        sample_cv=sample_cv,
    )
    return shape.spread(prefixes)


def from_index(source: str, storage_options=None) -> DatasetShape:
    """The shape of the dataset at ``source`` (a folder or URL) from its index: shard counts,
    bytes, sidecar sizes and the folders its shards lie in; how much sample sizes vary, and
    a tar's bytes that are no sample's, from the entries of up to 4 shards spread over the
    list (their sidecars: 4 reads)."""
    policy = ReadPolicy()
    index = load_index(source, storage_options, policy)
    index_bytes = len(read_bytes(join(source, "index.json"), storage_options, policy))
    shards = index["shards"]
    if hasattr(shards, "names"):  # a version-3 table: its columns
        names = shards.names(0, len(shards))
        samples, sizes = np.asarray(shards.samples), np.asarray(shards.bytes)
        sidecars = np.asarray(shards.sidecar_bytes)
        table_bytes = int(index["table"]["bytes"])
    else:
        names = [s["name"] for s in shards]
        samples = np.asarray([s["samples"] for s in shards], dtype=np.int64)
        sizes = np.asarray([s.get("bytes") or 0 for s in shards], dtype=np.int64)
        sidecars = np.asarray([s.get("sidecar", {}).get("bytes", 0) for s in shards], np.int64)
        table_bytes = 0
    folders = [n.rsplit("/", 1)[0] if "/" in n else "" for n in names]
    kinds, prefix = np.unique(np.asarray(folders, dtype=object), return_inverse=True)
    spread = np.linspace(0, len(shards) - 1, min(4, len(shards))).astype(int)
    measured = [_sizes(shards[int(i)]["entries"]) for i in spread]
    found = np.concatenate(measured)
    cv = float(found.std() / found.mean()) if found.size else 0.3
    ends = [sizes[i] - part.sum() for i, part in zip(spread, measured, strict=True)]
    trailer = max(0.0, float(np.mean(ends))) if ends else TAR_TRAILER
    shape = DatasetShape(source, samples, sizes, sidecars, prefix, len(kinds), index_bytes)
    return replace(shape, table_bytes=table_bytes, sample_cv=cv, trailer=trailer)


def _sizes(entries) -> np.ndarray:
    """The sample sizes of a shard's entries: a sidecar's array, or index version 1's list."""
    if hasattr(entries, "loaded"):
        return np.asarray(entries.loaded().size, dtype=float)
    return np.asarray([e["size"] for e in entries], dtype=float)
