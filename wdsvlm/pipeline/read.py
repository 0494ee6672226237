"""Read: spans of the plan in, samples (tar members by name) out.

Each span is one ranged read of a shard through fsspec (``storage.read_range``: in blocks,
retried where a transient fault broke it); the samples inside it are cut out by their index
offsets. A background thread walks the plan and hands its spans to ``read_ahead`` reader
threads, so up to ``read_ahead`` ranged reads run at once, ahead of the decoding downstream
(the plan's chunks are small, for mixing: one read at a time would wait on each request's
latency); the spans come out in the plan's order whatever order their reads end in. Nothing
stays open between spans, and the threads end with the stage. Consecutive spans of a shard
whose bytes lie close together (an evaluation pass reads a shard's chunks one after the other)
are fetched with one request, each span cut out of it (``coalesce.py``).
A sample whose bytes are cut short (a truncated shard) or do not parse as tar members of its
key is skipped and counted. A shard that cannot be read raises ``StorageError`` naming it, or
with ``on_shard_error="skip"`` has its samples counted as skipped (``unreadable_shard``); a
shard the store does not have is asked for once a pass, not once a span.
With a ``cache`` (``cache.ShardCache``), the bytes of a shard read once are read from local
disk after (shards whose index records a sha256: the cache keys on it, so a rewritten shard
is fetched anew); only the blocks not on disk yet are fetched.
"""

from __future__ import annotations

import queue
import tarfile
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import ObjectNotFoundError, StorageError
from ..format import sidecar
from ..format.layouts import BadSample, Layout
from ..format.tarball import tar_members
from ..storage.cache import ShardCache
from ..storage.fs import ReadPolicy, RequestCounts, read_range
from .coalesce import bounds, grouped
from .stats import SkipStats
from .timing import stretch

_DONE = object()


class _Read:
    """One read of a run of spans (most runs: one span), handed from a reader thread to the
    consumer, once ``done``: its bytes from byte ``first`` on (or the ``StorageError``), or
    where a joined read failed, each span's own read; or the exception of a bug."""

    def __init__(self, first: int):
        self.done = threading.Event()
        self.first = first
        self.counts = RequestCounts()  # its requests, added to the stats when it is taken
        self.data: bytes | StorageError | list = b""
        self.error: BaseException | None = None

    def of(self, span: dict, k: int) -> bytes | StorageError:
        """What the ``k``-th span of the run gets: exactly its own bytes, or its error."""
        if isinstance(self.data, list):
            return self.data[k]
        if isinstance(self.data, StorageError):
            return self.data
        return self.data[span["start"] - self.first : span["stop"] - self.first]


