"""Where the writer's work runs: what an engine does, and the engine of this machine.

An engine takes the writer's two kinds of work: checking records (reading their images) and
writing shards. The writer picks one by name from its table (``writer.ENGINES``): ``local``
here, ``ray`` in ``ray_engine``. Either gives the same output: what goes where is decided by
the writer from the input order and sizes alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from .documents import DocumentOptions
from .inputs import iter_records
from .pool import process_pool
from .shards import check_record


class Pending(Protocol):
    def get(self) -> Any:
        """The result, once there (waiting for it)."""


class Engine(Protocol):
    """The writer's engine, built from ``(inputs, options, image_root, storage_options,
    formats, address)`` and used as a context manager (entering starts its workers)."""

    workers: int
    """How many workers it has (known once entered)."""

    def place(self, output: str) -> str:
        """``output`` as the engine's workers find it."""

    def checked(self) -> Iterator:
        """Every input record checked (``shards.check_record``), in input order; the input
        files' formats go into ``formats`` as they are found."""

    def apply_async(self, fn: Callable, args: tuple) -> Pending:
        """Run ``fn(*args)`` (a shard write) on a worker."""


class LocalEngine:
    """The writer's work on this machine: checks and shard writes in ``workers`` processes
    (none: in this one). Writes handed over between two batches of checks run before the
    next batch's checks."""

    def __init__(self, inputs, opts, image_root, storage_options, formats, address=None):
        self.inputs, self.opts, self.image_root = inputs, opts, image_root
        self.storage_options, self.formats = storage_options, formats
        self.workers = opts.workers
        self.pool = None

    def __enter__(self):
        self._context = process_pool(self.workers)
        self.pool = self._context.__enter__()
        return self

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)

    def place(self, output: str) -> str:
        return output

    def records(self) -> Iterator:
        documents = DocumentOptions(self.opts.image_folder, self.opts.min_sim, self.storage_options)
        for path in self.inputs:
            yield from iter_records(
                path,
                format=self.opts.format,
                image_root=self.image_root,
                storage_options=self.storage_options,
                found=self.formats,
                documents=documents,
            )

    def checked(self) -> Iterator:
        check = partial(
            check_record,
            storage_options=self.storage_options,
            max_video_pixels=self.opts.max_video_pixels,
        )
        return _checked_in_batches(self.pool, check, self.records(), self.workers)

    def apply_async(self, fn: Callable, args: tuple) -> Pending:
        if self.pool is None:  # no processes: run it here, now
            return _Done(fn(*args))
        return self.pool.apply_async(fn, args)


@dataclass
class _Done:
    """A result already there, with ``get`` as a pool's pending result has."""

    value: Any

    def get(self) -> Any:
        return self.value


def _checked_in_batches(pool, check, records: Iterator, workers: int) -> Iterator:
    """``check`` over ``records``, in order, a batch at a time: the pool takes its tasks in
    order, so shard writes handed to it between two batches run before the next batch's
    checks (one ``imap`` over every record would queue them all first, and the writes would
    wait for the last check, with every result held)."""
    if pool is None:
        yield from map(check, records)
        return
    while chunk := list(itertools.islice(records, 64 * workers)):
        yield from pool.map(check, chunk, chunksize=16)
