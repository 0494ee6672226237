"""The writer on a Ray cluster: ``wdsvlm write --engine ray``, ``write_dataset(..., engine="ray")``.

The same writer as on one machine (``writer.write_dataset``), with its work as Ray tasks
(an ``engines.Engine``):

- **Checks**: the records go to CPU tasks in units, each task reading the records' images
  (local paths, buckets, any fsspec URL) and checking them. A Parquet file's unit is one row
  group, read by the task itself (the driver reads only the files' footers); JSON/JSONL
  records are read on the driver (text only) and go 64 to a unit; a ``ray.data.Dataset`` of
  records streams its rows to the driver (text only: its images must be paths or URLs).
  Units run at most two per CPU of the cluster at once and come back in input order.
- **Shards**: the driver cuts the checked samples (sizes and image references, never image
  bytes) into shards with the local writer's rule, and each shard is written by a task
  straight to the output URL, in its prefix folder with ``prefixes`` (read images, write
  the tar to a staging file, publish it, publish its sidecar) and returns its root-index
  entry. A task whose worker dies is run again by Ray (``max_retries``); a shard appears
  only whole, under the same name and bytes.
- **Index**: the driver merges the entries in shard order and writes ``index.json`` last.

So the output is byte-identical to ``--engine local`` and the same for any number of Ray
workers: where samples go is a function of the input order and sizes alone.

Per shard the driver sends one task its plan (a few hundred bytes a sample) and gets back
its entry (about 0.4 kB); image bytes travel only from where they are stored to the task
that checks them and the task that writes their shard.
"""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import InputError
from ..format.conversation import detect_format
from .documents import detect_layout
from .inputs import iter_records, normalize
from .parquet import is_parquet, iter_parquet, open_parquet, parquet_format
from .shards import check_record

UNIT_RECORDS = 64  # JSON records per check task
RETRIES = 3  # runs again of a task whose worker died


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("the Ray engine needs Ray: pip install 'wdsvlm[ray]'") from None
    return ray


class RayEngine:
    """The writer's engine on Ray (see the module). ``address`` joins a running cluster;
    else one already initialised in this process is used, or a local Ray of ``workers``
    CPUs is started and stopped."""

    def __init__(self, inputs, opts, image_root, storage_options, formats, address=None):
        if isinstance(inputs, list):  # tasks may run elsewhere: no path relative to here
            inputs = [absolute(p) for p in inputs]
        self.inputs, self.opts, self.image_root = inputs, opts, absolute(image_root)
        self.pending: set = set()  # tasks handed out and not yet collected
        self.storage_options = dict(storage_options or {})
        self.formats = formats
        self.address = address
        self.started = False
        self.workers = opts.workers

    def __enter__(self):
        ray = _ray()
        if not ray.is_initialized():
            if self.address:
                ray.init(address=self.address, log_to_driver=False)
            else:
                ray.init(num_cpus=self.opts.workers, include_dashboard=False, log_to_driver=False)
            self.started = True
        self.workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
        self._check = ray.remote(max_retries=RETRIES)(_check_unit)
        self._run = ray.remote(max_retries=RETRIES)(_run)
        return self

    def __exit__(self, *exc):
        ray = _ray()
        if exc[0] is not None:  # the driver gave up: no task may go on writing after it
            for ref in self.pending:
                ray.cancel(ref, force=True)
        if self.started:
            ray.shutdown()
        return False

    def place(self, output: str) -> str:
        return absolute(output)  # the tasks write there, wherever they run

    def units(self) -> Iterator[tuple]:
        if not isinstance(self.inputs, list):  # a ray.data.Dataset of records
            yield from _chunks(("records", r) for r in self._dataset_records())
            return
        for path in self.inputs:
            if not is_parquet(path):
                records = iter_records(
                    path,
                    format=self.opts.format,
                    image_root=self.image_root,
                    storage_options=self.storage_options,
                    found=self.formats,
                )
                yield from _chunks(("records", r) for r in records)
                continue
            with open_parquet(path, self.storage_options) as parquet:
                fmt = self.opts.format
                fmt = parquet_format(parquet, path) if fmt == "auto" else fmt
                self.formats[path] = fmt
                rows = [
                    parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)
                ]
            first = 0
            for group, n in enumerate(rows):
                yield ("parquet", path, group, first, fmt, self.image_root)
                first += n

    def _dataset_records(self) -> Iterator[dict | InputError]:
        from ray.data import DataContext

        fmt = None if self.opts.format == "auto" else self.opts.format
        options = DataContext.get_current().execution_options
        kept, options.preserve_order = options.preserve_order, True  # the rows in their order
        try:
            for n, row in enumerate(self.inputs.iter_rows()):
                if fmt is None:
                    fmt = detect_layout(row) or detect_format(row, "the Ray dataset")
                    self.formats["the Ray dataset"] = fmt
                root = self.image_root or "."
                yield normalize(dict(row), fmt, f"dataset row {n}", "dataset", root)
        finally:
            options.preserve_order = kept

    def checked(self) -> Iterator[dict | InputError]:
        """Every record checked, in input order, at most two units per CPU in flight."""
        window: collections.deque = collections.deque()
        for unit in self.units():
            check = self._check.remote(unit, self.storage_options, self.opts.max_video_pixels)
            window.append(self._handed(check))
            while len(window) >= 2 * self.workers:
                yield from self._collect(window.popleft())
        while window:
            yield from self._collect(window.popleft())

    def apply_async(self, fn, args) -> _Pending:
        return _Pending(self, self._handed(self._run.remote(fn, args)))

    def _handed(self, ref):
        self.pending.add(ref)
        return ref

    def _collect(self, ref):
        result = _ray().get(ref)
        self.pending.discard(ref)
        return result


class _Pending:
    def __init__(self, engine: RayEngine, ref):
        self.engine, self.ref = engine, ref

    def get(self):
        return self.engine._collect(self.ref)


def absolute(path: str | None) -> str | None:
    """A local path made absolute (a URL as it is): Ray tasks may run in another folder."""
    if path is None or "://" in path:
        return path
    return os.path.abspath(path)


def _chunks(items: Iterator[tuple]) -> Iterator[tuple]:
    """``("records", [up to UNIT_RECORDS records])`` from ``("records", record)`` items."""
    items = iter(items)
    while chunk := list(itertools.islice(items, UNIT_RECORDS)):
        yield ("records", [record for _, record in chunk])


def _run(fn, args):
    return fn(*args)


def _check_unit(unit: tuple, storage_options: Mapping[str, Any], max_video_pixels: int) -> list:
    """A task: the checked records of one unit (see the module)."""
    if unit[0] == "records":
        records = unit[1]
    else:
        _, path, group, first, fmt, image_root = unit
        records = [
            normalize(raw, fmt, where, path, image_root, origin)
            for where, raw, origin in iter_parquet(path, storage_options, [group], first)
        ]
    return [check_record(r, storage_options, max_video_pixels) for r in records]
