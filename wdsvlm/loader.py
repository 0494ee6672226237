"""wdsvlm.Loader: the whole pipeline over a torch DataLoader, yielding packed batches.

    plan -> read -> shuffle -> tokenize -> pack -> balance -> collate (decodes packed images)

Packs are grouped into batches of even vision load (``BalanceBatches``). Tokens are counted
before any image is decoded (tile counts follow from the index sizes), so
the packer works on metadata and only the samples of an emitted pack are decoded, straight
into the batch's tensor.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import webdataset as wds

from .collate import Collate
from .images import ImageConfig, tile_count
from .pack import BalanceBatches, Pack, tiles_cv
from .plan import Plan, WorkerConfig
from .read import ReadSamples
from .shuffle import Shuffle
from .stats import SkipStats
from .tokenize import Tokenize

_STATS_KEY = "_wdsvlm_stats"  # rides on each batch from the worker, removed before yielding


class _WithStats:
    """Last stage: put the worker's running counts on each batch."""

    def __init__(self, stats: SkipStats, pack: Pack, balance: BalanceBatches):
        self.stats = stats
        self.pack = pack
        self.balance = balance

    def __call__(self, batches: Iterator[dict]) -> Iterator[dict]:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker = info.id if info is not None else 0
        self.stats.reset()  # counts are per epoch
        for batch in batches:
            batch[_STATS_KEY] = {
                "worker": worker,
                "skips": self.stats.as_dict(examples=10),  # rides on every batch: keep it small
                "packing": self.pack.pack_stats.as_dict(),
                "tokens": self.pack.pack_stats.tokens,
                "capacity": self.pack.pack_stats.capacity,
                "batch_tiles": list(self.balance.figures),
            }
            yield batch