class ReadSamples:
    """Pipeline stage: plan spans -> samples.

    A sample is ``{"__key__", "__shard__", "__url__", "__meta__" (its index entry),
    "__pass__" (its pass), "__worker__", "__pos__" (its place in the pass's global order),
    "__source__" (its source's name), "json": bytes, "0.jpg": bytes, ...}``: member names
    without the key, as webdataset names them.

    ``clock`` (a ``timing.StageClock``, set by the Loader's stream in each worker): where
    the time the stage waits for its reads (``read_wait``) is charged.
    """

    clock = None

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        *,
        stats: SkipStats | None = None,
        policy: ReadPolicy | None = None,
        read_ahead: int = 4,
        on_shard_error: str = "raise",
        cache: ShardCache | None = None,
        coalesce: bool = True,
    ):
        if on_shard_error not in ("raise", "skip"):
            raise ValueError(f"on_shard_error must be 'raise' or 'skip', not {on_shard_error!r}")
        if read_ahead < 0:
            raise ValueError(f"read_ahead must be >= 0, not {read_ahead}")
        self.storage_options = dict(storage_options or {})
        self.stats = stats if stats is not None else SkipStats()
        self.policy = policy or ReadPolicy()
        self.read_ahead = read_ahead
        self.on_shard_error = on_shard_error
        self.cache = cache
        self.coalesce = coalesce

    def _read(
        self,
        span: dict,
        cancel: threading.Event | None,
        missing: dict | None,
        counts: RequestCounts,
    ) -> bytes | StorageError:
        """The span's bytes, or the ``StorageError`` of its read, its requests added to
        ``counts``. ``missing``: the error of each ``(url, pass)`` of the shards found missing
        so far (by any reader thread): not asked for again in that pass, since every read of
        them fails alike; a span of one gets the error its first read got, whichever reader
        thread found it."""
        if "failed" in span:  # nothing to read: the plan could not list its samples
            return b""
        found = (span["url"], span.get("pass"))
        if missing is not None and found in missing:
            return missing[found]
        options = span.get("storage_options")  # a mixture's source may have its own
        options = self.storage_options if options is None else options
        try:
            if self.cache is not None and "shard_bytes" in span:
                return self.cache.read(
                    span["url"],
                    span["shard_bytes"],
                    span["start"],
                    span["stop"],
                    options,
                    self.policy,
                    sha256=span.get("shard_sha256"),
                    counts=counts,
                )
            return read_range(
                span["url"], span["start"], span["stop"], options, self.policy, cancel, counts
            )
        except StorageError as e:
            if isinstance(e, ObjectNotFoundError) and missing is not None:
                missing.setdefault(found, e)
            return e

    def _planned(self, spans: Iterator[dict], sidecars: dict) -> Iterator[dict]:
        """``spans``, and in ``sidecars`` (``id(span)`` -> figures) the reads of a sidecar
        the plan made while making one (the shard's sample offsets, ``format.sidecar``)."""
        counts, spans = RequestCounts(), iter(spans)  # a Plan is iterable, not an iterator
        while True:
            token = sidecar.counting.set(counts)
            try:
                span = next(spans, None)
            finally:
                sidecar.counting.reset(token)
            if span is None:
                return
            read = counts.figures()
            if read["requests"]:
                counts.add(**{name: -n for name, n in read.items()})
                sidecars[id(span)] = read
            yield span

    def _taken(self, span: dict, sidecars: dict, read: RequestCounts | None) -> None:
        """The consumer takes ``span``: its sidecar's reads, and ``read`` (the requests of
        its read, or of the joined read it is the first of), are counted under its source.
        Counted as taken, not as read ahead, the figures at each batch do not depend on how
        far the reader threads got."""
        counts = self.stats.requests_of(span.get("source"))
        found = sidecars.pop(id(span), None)
        if found is not None:
            counts.add(**found)
        if read is not None:
            counts.add(**read.figures())

    def _grouped(self, spans: Iterator[dict]) -> Iterator[list[dict]]:
        """The spans in runs read with one request each (``coalesce.grouped``: within the
        read-ahead window), or one by one."""
        if not self.coalesce:
            return ([span] for span in spans)
        return grouped(spans, self.policy.block_bytes, self.read_ahead)

    def _fetched(self, spans: Iterator[dict]) -> Iterator[tuple[dict, bytes | StorageError]]:
        """``(span, its bytes or the error)`` in order, up to ``read_ahead`` read at once by
        reader threads, the plan walked by a background thread."""
        missing: dict[tuple, StorageError] = {}  # (url, pass) of shards the store lacks
        sidecars: dict[int, dict] = {}
        spans = self._planned(spans, sidecars)
        waiting = stretch(self.clock, "read_wait")  # what the store's answers keep us waiting
        if not self.read_ahead:
            while True:
                with waiting:  # read here, from the plan's sidecars on: all of it waits
                    span = next(spans, None)
                    if span is None:
                        return
                    counts = RequestCounts()
                    data = self._read(span, None, missing, counts)
                self._taken(span, sidecars, counts)
                yield span, data
        # ``ready`` holds reads in the plan's order, begun or done: its bound keeps the bytes
        # held to a few spans. ``jobs`` hands the same reads to the readers, in that order.
        ready: queue.Queue = queue.Queue(maxsize=self.read_ahead)
        jobs: queue.Queue = queue.Queue()
        stop = threading.Event()

        def put(item: tuple) -> bool:
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        def walk():
            try:
                for group in self._grouped(spans):
                    read = _Read(bounds(group)[0])
                    jobs.put((group, read))
                    for k, span in enumerate(group):
                        if not put((span, read, k)):
                            return
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, raised there
                put((None, e, None))
                return
            finally:
                for _ in readers:
                    jobs.put(None)  # each reader ends after the reads handed out
            put((_DONE, None, None))

        def read_jobs():
            while (job := jobs.get()) is not None:
                group, read = job
                if stop.is_set():  # the stage is closing: nothing will take it
                    read.done.set()
                    continue
                lo, hi = bounds(group)
                try:
                    joined = {**group[0], "start": lo, "stop": hi}
                    read.data = self._read(joined, stop, missing, read.counts)
                    if len(group) > 1 and isinstance(read.data, StorageError):
                        # each span read alone, as without coalescing: its own bytes or error
                        read.data = [self._read(s, stop, missing, read.counts) for s in group]
                except BaseException as e:  # noqa: BLE001 - a bug: raised in its place
                    read.error = e
                read.done.set()

        readers = [
            threading.Thread(target=read_jobs, name=f"wdsvlm-read-{i}", daemon=True)
            for i in range(self.read_ahead)
        ]
        walker = threading.Thread(target=walk, name="wdsvlm-read-ahead", daemon=True)
        for thread in [*readers, walker]:
            thread.start()
        try:
            while True:
                with waiting:  # the next read in the plan's order, begun or not, and its end
                    span, read, k = ready.get()
                    if span is not _DONE and span is not None:
                        read.done.wait()
                if span is _DONE:
                    return
                if span is None:
                    raise read
                if read.error is not None:
                    raise read.error
                self._taken(span, sidecars, read.counts if k == 0 else None)
                yield span, read.of(span, k)
        finally:
            stop.set()
            for thread in [walker, *readers]:
                thread.join()

    def __call__(self, spans: Iterator[dict]) -> Iterator[dict]:
        failed: set[tuple] = set()  # (url, pass): a shard given up on, for this pass
        pass_, yielded, whole = None, 0, True
        for span, data in self._fetched(spans):
            if span.get("pass") != pass_:
                # skip mode must not spin forever: a worker's whole share of a pass with no
                # sample that could be read is an error (a part of a pass handed over by an
                # elastic resume may lie in one bad shard)
                if pass_ is not None and not yielded and whole:
                    raise StorageError(
                        f"a whole pass over global worker {span.get('worker')}'s share gave no "
                        f"sample that could be read; the last shard: {span['url']}"
                    )
                pass_, yielded, whole = span.get("pass"), 0, True
            whole = whole and span.get("whole_share", False)
            if "failed" in span:  # its sidecar could not be read: its samples are unknown
                if self.on_shard_error == "raise":
                    raise span["failed"]
                for place in span["positions"]:
                    sample = {"__key__": f"place {place}", "__shard__": span["shard"]}
                    reason = "unreadable_sidecar"
                    self.stats.skip("read", reason, sample, str(span["failed"]), streak=False)
                continue
            if (span["url"], pass_) in failed:
                data = StorageError(f"{span['url']}: skipped after an earlier failure")
            if isinstance(data, StorageError):
                if self.on_shard_error == "raise":
                    raise data  # it names the shard's URL, the byte and the cause
                failed.add((span["url"], pass_))
                for entry in span["entries"]:
                    sample = {"__key__": entry["key"], "__shard__": span["shard"]}
                    self.stats.skip("read", "unreadable_shard", sample, str(data), streak=False)
                continue
            positions = span.get("positions") or [None] * len(span["entries"])
            layout = Layout.from_dict(span["layout"]) if "layout" in span else None
            for entry, position in zip(span["entries"], positions, strict=True):
                sample = {
                    "__key__": entry["key"],
                    "__shard__": span["shard"],
                    "__url__": span["url"],
                    "__meta__": entry,
                    "__pass__": span.get("pass", 0),
                    "__worker__": span["worker"],
                    "__pos__": position,
                }
                if span.get("source") is not None:
                    sample["__source__"] = span["source"]
                begin = entry["offset"] - span["start"]
                chunk = data[begin : begin + entry["size"]]
                if len(chunk) < entry["size"]:
                    self.stats.skip(
                        "read",
                        "truncated_tar",
                        sample,
                        f"{span['url']} ends before byte {entry['offset'] + entry['size']}",
                    )
                    continue
                try:
                    members = tar_members(chunk)
                except tarfile.TarError as e:
                    self.stats.skip("read", "corrupt_tar", sample, f"bad tar data: {e}")
                    continue
                prefix = entry["key"] + "."
                if not members or any(not name.startswith(prefix) for name in members):
                    self.stats.skip(
                        "read",
                        "corrupt_tar",
                        sample,
                        f"members {sorted(members)} at offset {entry['offset']} are not all "
                        f"of key {entry['key']}: the index does not match the shard",
                    )
                    continue
                members = {name[len(prefix) :]: value for name, value in members.items()}
                if layout is not None:  # another layout's members as wdsvlm's own
                    try:
                        members = layout.convert(entry["key"], members)
                    except BadSample as e:
                        self.stats.skip("read", e.reason, sample, f"{span['url']}: {e}")
                        continue
                self.stats.ok("read")
                sample.update(members)
                yielded += 1
                yield sample
