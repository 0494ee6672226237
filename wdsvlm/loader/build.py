"""How a Loader's parts are made from its settings: the plan, the pipeline stages and the
worker stream over them, the DataLoader's options, the epoch length and the config a saved
state must agree with."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ..families.base import Family
from ..families.registry import family_of
from ..families.tiling import ImageConfig, TilingFamily
from ..pipeline.collate import Collate
from ..pipeline.order import caps_chunks
from ..pipeline.pack import BalanceBatches, Pack
from ..pipeline.plan import Plan, WorkerConfig
from ..pipeline.read import ReadSamples
from ..pipeline.shuffle import Shuffle
from ..pipeline.sources import resolve_sources
from ..pipeline.stats import SkipStats
from ..pipeline.tokenize import Tokenize
from ..pipeline.usermap import ImageMap, SampleMap, check_workers_get
from ..storage.cache import ShardCache
from ..storage.folders import node_folder
from ..storage.fs import ReadPolicy
from ..storage.governor import stagger_start
from .fingerprint import dataset_facts
from .placement import LOCAL
from .settings import LoaderSettings, resume_config
from .sizing import estimate_batches, pass_batches, supervised_per_sample
from .stream import Stream
from .workers import (
    check_context,
    check_main_guarded,
    exit_with_training_process,
    worker_context,
)


@dataclass
class LoaderParts:
    """What a Loader is made of."""

    family: Family
    """The model family of ``processor=``, else the default tiling (``TilingFamily``)."""
    worker_config: WorkerConfig
    plan: Plan
    tokenize: Tokenize
    stream: Stream
    """The dataset the DataLoader runs: every stage, in each worker."""
    dataloader_options: dict[str, Any]
    pad_token_id: int
    batches_per_epoch: int
    config: dict[str, Any]
    """What a saved state must agree with to resume exactly (``settings.resume_config``)."""


def build(source: Any, tokenizer: Any, settings: LoaderSettings) -> LoaderParts:
    """The parts of a Loader over ``source`` (see ``Loader``) with ``settings``."""
    if (tokenizer is None) == (settings.processor is None):
        both = ", not both" if tokenizer is not None else ""
        raise TypeError(
            "Loader needs a tokenizer (the default tiling) or processor= (a model "
            f"family's Hugging Face processor){both}"
        )
    settings = on_this_node(settings)
    worker_config = topology(settings)
    image_config = ImageConfig(settings.tile_size, settings.max_image_side, settings.upscale)
    family = (  # a processor's family, else the default tiling with the tokenizer
        family_of(settings.processor)
        if settings.processor is not None
        else TilingFamily(
            image_config,
            tokenizer,
            tokens_per_tile=settings.tokens_per_tile,
            image_token=settings.image_token,
        )
    )
    skips = SkipStats(settings.max_consecutive_failures)
    tokenize = Tokenize(
        family=family,
        chat_template=settings.chat_template,
        stats=skips,
        sample_map=user_step(SampleMap, settings.map, settings),
        max_length=settings.max_length,  # a document's pieces fit a pack
        max_units=settings.tiles_per_pack,
    )
    pad_token_id = pad_of(tokenize.tokenizer)
    pack = Pack(
        settings.max_length,
        max_tiles_per_pack=settings.tiles_per_pack,
        window=settings.pack_window,
        truncate=settings.truncate,
        unit=family.unit_name,
    )
    plan = plan_of(source, tokenize, pack, settings, worker_config)
    if plan.num_samples < worker_config.global_workers and not settings.evaluation:
        raise ValueError(
            f"{source}: {plan.num_samples} samples for {worker_config.global_workers} global "
            f"workers (world_size {worker_config.world_size} x num_workers "
            f"{settings.num_workers}); every worker needs at least one sample a pass: use "
            "fewer workers"
        )
    # made before sizing the epoch, once the plan holds: a fork server starts now, in the
    # background
    options = dataloader_options(settings, tokenize.tokenizer, family)
    batches = epoch_batches(plan, tokenize, pack, settings, worker_config)
    if plan.schedule is not None:
        time_schedule(plan, tokenize, pack, settings, worker_config)
    stream = Stream(
        plan,
        reader(settings, skips),
        Shuffle(
            shuffle_buffer(plan, settings),
            settings.shuffle_bytes,
            settings.seed,
            by_tokens=by_tokens(plan),  # each source's tokens leave as evenly as they came
        ),
        tokenize,
        pack,
        BalanceBatches(settings.batch_size),
        Collate(
            settings.max_length,
            settings.batch_size,
            pad_token_id,
            family=family,
            stats=skips,
            image_map=user_step(ImageMap, settings.image_map, settings),
            sources=plan.mixture,  # sample_sources in every batch, its empty rows' too
            max_video_pixels=settings.max_video_pixels,
            video_threads=settings.video_threads,
        ),
        skips,
        batches,
    )
    config = resume_config(
        settings,
        max_tiles_per_pack=settings.tiles_per_pack,
        shuffle_buffer=shuffle_buffer(plan, settings),
        # None where it leaves every chunk as it was: a state saved before the cap resumes
        span_samples=settings.span_samples
        if plan.version >= 3
        or caps_chunks(plan.sources, settings.span_bytes, settings.span_samples)
        else None,
        image_token=tokenize.image_token,
        chat_template=tokenize.chat_template,
        **dataset_facts(plan),  # O(1) on shard tables: their digests
        schedule=None if plan.schedule is None else plan.schedule.spec(),
        weight_by="tokens" if by_tokens(plan) else "samples",
        supervised_per_sample=[s.supervised_per_sample for s in plan.sources]
        if by_tokens(plan)
        else None,
        tokenizer=tokenize.fingerprint(videos=has_videos(plan), documents=has_documents(plan)),
        batches_per_epoch=batches,
    )
    if plan.schedule is not None:  # adopted from the saved run by a resume
        config["schedule_clock"] = plan.schedule.clock
    return LoaderParts(
        family, worker_config, plan, tokenize, stream, options, pad_token_id, batches, config
    )


def on_this_node(settings: LoaderSettings) -> LoaderSettings:
    """The settings with their read policy's ``node_dir`` filled in (``local_dir``, else
    ``cache_dir/node``, else a temporary folder: ``storage.folders.node_folder``) and its
    ``node_bytes`` (``local_bytes``), where the policy leaves them open: every process of the
    Loader (DataLoader workers, Ray actors) gets the policy pickled, so all of a node's use the
    same folder, the shard table's copy there and the sidecars' copies."""
    policy = settings.read_policy or ReadPolicy()
    filled = {}
    if policy.node_dir is None:
        filled["node_dir"] = node_folder(settings.local_dir, settings.cache_dir, make=False)
    if policy.node_bytes is None:
        filled["node_bytes"] = settings.local_bytes
    if not filled:
        return settings
    return replace(settings, read_policy=replace(policy, **filled))


def plan_of(
    source: Any, tokenize: Tokenize, pack: Pack, settings: LoaderSettings, config: WorkerConfig
) -> Plan:
    """The plan of the Loader's sources; with weights by tokens, each source's weight over its
    supervised tokens per sample as the tokenizer makes them (``sizing.supervised_per_sample``,
    the same on every rank)."""
    stagger_start(config.rank, config.world_size)  # a large job's ranks: not all at once
    sources, mixture, schedule = resolve_sources(
        source,
        settings.storage_options,
        settings.read_policy,
        settings.samples_per_pass,
        # an evaluation loader reads every sample once: its weights are set aside
        weight_by="samples" if settings.evaluation else settings.weight_by,
        supervised=lambda resolved: supervised_per_sample(resolved, tokenize, pack, settings),
    )
    return Plan(
        sources,
        seed=settings.seed,
        worker_config=config,
        span_bytes=settings.span_bytes,
        span_samples=settings.span_samples,
        evaluation=settings.evaluation,
        version=settings.plan_version,
        mixture=mixture,
        schedule=schedule,
    )


def by_tokens(plan: Plan) -> bool:
    """Whether the plan's weights are shares of the supervised tokens."""
    return plan.sources[0].supervised_per_sample is not None


