"""wdsvlm.Loader: the whole pipeline over a torch DataLoader, yielding packed batches.

    plan -> read -> shuffle -> tokenize -> pack -> balance -> collate (decodes packed images)

Packs are grouped into batches of even vision load (``BalanceBatches``). Tokens are counted
before any image is decoded (tile counts follow from the index sizes), so the packer works on
metadata and only the samples of an emitted pack are decoded, straight into the batch's tensor.

Every rank yields the same number of batches an epoch (``len(loader)``), and whatever an epoch
does not take is carried into the next one (``stream.py``): every sample once per pass, no
collective call, and ``state_dict()`` resumes exactly.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .. import compat
from ..errors import WdsvlmError
from .build import build
from .evaluation import evaluation_batches
from .placement import RayWorkers, check_ranks
from .report import Yielded, epoch_advice, epoch_stats
from .resume import resume_point, topology_of
from .settings import settings_from, signature_with_settings
from .state import LoaderState, WorkerState
from .stream import STATE_KEY, STATS_KEY
from .telemetry import meter_of
from .workers import check_main_guarded

log = logging.getLogger("wdsvlm.loader")


class Loader:
    """Packed, fixed-shape batches ``[batch_size, max_length]`` from a wdsvlm dataset.

    ``source``: a dataset folder or URL (``s3://``, ``gs://``, ...), brace-expanded tar URLs,
    or a mixture: a list of ``wdsvlm.Source`` (each with its ``repeat``, ``choose`` or
    ``weight``) or a mixture file (``.yaml``, ``.json``); see ``sources.py``.
    ``tokenizer``: a Hugging Face tokenizer, or a name/path for ``AutoTokenizer``; or instead
    ``processor``: a Hugging Face processor of a supported model family (Qwen2/2.5/3-VL,
    SmolVLM, Idefics3, LLaVA-OneVision), whose image sizes, image tokens and chat template are
    then used, and whose batches ``wdsvlm.model_inputs`` turns into the model's forward
    arguments. With a processor, ``max_tiles_per_pack`` is the vision budget in the family's
    units (patches for the Qwen family, tiles for SmolVLM, crops for LLaVA-OneVision).
    ``storage_options`` go to fsspec; ``read_policy`` (``wdsvlm.ReadPolicy``) sets the block
    size, retries, backoff and timeout of ranged reads, ``read_ahead`` how many spans each
    worker reads at once, and ``on_shard_error="skip"`` reports an unreadable shard's samples as
    skipped instead of raising. ``cache_dir`` keeps the ranges of shards read on local disk (at
    most ``cache_bytes``, counted in whole shards taken in while they fit; the ranks and
    workers of one machine can share it, and a range they need at the same time is fetched
    once).
    ``shuffle_buffer`` is in samples, ``shuffle_bytes`` bounds it in bytes; ``pack_window``
    is the packer's window in samples. ``max_tiles_per_batch`` caps every pack at its share,
    ``max_tiles_per_batch // batch_size`` tiles, so that no batch can pass it. rank and world
    size come from ``torch.distributed`` (or torchrun's environment) unless given.

    An epoch is ``len(loader)`` batches on every rank: ``batches_per_epoch``, or by default an
    estimate from the index of what one pass over the data packs into. What an epoch does not
    take is carried into the next (see ``stream.py``): across ranks and workers each sample
    comes once per pass; ``sample_passes`` in each batch says which pass each sample is of.

    Every keyword setting, with its default and meaning, is a field of
    ``wdsvlm.LoaderSettings`` (``loader.settings`` holds them, checked); those that shape the
    batches must be the same when a saved state is loaded.

    Iterate it for one epoch of batches; call ``set_epoch(e)`` at the top of each epoch
    (iterating again without it goes on with the next epoch). ``state_dict()`` after any
    step and ``load_state_dict()`` in a new process give the same batches from there on;
    ``load_state_dict()`` of the list of all ranks' states resumes on another topology.
    ``stats()`` reports fill, samples per pack, drops and skipped samples so far.
    ``close()`` stops the workers now, also in the middle of an epoch.
    """

    def __init__(self, source: Any, tokenizer: Any = None, **settings: Any):
        self.settings = settings_from(settings)
        parts = build(source, tokenizer, self.settings)  # see build.py
        self.family = parts.family
        self.worker_config = parts.worker_config
        self.plan = parts.plan
        self.tokenize = parts.tokenize
        self.stream = parts.stream
        self.dataloader_options = parts.dataloader_options
        self.pad_token_id = parts.pad_token_id
        self._uncounted = self.settings.evaluation  # its length: counted when first needed
        self._batches_per_epoch = parts.batches_per_epoch
        self._config = parts.config
        self._worker_stats: dict = {}
        self._yielded = Yielded()
        self._meter = meter_of(self.settings, self.worker_config)
        self._dataloader = None
        self._ray: Iterator[dict] | None = None  # the running Ray workers' batches
        self._running: weakref.ref | None = None  # the epoch's generator being iterated
        self._iteration: object | None = None  # its token: an older one's clean-up is not its
        self._batches: Iterator[dict] | None = None  # its workers' batches
        self._restored = False  # the position came from load_state_dict, not from iterating
        if self.dataloader_options["persistent_workers"]:
            self.plan.share_epoch()
        self._start_afresh(0)
        self._pinned = False  # set_epoch named the epoch to iterate: do not move past it

    @property
    def _batches_per_epoch(self) -> int:
        """Batches an epoch. An evaluation loader's are counted the first time they are asked
        for (its first ``len()`` or iteration: ``evaluation.evaluation_batches``), once; under
        ``torch.distributed`` that is a collective call, which every rank makes alike."""
        if self._uncounted:
            s = self.stream
            parts = (s.read, s.tokenize, s.pack, self.settings.batch_size, self.worker_config)
            length = evaluation_batches(self.plan, *parts)
            self._length = s.batches_per_epoch = self._config["batches_per_epoch"] = length
            self._uncounted = False
        return self._length

    @_batches_per_epoch.setter
    def _batches_per_epoch(self, length: int) -> None:
        self._length = length

    @property
    def tokenizer(self):
        """The tokenizer in use (a copy with the image token added, if it lacked one)."""
        return self.tokenize.tokenizer

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def batches_done(self) -> int:
        """The batches of the current epoch taken so far on this rank."""
        return self._done

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration yields. The current epoch keeps its position
        (as after ``load_state_dict``); the next one, once the current is whole, goes on with
        the samples it carries; any other epoch starts afresh at the start of that pass.

        The current epoch once whole yields nothing more: right after ``load_state_dict`` of a
        state saved at its end that is what a resumed loop needs (``set_epoch(e + 1)`` goes
        on); after this loader iterated it whole, asking for it again is refused, since
        nothing of it is left to yield."""
        if epoch == self._epoch:
            if self._done >= self._batches_per_epoch and not self._restored:
                raise WdsvlmError(
                    f"set_epoch({epoch}): epoch {epoch} is whole already (all "
                    f"{self._batches_per_epoch} of its batches were yielded), so iterating "
                    f"it again would yield nothing; call set_epoch({epoch + 1}) for the next "
                    "epoch (it goes on with the samples this one carries over)"
                )
        elif epoch == self._epoch + 1 and self._done >= self._batches_per_epoch:
            self._next_epoch()
        else:
            if self._done:
                log.warning(
                    "set_epoch(%d) after %d of %d batches of epoch %d: epoch %d starts afresh; "
                    "the samples epoch %d did not yield are not carried into it",
                    epoch,
                    self._done,
                    self._batches_per_epoch,
                    self._epoch,
                    epoch,
                    self._epoch,
                )
            self._start_afresh(epoch)
        self._pinned = True

    def _next_epoch(self) -> None:
        self._epoch += 1
        self._done = 0

    def _start_afresh(self, epoch: int) -> None:
        self._epoch = epoch
        self._done = 0
        self._states = [
            WorkerState.fresh(epoch) for _ in range(self.worker_config.workers_per_rank)
        ]
        self._restart_workers()

    def _restart_workers(self) -> None:
        """The workers' streams no longer stand where this loader does: start them anew."""
        self._reusable = False
        self.stream.forget()
        self._stop_ray()
        if self.dataloader_options["persistent_workers"]:
            self._dataloader = None  # its workers stop with it; new ones get the new job

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank: ``batches_per_epoch``, else an
        estimate of what one pass packs into (see ``sizing.estimate_batches``), rounded up to a
        multiple of ``num_workers``. An evaluation loader's is exact, counted at the first call,
        iteration or ``state_dict()`` (``evaluation.py``): under ``torch.distributed`` that
        first count is a collective call, so every rank must make it, or none."""
        return self._batches_per_epoch

    def __iter__(self) -> Iterator[dict]:
        check_ranks(self.worker_config, self.settings)
        if self.settings.evaluation:  # each iteration one whole pass: nothing carried
            self._start_afresh(0)
        batches = self._epoch_batches()
        self._running = weakref.ref(batches)
        return batches

    def _epoch_batches(self) -> Iterator[dict]:
        total = self._batches_per_epoch
        if self._done >= total:
            if self._pinned:  # set_epoch named an epoch restored at its end (else it raised)
                self._pinned = False
                log.info(
                    "epoch %d was restored at its end: it yields nothing more; set_epoch(%d) "
                    "goes on with the next",
                    self._epoch,
                    self._epoch + 1,
                )
                self._restored = False  # asking for it again is refused, as for any whole one
                return
            self._next_epoch()
        self._pinned = False
        self._restored = False
        if not (self._reusable and self._done == 0):
            self._restart_workers()
        self.stream.job = {"epoch": self._epoch, "done": self._done, "states": list(self._states)}
        self.plan.epoch = self._epoch
        self._worker_stats = {}
        self._yielded = Yielded()
        whole = self._done == 0
        self._reusable = False
        self._meter.prepare(self.stream)  # telemetry.py: what workers time, the hang board
        batches = self._ray_batches(total) if self._on_ray else self._local_batches()
        iteration = self._iteration = object()
        self._batches = batches
        try:
            for batch in self._meter.timed(batches, self._done):  # each step's wait timed
                state = batch.pop(STATE_KEY)
                self._states[state["slot"]] = state["state"]  # a WorkerState
                report = batch.pop(STATS_KEY)
                self._meter.arrived(report)
                self._worker_stats[report.pop("slot")] = report
                self._done += 1
                self._meter.handed(batch, *self._yielded.count(batch))
                yield batch
        except (GeneratorExit, Exception):
            # Iteration stopped early (or close()), or an error: stop the workers now. An
            # error's traceback holds the DataLoader's iterator, and freed later by the cycle
            # collector, its queues can go first, its workers are never told to stop, and each
            # is waited for 5 s. New workers for what follows.
            self._stop_workers(batches, iteration)
            raise
        if self._done != total:
            raise WdsvlmError(f"epoch {self._epoch} ended after {self._done} of {total} batches")
        budgets = self.settings.max_length, self.settings.tiles_per_pack, self.family.unit_name
        advice = epoch_advice(self._worker_stats, *budgets)
        if advice and self.worker_config.rank == 0:
            log.warning("epoch %d: %s", self._epoch, advice)
        # each worker's stream stands at its end, and plays the slot it will play next epoch
        self._reusable = whole and not self._on_ray
        self._batches = self._iteration = None

    def _stop_workers(self, batches: Iterator[dict] | None, iteration: object) -> None:
        """Stop the workers of ``iteration`` now (and their read-ahead threads): the
        DataLoader's processes and the shared memory of the batches they hold, or the Ray
        actors; an iteration after this starts new ones. Not those of a later iteration: an
        older one's generator may be collected, and end, while a later one runs; nor at
        interpreter exit (modules torn down: ``compat`` is None), when the workers go anyway."""
        if iteration is not self._iteration or compat is None:
            return
        self._batches = self._iteration = None
        self._meter.stop()
        compat.shutdown_workers(batches)
        self._stop_ray()
        self._dataloader = None
        self._reusable = False
        self.stream.forget()

    @property
    def _on_ray(self) -> bool:
        return isinstance(self.settings.workers, RayWorkers)

    def _local_batches(self) -> Iterator[dict]:
        """The epoch's batches from the DataLoader (its workers on this node, or none)."""
        from torch.utils.data import DataLoader

        options = self.dataloader_options
        if self._dataloader is None:  # kept, so that persistent workers persist
            if options["num_workers"]:
                check_main_guarded(options["multiprocessing_context"].get_start_method())
            self._dataloader = DataLoader(self.stream, **options)
        return iter(self._dataloader)

    def _ray_batches(self, total: int) -> Iterator[dict]:
        """The epoch's batches from one Ray actor per worker (``ray_workers.py``); the
        actors stop with the iteration, or when this loader closes."""
        import torch

        from .ray_workers import ray_batches

        self._ray = ray_batches(
            self.stream,
            self._epoch,
            self._done,
            self._states,
            total,
            self.settings.workers,
            pin_memory=self.settings.pin_memory and torch.cuda.is_available(),
        )
        return self._ray

    def close(self) -> None:
        """Stop the workers (DataLoader processes, with the shared memory of the batches they
        hold, or Ray actors) and any read-ahead thread now, also in the middle of an epoch:
        the epoch's iteration ends there (also done when the loader goes). Iterating again
        starts new workers from where this loader stands."""
        running = self._running() if self._running is not None else None
        self._running = None
        if running is not None:
            try:
                running.close()  # its GeneratorExit stops the workers
            except ValueError:  # it runs now (close() from a signal handler, another thread)
                self._stop_workers(self._batches, self._iteration)
        self.stream.forget()
        self._reusable = False
        self._dataloader = None
        self._stop_ray()
        self._meter.close()  # its hang board's file goes; a trace is written

    def _stop_ray(self) -> None:
        ray, self._ray = getattr(self, "_ray", None), None
        if ray is not None:
            ray.close()  # its actors are killed

    def __del__(self):
        stream = getattr(self, "stream", None)
        try:
            if stream is not None:
                stream.forget()
            self._stop_ray()
        except Exception:  # noqa: BLE001 - at interpreter exit, parts may be gone already
            pass

    def state_dict(self) -> dict:
        """Where this rank's loader stands: the epoch, the batches of it taken so far, and
        each worker's stream position (places of samples, no sample bytes). Save it with the
        model checkpoint, one per rank. An evaluation loader's length is counted first, if it
        was not yet (a collective call under ``torch.distributed``: every rank saves alike)."""
        self._batches_per_epoch  # noqa: B018 - the state records the counted length
        state = LoaderState(
            self._epoch,
            self._done,
            topology_of(self.worker_config),
            dict(self._config),
            list(self._states),
        )
        return state.saved()

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Go on from a ``state_dict()``: the next batches are the ones the saved run yielded
        after it. The dataset and the settings must be the ones it was saved with; a
        difference is refused, naming it.

        ``state`` is this rank's own state (the same rank, world size and workers: the same
        batches, bit for bit), or the list of the states of all ranks of the old run, in
        rank order, which resumes on any topology (``elastic.py``): the rest of the
        interrupted pass comes exactly once, spread over the new ranks and workers, and
        ``len(loader)`` is estimated for the new topology, the same on every rank; the
        current epoch keeps the share of its batches already taken.
        """
        point = resume_point(
            state,
            self.worker_config,
            self._config,
            self.plan,
            self._batches_per_epoch,
        )
        # the saved run's epochs go on as they were (an elastic resume keeps this one's)
        self._batches_per_epoch = self.stream.batches_per_epoch = point.batches_per_epoch
        self._config["batches_per_epoch"] = point.batches_per_epoch
        self._epoch = point.epoch
        self._done = point.done
        self._states = point.workers
        self._pinned = False
        self._restored = True
        self._restart_workers()

    def stats(self) -> dict:
        """For the batches of this epoch yielded so far on this rank: fill ratio of the packed
        rows, samples and tiles per pack, tiles-per-batch spread; and, all workers together,
        drops, truncations and skipped samples (counts, and up to 10 ``"SHARD/KEY"`` per reason
        and worker) in what the workers read this epoch; and per source, ``"requests"``."""
        return epoch_stats(self._yielded, self._worker_stats, self.settings.max_length)

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Figures for the logs, names under ``data/``, since the last reset (``reset``: start
        the next interval now): the steps' waits for data, samples and tokens per second, and
        the workers' seconds per stage, requests and skips (docs/monitoring.md)."""
        return self._meter.metrics(reset)


Loader.__init__.__signature__ = signature_with_settings(Loader.__init__)
