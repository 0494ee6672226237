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

import copy
import hashlib
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ..errors import WdsvlmError
from ..families.registry import family_of
from ..families.tiling import ImageConfig, TilingFamily
from ..loader.elastic import check_states, remap
from ..loader.settings import (
    STATE_VERSION,
    check_resume,
    resume_config,
    settings_from,
    signature_with_settings,
    upgrade_state,
)
from ..loader.sizing import estimate_batches
from ..loader.stream import STATE_KEY, STATS_KEY, Stream, fresh_state
from ..loader.workers import (
    check_context,
    check_main_guarded,
    exit_with_training_process,
    worker_context,
)
from ..pipeline.collate import Collate
from ..pipeline.pack import BalanceBatches, Pack, tiles_cv
from ..pipeline.plan import Plan, WorkerConfig
from ..pipeline.read import ReadSamples
from ..pipeline.shuffle import Shuffle
from ..pipeline.stats import SkipStats
from ..pipeline.tokenize import Tokenize
from ..storage.cache import ShardCache

log = logging.getLogger("wdsvlm.loader")


class Loader:
    """Packed, fixed-shape batches ``[batch_size, max_length]`` from a wdsvlm dataset.

    ``source``: a dataset folder or URL (``s3://``, ``gs://``, ...), brace-expanded tar URLs,
    or a mixture: a list of ``wdsvlm.Source`` (each with its ``repeat``, ``choose`` or
    ``weight``) or a mixture file (``.yaml``, ``.json``); see ``mixture.py``.
    ``tokenizer``: a Hugging Face tokenizer, or a name/path for ``AutoTokenizer``; or instead
    ``processor``: a Hugging Face processor of a supported model family (Qwen2/2.5/3-VL,
    SmolVLM, Idefics3), whose image sizes, image tokens and chat template are then used, and
    whose batches ``wdsvlm.model_inputs`` turns into the model's forward arguments. With a
    processor, ``max_tiles_per_pack`` is the vision budget in the family's units (patches
    for the Qwen family, tiles for SmolVLM).
    ``storage_options`` go to fsspec; ``read_policy`` (``wdsvlm.ReadPolicy``) sets the block
    size, retries, backoff and timeout of ranged reads, ``read_ahead`` how many spans each
    worker reads ahead, and ``on_shard_error="skip"`` reports an unreadable shard's samples as
    skipped instead of raising. ``cache_dir`` keeps whole shards on local disk once read (at
    most ``cache_bytes``, least recently used out first; ranks and workers of one machine can
    share it).
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
    """

    def __init__(self, source: Any, tokenizer: Any = None, **settings: Any):
        self.settings = settings = settings_from(settings)
        if (tokenizer is None) == (settings.processor is None):
            both = ", not both" if tokenizer is not None else ""
            raise TypeError(
                "Loader needs a tokenizer (the default tiling) or processor= (a model "
                f"family's Hugging Face processor){both}"
            )
        environment = WorkerConfig.from_environment(settings.num_workers)
        self.worker_config = WorkerConfig(
            environment.rank if settings.rank is None else settings.rank,
            environment.world_size if settings.world_size is None else settings.world_size,
            settings.num_workers,
        )
        self.max_length = settings.max_length
        self.batch_size = settings.batch_size
        self.image_config = ImageConfig(
            settings.tile_size, settings.max_image_side, settings.upscale
        )
        self.family = (  # a processor's family, else the default tiling with the tokenizer
            family_of(settings.processor)
            if settings.processor is not None
            else TilingFamily(
                self.image_config,
                tokenizer,
                tokens_per_tile=settings.tokens_per_tile,
                image_token=settings.image_token,
            )
        )
        self._skips = SkipStats(settings.max_consecutive_failures)
        self.plan = Plan(
            source,
            seed=settings.seed,
            worker_config=self.worker_config,
            storage_options=settings.storage_options,
            read_policy=settings.read_policy,
            samples_per_pass=settings.samples_per_pass,
        )
        if self.plan.num_samples < self.worker_config.global_workers:
            raise ValueError(
                f"{source}: {self.plan.num_samples} samples for "
                f"{self.worker_config.global_workers} global workers (world_size "
                f"{self.worker_config.world_size} x num_workers {settings.num_workers}); every "
                "worker needs at least one sample a pass: use fewer workers"
            )
        self.tokenize = Tokenize(
            family=self.family,
            chat_template=settings.chat_template,
            stats=self._skips,
        )
        tok = self.tokenize.tokenizer
        # made before sizing the epoch: a fork server starts now, in the background
        num_workers = settings.num_workers
        self.dataloader_options = {
            "batch_size": None,
            "num_workers": num_workers,
            "pin_memory": settings.pin_memory,
            "persistent_workers": settings.persistent_workers and num_workers > 0,
        }
        if num_workers:
            context = check_context(settings.multiprocessing_context)
            check_main_guarded(context)  # before a fork server starts, not in each worker
            self.dataloader_options["prefetch_factor"] = settings.prefetch_factor or 2
            self.dataloader_options["worker_init_fn"] = exit_with_training_process
            preload = [type(tok).__module__, *self.family.modules]
            self.dataloader_options["multiprocessing_context"] = worker_context(
                context, tuple(preload)
            )
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_token_id = 0 if pad is None else pad
        self.max_tiles_per_pack = settings.tiles_per_pack
        self.pack = Pack(
            settings.max_length,
            max_tiles_per_pack=self.max_tiles_per_pack,
            window=settings.pack_window,
            truncate=settings.truncate,
            unit=self.family.unit_name,
        )
        self.balance = BalanceBatches(settings.batch_size)
        # a multiple of the workers, so that each gives the same number of batches an epoch
        # and none falls behind the others epoch after epoch
        workers = self.worker_config.workers_per_rank
        estimate = settings.batches_per_epoch or estimate_batches(
            self.plan, self.tokenize, self.pack, settings, self.worker_config
        )
        self._batches_per_epoch = -(-estimate // workers) * workers
        self.stream = Stream(
            self.plan,
            ReadSamples(
                settings.storage_options,
                stats=self._skips,
                policy=settings.read_policy,
                read_ahead=settings.read_ahead,
                on_shard_error=settings.on_shard_error,
                cache=ShardCache(settings.cache_dir, settings.cache_bytes)
                if settings.cache_dir
                else None,
            ),
            Shuffle(settings.shuffle_buffer, settings.shuffle_bytes, settings.seed),
            self.tokenize,
            self.pack,
            self.balance,
            Collate(
                settings.max_length,
                settings.batch_size,
                self.pad_token_id,
                family=self.family,
                stats=self._skips,
            ),
            self._skips,
            self._batches_per_epoch,
        )
        self._config = resume_config(  # what a saved state must agree with to resume exactly
            settings,
            max_tiles_per_pack=self.max_tiles_per_pack,
            image_token=self.tokenize.image_token,
            chat_template=self.tokenize.chat_template,
            dataset=self._dataset_id(),
            tokenizer=self.tokenize.fingerprint(),
            batches_per_epoch=self._batches_per_epoch,
        )
        self._worker_stats: dict = {}
        self._yielded = [0, 0, 0, 0]
        self._dataloader = None
        if self.dataloader_options["persistent_workers"]:
            self.plan.share_epoch()
        self._start_afresh(0)
        self._pinned = False  # set_epoch named the epoch to iterate: do not move past it

    @property
    def tokenizer(self):
        """The tokenizer in use (a copy with the image token added, if it lacked one)."""
        return self.tokenize.tokenizer

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration yields. The current epoch keeps its position
        (as after ``load_state_dict``); the next one, once the current is whole, goes on with
        the samples it carries; any other epoch starts afresh at the start of that pass."""
        if epoch == self._epoch:
            pass
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
        self._states = [fresh_state(epoch) for _ in range(self.worker_config.workers_per_rank)]
        self._restart_workers()

    def _restart_workers(self) -> None:
        """The workers' streams no longer stand where this loader does: start them anew."""
        self._reusable = False
        self.stream.forget()
        if self.dataloader_options["persistent_workers"]:
            self._dataloader = None  # its workers stop with it; new ones get the new job

    def __len__(self) -> int:
        """Batches per epoch, the same on every rank: ``batches_per_epoch``, else an
        estimate of what one pass packs into (see ``sizing.estimate_batches``), rounded up to a
        multiple of ``num_workers``."""
        return self._batches_per_epoch

    def _dataset_id(self) -> str:
        """The sources' shards (names, samples, bytes, sha256) and each source's share of a pass."""
        sources = [
            [
                s.name,
                s.copies,
                s.extra,
                [
                    [h["name"], h["samples"], h.get("bytes"), h.get("sha256")]
                    for h in s.index["shards"]
                ],
            ]
            for s in self.plan.sources
        ]
        if not self.plan.mixture:  # as the first release recorded a dataset
            sources = sources[0][3]
        return hashlib.sha256(json.dumps(sources).encode()).hexdigest()[:16]

    def __iter__(self) -> Iterator[dict]:
        from torch.utils.data import DataLoader

        total = self._batches_per_epoch
        if self._done >= total:
            if self._pinned:  # set_epoch named an epoch that is already whole
                self._pinned = False
                return
            self._next_epoch()
        self._pinned = False
        if not (self._reusable and self._done == 0):
            self._restart_workers()
        self.stream.job = {"epoch": self._epoch, "done": self._done, "states": list(self._states)}
        self.plan.epoch = self._epoch
        self._worker_stats = {}
        self._yielded = [0, 0, 0, 0]  # packs, samples, tokens, tiles
        if self._dataloader is None:  # kept, so that persistent workers persist
            if self.dataloader_options["num_workers"]:
                check_main_guarded(
                    self.dataloader_options["multiprocessing_context"].get_start_method()
                )
            self._dataloader = DataLoader(self.stream, **self.dataloader_options)
        whole = self._done == 0
        self._reusable = False
        batches = iter(self._dataloader)
        try:
            for batch in batches:
                state = batch.pop(STATE_KEY)
                self._states[state["role"]] = state["state"]
                report = batch.pop(STATS_KEY)
                self._worker_stats[report.pop("worker")] = report
                self._done += 1
                self._count(batch)
                yield batch
        except Exception as e:
            # Stop the workers now: the error's traceback holds the DataLoader's iterator, and
            # freed later by the cycle collector, its queues can go first, its workers are
            # never told to stop, and each is waited for 5 s. New workers for what follows.
            shutdown = getattr(batches, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._dataloader = None
            self.stream.forget()  # without workers: the read-ahead thread stops now
            if (
                isinstance(e, (ConnectionError, EOFError))
                and self.dataloader_options["num_workers"]
            ):
                # a worker that dies while its batch's shared memory is being handed over
                raise RuntimeError(
                    "DataLoader worker exited unexpectedly while handing over a batch "
                    f"({type(e).__name__}: {e})"
                ) from e
            raise
        if self._done != total:
            raise WdsvlmError(f"epoch {self._epoch} ended after {self._done} of {total} batches")
        self._reusable = whole  # each worker's stream stands at the end of this epoch

    def _count(self, batch: dict) -> None:
        yielded = self._yielded
        yielded[0] += sum(1 for row in batch["sample_keys"] if row)
        yielded[1] += sum(len(row) for row in batch["sample_keys"])
        yielded[2] += int(batch["attention_mask"].sum())
        yielded[3] += int(batch["image_tiles"].sum())

    def close(self) -> None:
        """Stop the workers and any read-ahead thread now (also done when the loader goes)."""
        self.stream.forget()
        self._reusable = False
        self._dataloader = None

    def __del__(self):
        stream = getattr(self, "stream", None)
        if stream is not None:
            try:
                stream.forget()
            except Exception:  # noqa: BLE001 - at interpreter exit, parts may be gone already
                pass

    def state_dict(self) -> dict:
        """Where this rank's loader stands: the epoch, the batches of it taken so far, and
        each worker's stream position (places of samples, no sample bytes). Save it with the
        model checkpoint, one per rank."""
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "done": self._done,
            "topology": self._topology(),
            "config": dict(self._config),
            "workers": copy.deepcopy(self._states),
        }

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
        if isinstance(state, Sequence) and not isinstance(state, Mapping):
            states = [upgrade_state(s) for s in state]
            check_states(states)
            old = states[0]["topology"]
            here = self._topology()
            if (old["world_size"], old["num_workers"]) == (here["world_size"], here["num_workers"]):
                state = states[here["rank"]]  # the same topology: exactly as saved
            else:
                self._load_elsewhere(states)
                return
        state = upgrade_state(state)
        saved, here = state["topology"], self._topology()
        if saved != here:
            diff = ", ".join(
                f"{k} {saved.get(k)} -> {v}" for k, v in here.items() if saved.get(k) != v
            )
            raise ValueError(
                f"cannot resume: the loader state was saved with a different topology ({diff}). "
                "One rank's state resumes only on the same rank, world_size and num_workers. "
                "To change them, pass the list of the states of all ranks of the old run "
                "instead (for example gathered on rank 0 with all_gather_object when saving)"
            )
        check_resume(state["config"], self._config)
        saved_length = state["config"]["batches_per_epoch"]
        if saved_length != self._batches_per_epoch:  # the saved run's epochs go on as they were
            log.info("len(loader) is %d as saved (estimated %d now)", saved_length, len(self))
            self._batches_per_epoch = self.stream.batches_per_epoch = saved_length
            self._config["batches_per_epoch"] = saved_length
        self._epoch = state["epoch"]
        self._done = state["done"]
        self._states = copy.deepcopy(state["workers"])
        self._pinned = False
        self._restart_workers()

    def _load_elsewhere(self, states: list[dict]) -> None:
        """Resume the states of all ranks of a run on this loader's other topology."""
        first = states[0]
        saved_length = first["config"]["batches_per_epoch"]
        check_resume(first["config"], self._config)
        config = self.worker_config
        self._states = remap(
            states, self.plan.num_samples, config.rank, config.world_size, config.workers_per_rank
        )
        length = self._batches_per_epoch
        self._epoch = first["epoch"]
        self._done = min(length, round(first["done"] * length / saved_length))
        log.info(
            "resumed %d ranks x %d workers on %d x %d: epoch %d goes on at batch %d of %d "
            "(%d of %d as saved)",
            first["topology"]["world_size"],
            first["topology"]["num_workers"],
            config.world_size,
            config.num_workers,
            self._epoch,
            self._done,
            length,
            first["done"],
            saved_length,
        )
        self._pinned = False
        self._restart_workers()

    def _topology(self) -> dict:
        config = self.worker_config
        return {
            "rank": config.rank,
            "world_size": config.world_size,
            "num_workers": config.num_workers,
        }

    def stats(self) -> dict:
        """For the batches of this epoch yielded so far on this rank: fill ratio of the
        packed rows, samples and tiles per pack, tiles-per-batch spread; and, all workers
        together, drops, truncations and skipped samples (counts, and up to 10
        ``"SHARD/KEY"`` per reason and worker) in what the workers read this epoch."""
        skips = SkipStats()
        truncated = batches = tiles = squares = 0
        dropped: dict = {}
        dropped_examples: dict = {}
        for report in self._worker_stats.values():
            skips.merge(report["skips"])
            packing = report["packing"]
            truncated += packing["truncated"]
            full_batches, batch_tiles, batch_squares = report["batch_tiles"]
            batches += full_batches
            tiles += batch_tiles
            squares += batch_squares
            for reason, n in packing["dropped"].items():
                dropped[reason] = dropped.get(reason, 0) + n
            for reason, keys in packing["dropped_examples"].items():
                dropped_examples.setdefault(reason, []).extend(keys)
        packs, samples, tokens, pack_tiles = self._yielded
        capacity = packs * self.max_length
        return {
            "fill": tokens / capacity if capacity else 0.0,
            "packs": packs,
            "samples": samples,
            "samples_per_pack": samples / packs if packs else 0.0,
            "tiles_per_pack": pack_tiles / packs if packs else 0.0,
            "tiles_per_batch_cv": tiles_cv(batches, tiles, squares),
            "truncated": truncated,
            "dropped": dropped,
            "dropped_examples": dropped_examples,
            "skipped": dict(skips.counts),
            "skipped_examples": {k: list(v) for k, v in skips.examples.items()},
        }


Loader.__init__.__signature__ = signature_with_settings(Loader.__init__)