# The shuffle buffer by default: 1000 samples, or as many as the bytes of 1000 samples of 60 KB
# hold of smaller ones (text), up to SHUFFLE_MOST.
SHUFFLE_SAMPLES, SHUFFLE_TARGET_BYTES, SHUFFLE_MOST = 1000, 1000 * 60_000, 8192


def shuffle_buffer(plan: Plan, settings: LoaderSettings) -> int:
    """``shuffle_buffer``, else its default for the plan's data: a buffer of 1000 samples holds
    about ``1000 / m`` chunks of ``m`` samples, and about ``m / 2000`` of the consecutive
    samples leaving it come from one chunk; small samples make many to a chunk, so the buffer
    holds more of them, within the bytes that 1000 samples of 60 KB take."""
    if settings.evaluation:  # the indexes' order: a buffer of one hands each sample on
        return 1
    if settings.shuffle_buffer is not None:
        return settings.shuffle_buffer
    total = sum(s.per_pass * s.bytes / max(1, s.size) for s in plan.sources)
    mean = total / max(1, plan.num_samples)
    return int(max(SHUFFLE_SAMPLES, min(SHUFFLE_MOST, SHUFFLE_TARGET_BYTES // max(1, mean))))


def has_videos(plan: Plan) -> bool:
    """Whether the index of any of the plan's sources counts videos."""
    return any(source.index.get("totals", {}).get("videos") for source in plan.sources)


def has_documents(plan: Plan) -> bool:
    """Whether the index of any of the plan's sources counts documents or captions."""
    totals = [source.index.get("totals", {}) for source in plan.sources]
    return any(t.get("documents") or t.get("captions") for t in totals)


def topology(settings: LoaderSettings) -> WorkerConfig:
    """Rank and world size as given, else from ``torch.distributed`` or torchrun's
    environment; ``num_workers`` DataLoader workers each."""
    environment = WorkerConfig.from_environment(settings.num_workers)
    return WorkerConfig(
        environment.rank if settings.rank is None else settings.rank,
        environment.world_size if settings.world_size is None else settings.world_size,
        settings.num_workers,
    )


def dataloader_options(settings: LoaderSettings, tokenizer: Any, family: Family) -> dict[str, Any]:
    """The torch DataLoader's keyword arguments. With workers, their start method is checked
    (and a fork server started, preloading the tokenizer's and the family's modules)."""
    num_workers = settings.num_workers
    options: dict[str, Any] = {
        "batch_size": None,
        "num_workers": num_workers,
        "pin_memory": settings.pin_memory,
        "persistent_workers": settings.persistent_workers
        and num_workers > 0
        and settings.workers == LOCAL,
    }
    if num_workers and settings.workers == LOCAL:  # Ray workers start no process here
        context = check_context(settings.multiprocessing_context)
        check_main_guarded(context)  # before a fork server starts, not in each worker
        options["prefetch_factor"] = settings.prefetch_factor or 2
        # a worker started by the fork server ends when the training process does
        options["worker_init_fn"] = exit_with_training_process
        preload = [type(tokenizer).__module__, *family.modules]
        options["multiprocessing_context"] = worker_context(context, tuple(preload))
    return options


def pad_of(tokenizer: Any) -> int:
    """The token the rows are padded with: the pad token, else end of sequence, else 0."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return 0 if pad is None else pad


# A weight schedule's passes are about this many batches of a rank long, unless
# samples_per_pass is given: each pass holds the mean shares of its batches.
SCHEDULE_PASS_BATCHES = 50


def time_schedule(
    plan: Plan, tokenize: Tokenize, pack: Pack, settings: LoaderSettings, config: WorkerConfig
) -> None:
    """A weight schedule's passes (``pipeline/schedule.py``): ``samples_per_pass``, else
    about ``SCHEDULE_PASS_BATCHES`` batches' worth of the sources' samples (from the estimate
    of a pass over all of them); then the batches one such pass packs into (a mean, worked out
    alike on every rank: ``sizing.pass_batches``) is the clock that places each pass on the
    schedule."""
    per_pass = plan.schedule.samples_per_pass if plan.schedule.given else None
    if per_pass is None:
        total = sum(s.size for s in plan.sources)
        whole = estimate_batches(plan, tokenize, pack, settings, config)
        per_pass = min(total, -(-total * SCHEDULE_PASS_BATCHES // max(1, whole)))
    plan.time_passes(max(per_pass, config.global_workers), 1)
    plan.time_passes(plan.num_samples, pass_batches(plan, tokenize, pack, settings, config))


def reader(settings: LoaderSettings, stats: SkipStats) -> ReadSamples:
    """The read stage with the settings' storage options, read policy, read-ahead, shard
    errors and shard cache, counting what it skips in ``stats``."""
    return ReadSamples(
        settings.storage_options,
        stats=stats,
        policy=settings.read_policy,
        read_ahead=settings.read_ahead,
        on_shard_error=settings.on_shard_error,
        cache=ShardCache(settings.cache_dir, settings.cache_bytes) if settings.cache_dir else None,
    )


def epoch_batches(
    plan: Plan, tokenize: Tokenize, pack: Pack, settings: LoaderSettings, config: WorkerConfig
) -> int:
    """``len(loader)``: ``batches_per_epoch``, or the estimate of one pass, computed alike on
    every rank from the index and the settings (no collective call); 0 for an evaluation
    loader, whose length is counted when first needed (``Loader``); a multiple of the
    workers, so that each gives the same number of batches an epoch and none falls behind the
    others epoch after epoch."""
    workers = config.workers_per_rank
    if settings.evaluation:  # counted at the first len() or iteration (loader/evaluation.py)
        return 0
    estimate = settings.batches_per_epoch or estimate_batches(
        plan, tokenize, pack, settings, config
    )
    return -(-estimate // workers) * workers


def user_step(kind: type, fn: Any, settings: LoaderSettings) -> Any:
    """The user's ``map`` or ``image_map`` as its stage step, checked that DataLoader
    workers can get it (Ray's get it by value)."""
    if fn is None:
        return None
    if settings.num_workers and settings.workers == LOCAL:
        check_workers_get(fn, kind.kind, check_context(settings.multiprocessing_context))
    return kind(fn, settings.seed, settings.map_errors)