class Loader:
    """Packed, fixed-shape batches ``[batch_size, max_length]`` from a wdsvlm dataset.

    ``source``: a dataset folder or URL (``s3://``, ``gs://``, ...) or brace-expanded tar URLs.
    ``tokenizer``: a Hugging Face tokenizer, or a name/path for ``AutoTokenizer``.
    ``shuffle_buffer`` is in samples, ``shuffle_bytes`` bounds it in bytes; ``pack_window``
    is the packer's window in samples. ``max_tiles_per_batch`` caps every pack at its share,
    ``max_tiles_per_batch // batch_size`` tiles, so that no batch can pass it. rank and world
    size come from ``torch.distributed`` (or torchrun's environment) unless given.

    Iterate it for one epoch of batches; call ``set_epoch(e)`` at the top of each epoch.
    ``stats()`` reports fill, samples per pack, drops and skipped samples so far.
    """

    def __init__(
        self,
        source: str | Sequence[str],
        tokenizer: Any,
        *,
        max_length: int = 2048,
        batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        shuffle_bytes: int = 256 * 2**20,
        tile_size: int = 512,
        max_image_side: int = 1024,
        upscale: bool = False,
        tokens_per_tile: int = 64,
        max_tiles_per_pack: int | None = None,
        max_tiles_per_batch: int | None = None,
        pack_window: int = 500,
        truncate: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        max_consecutive_failures: int = 100,
        image_token: str | None = None,
        chat_template: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        if max_length < 1 or batch_size < 1:
            raise ValueError(
                f"max_length ({max_length}) and batch_size ({batch_size}) must be positive"
            )
        environment = WorkerConfig.from_environment(num_workers)
        self.worker_config = WorkerConfig(
            environment.rank if rank is None else rank,
            environment.world_size if world_size is None else world_size,
            num_workers,
        )
        self.max_length = max_length
        self.batch_size = batch_size
        self.image_config = ImageConfig(tile_size, max_image_side, upscale)
        self._skips = SkipStats(max_consecutive_failures)
        self.plan = Plan(
            source, seed=seed, worker_config=self.worker_config, storage_options=storage_options
        )
        self.tokenize = Tokenize(
            tokenizer,
            tokens_per_tile=tokens_per_tile,
            image_config=self.image_config,
            image_token=image_token,
            chat_template=chat_template,
            stats=self._skips,
        )
        tok = self.tokenize.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_token_id = 0 if pad is None else pad
        if max_tiles_per_batch is not None:
            if max_tiles_per_batch < batch_size:
                raise ValueError(
                    f"max_tiles_per_batch ({max_tiles_per_batch}) must be at least "
                    f"batch_size ({batch_size})"
                )
            share = max_tiles_per_batch // batch_size  # per pack: no batch can pass the budget
            max_tiles_per_pack = min(share, max_tiles_per_pack or share)
        self.max_tiles_per_pack = max_tiles_per_pack
        self.pack = Pack(
            max_length,
            max_tiles_per_pack=max_tiles_per_pack,
            window=pack_window,
            truncate=truncate,
            image_token_id=self.tokenize.image_token_id,
            tokens_per_tile=tokens_per_tile,
            stats=self._skips,
        )
        self.balance = BalanceBatches(batch_size)
        self.pipeline = wds.DataPipeline(
            self.plan,
            ReadSamples(storage_options, stats=self._skips),
            Shuffle(shuffle_buffer, shuffle_bytes, seed),
            self.tokenize,
            self.pack,
            self.balance,
            wds.map(
                Collate(
                    max_length,
                    batch_size,
                    self.pad_token_id,
                    image_config=self.image_config,
                    stats=self._skips,
                )
            ),
            _WithStats(self._skips, self.pack, self.balance),
        )
        self.dataloader_options = {
            "batch_size": None,
            "num_workers": num_workers,
            "pin_memory": pin_memory,
            "persistent_workers": persistent_workers and num_workers > 0,
        }
        if num_workers:
            self.dataloader_options["prefetch_factor"] = prefetch_factor or 2
        self._worker_stats: dict = {}
        self._dataloader = None
        self._batches_per_epoch = self._estimate_batches()  # the index does not change
        if self.dataloader_options["persistent_workers"]:
            self.plan.share_epoch()

    @property
    def tokenizer(self):
        """The tokenizer in use (a copy with the image token added, if it lacked one)."""
        return self.tokenize.tokenizer

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows."""
        self.plan.epoch = epoch

    def __len__(self) -> int:
        """Batches per epoch on this rank: an estimate from the index (image tokens exact,
        text tokens from the character counts at 3.5 characters a token, packing at 99%
        fill). Exact equal steps on every rank come with the DDP work."""
        return self._batches_per_epoch

    def _estimate_batches(self) -> int:
        tokens = 0
        per_tile = self.tokenize.tokens_per_tile
        for shard in self.plan.index["shards"]:
            for entry in shard["entries"]:
                tiles = sum(tile_count(w, h, self.image_config) for w, h in entry.get("images", []))
                tokens += (
                    tiles * per_tile
                    + sum(entry.get("chars", [])) / 3.5
                    + 10 * len(entry.get("chars", []))
                )
        packs = tokens / (self.max_length * 0.99) / self.worker_config.world_size
        return max(1, math.ceil(packs / self.batch_size))

    def __iter__(self) -> Iterator[dict]:
        from torch.utils.data import DataLoader

        self._worker_stats = {}
        if self._dataloader is None:  # one DataLoader, so that persistent workers persist
            self._dataloader = DataLoader(self.pipeline, **self.dataloader_options)
        for batch in self._dataloader:
            report = batch.pop(_STATS_KEY)
            self._worker_stats[report.pop("worker")] = report
            yield batch

    def stats(self) -> dict:
        """Fill ratio, samples and tiles per pack, tiles-per-batch spread, drops and skipped
        samples (counts, and up to 10 ``"SHARD/KEY"`` per reason and worker) of this rank for
        the epoch so far, all workers together."""
        skips = SkipStats()
        tokens = capacity = packs = samples = truncated = batches = tiles = squares = 0
        pack_tiles = 0
        dropped: dict = {}
        for report in self._worker_stats.values():
            skips.merge(report["skips"])
            tokens += report["tokens"]
            capacity += report["capacity"]
            packing = report["packing"]
            packs += packing["packs"]
            samples += packing["samples"]
            pack_tiles += packing["tiles_per_pack"] * packing["packs"]
            truncated += packing["truncated"]
            full_batches, batch_tiles, batch_squares = report["batch_tiles"]
            batches += full_batches
            tiles += batch_tiles
            squares += batch_squares
            for reason, n in packing["dropped"].items():
                dropped[reason] = dropped.get(reason, 0) + n
        return {
            "fill": tokens / capacity if capacity else 0.0,
            "packs": packs,
            "samples": samples,
            "samples_per_pack": samples / packs if packs else 0.0,
            "tiles_per_pack": pack_tiles / packs if packs else 0.0,
            "tiles_per_batch_cv": tiles_cv(batches, tiles, squares),
            "truncated": truncated,
            "dropped": dropped,
            "skipped": dict(skips.counts),
            "skipped_examples": {k: list(v) for k, v in skips.examples.items()},
        }
