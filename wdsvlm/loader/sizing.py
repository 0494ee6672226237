"""Epoch sizing: how many batches a pass packs into, the same number on every rank.

``len(loader)`` must be known before anything is read, on every rank alike, or DDP hangs
when one rank runs out of batches first. It is estimated from the sources' indexes (image
tokens and tiles exactly, from the image sizes; text tokens from the characters, at the
characters per token measured on a few samples). It is a function of the index and the
settings alone, worked out alike on every rank with no collective call (a Loader may be built
on some ranks only: an evaluation loader on rank 0): the same shards are measured on every
rank, whatever its rank. A fault that every rank meets alike (a missing or malformed sidecar,
an unreadable sample) leaves the same part out everywhere; a read that gave up on transient
faults, which another rank may not have met, is an error instead of a silently different length.
Weights by tokens take each source's supervised tokens per sample from here too, measured the
same way (``supervised_per_sample``).
"""

from __future__ import annotations

import logging
import math
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import ShardFormatError, StorageError
from ..format.images import UnusableImage
from ..pipeline.order import span
from ..pipeline.packer import Packer
from ..pipeline.plan import Plan, WorkerConfig
from ..pipeline.read import ReadSamples
from ..pipeline.stats import SkipStats
from ..pipeline.token_weights import MEASURED_SHARDS, spread_shards, supervised_estimate
from ..pipeline.tokenize import IGNORE_INDEX
from ..storage.fs import is_transient

log = logging.getLogger("wdsvlm.sizing")


def met_alike(error: Exception) -> bool:
    """Whether every rank meets ``error`` too when it reads the same thing: a malformed or
    missing file, refused access. Not so a read given up after transient faults (timeouts,
    resets, throttling), which may have gone through on another rank."""
    if isinstance(error, ShardFormatError):
        return True
    cause = error.__cause__
    return cause is None or not is_transient(cause)


def unequal_estimate(what: str, error: Exception) -> StorageError:
    """The error for a read fault that another rank may not have met: left out of the
    estimate on this rank only, it would make this rank's epochs another length."""
    return StorageError(
        f"len(loader) cannot be estimated: {what} could not be read ({error}); a rank that "
        "read it would count another epoch length, and DDP would hang at the end of an "
        "epoch. Try again, or pass batches_per_epoch="
    )


def estimate_batches(
    plan: Plan, tokenize: Any, pack: Any, settings: Any, worker_config: WorkerConfig
) -> int:
    """Batches of one pass per rank, from the index alone plus a few samples: image tokens
    and tiles are exact (index sizes), text tokens are the characters scaled by the
    characters per token measured on up to 32 samples spread over the sources (the same ones
    on every rank), each sample counted as often as a pass holds it, samples that cannot fit
    are left out, packs are taken as 97% full of tokens and of tiles, and each worker gets one
    batch more for the packs left at the end of a pass. A source of more than
    ``MEASURED_SHARDS`` shards is measured on that many, spread evenly, and scaled to its
    size (its other sidecars are not read). Every rank computes the same number, with no
    collective call."""
    tokens = tiles = 0.0
    for times, n_tokens, n_tiles in sample_numbers(plan, tokenize, pack, settings):
        tokens += n_tokens * times
        tiles += n_tiles * times
    max_length, tile_budget = settings.max_length, pack.max_tiles_per_pack or 0
    packs = tokens / (max_length * 0.97)
    if tile_budget:
        packs = max(packs, tiles / (tile_budget * 0.97))
    batches = math.ceil(packs / worker_config.world_size / settings.batch_size)
    # and one batch per worker for the few packs each leaves at the end of a pass
    return batches + worker_config.workers_per_rank


def sample_numbers(plan: Plan, tokenize: Any, pack: Any, settings: Any) -> list[tuple]:
    """``(times a pass holds it, tokens, vision units)`` of each sample of the measured shards
    that packing takes (``estimate_batches`` says how they are estimated)."""
    every = [  # (times a pass holds it, source, shard, entry) of the measured shards
        (source.per_pass / source.size * scale, source, s, entry)
        for source in plan.sources
        for s, scale, entries in measured_shards(source)
        for entry in entries
    ]
    chosen = every[:: max(1, len(every) // 32)]
    per_text_token = characters_per_token(chosen, tokenize, settings)
    out = []
    for times, _, _, entry in every:  # each sample as often as a pass holds it
        if entry.get("kind"):  # a document or caption: each of its pieces
            pieces = tokenize.documents.estimated(entry, per_text_token)
            out += [(times, tokens, units) for tokens, units in pieces]
            continue
        packed = packed_numbers(entry, tokenize, pack, settings, per_text_token)
        if packed is not None:
            out.append((times, *packed[:2]))
    return out


def packed_numbers(
    entry: dict, tokenize: Any, pack: Any, settings: Any, per_text_token: float
) -> tuple[float, int, float] | None:
    """``(tokens, vision units, share of its tokens kept)`` a sample is packed with, estimated
    from its index ``entry`` (text at ``per_text_token`` characters a token; a truncated
    sample as 3/4 of a row), or None where it is skipped or dropped."""
    try:
        images = tokenize.image_numbers(entry.get("images", []))
    except UnusableImage:
        return None  # skipped when it is read: an image the family refuses
    videos = tokenize.video_numbers(entry.get("videos", []))
    if videos is None:
        return None  # skipped when it is read: a video the family cannot take
    images += videos
    n_tiles = sum(units for units, _ in images)
    n_tokens = sum(t for _, t in images) + sum(entry.get("chars", [])) / per_text_token
    tile_budget, max_length = pack.max_tiles_per_pack or 0, settings.max_length
    if tile_budget and n_tiles > tile_budget:
        return None  # dropped: more tiles than a pack holds
    if n_tokens > max_length:
        if not pack.truncate:
            return None  # dropped
        return max_length * 0.75, n_tiles, max_length * 0.75 / n_tokens
    return n_tokens, n_tiles, 1.0


# Samples of each source read and tokenized to calibrate its supervised tokens per sample.
CALIBRATION_SAMPLES = 32


def supervised_per_sample(sources: list, tokenize: Any, pack: Any, settings: Any) -> list[float]:
    """Each source's mean supervised tokens per sample as its batches will hold them, for
    weights by tokens (``pipeline/token_weights.py``): the index's estimate of every entry of
    the measured shards (a conversation that packing drops counts 0, one it truncates 3/4 of
    a row's worth; a document is cut into pieces, all kept), times the source's calibration:
    the supervised tokens (labels not ignored; a document's pieces together) of up to
    ``CALIBRATION_SAMPLES`` of those samples, spread evenly, read and tokenized, over their
    estimate. The same samples on every rank: the same numbers, with no collective call."""
    out = []
    for source in sources:
        entries = [(s, e) for s, _, part in measured_shards(source) for e in part]
        step = max(1, len(entries) // CALIBRATION_SAMPLES)
        chosen = [(1, source, s, e) for s, e in entries[::step][:CALIBRATION_SAMPLES]]
        samples = encoded(chosen, tokenize, settings)
        labelled: dict[tuple, int] = {}  # by sample: a document's pieces are samples too
        for sample in samples:
            key = (sample["__shard__"], sample["__key__"])
            supervised = int((sample["labels"] != IGNORE_INDEX).sum())
            labelled[key] = labelled.get(key, 0) + supervised
        metas = {(s["__shard__"], s["__key__"]): s["__meta__"] for s in samples}
        estimated = sum(supervised_estimate(meta) for meta in metas.values())
        if not estimated:
            log.warning("%s: no sample read to calibrate its supervised tokens", source.name)
        calibration = sum(labelled.values()) / estimated if estimated else 1.0
        per_text_token = chars_per_token_of(samples, tokenize)
        total = 0.0
        for _, entry in entries:
            if entry.get("kind", 0):  # a document or caption: cut into pieces, never dropped
                total += supervised_estimate(entry)
                continue
            packed = packed_numbers(entry, tokenize, pack, settings, per_text_token)
            if packed is not None:  # dropped: 0
                total += supervised_estimate(entry) * packed[2]
        out.append(calibration * total / max(1, len(entries)))
    return out


# A weight schedule's clock packs about this many samples: shares of a worker's pass.
SIMULATED_SAMPLES = 4096


def pass_batches(
    plan: Plan, tokenize: Any, pack: Any, settings: Any, worker_config: WorkerConfig
) -> float:
    """Batches of a rank that one pass packs into, as a mean rather than a bound: a weight
    schedule's clock (``pipeline/schedule.py``), which the passes drift from by its error
    every pass. A worker's share of a pass is packed as the stream packs it: the estimated
    numbers of samples drawn from the measured shards as often as a pass holds them, in a
    seeded order (the same on every rank), by the Packer with the Loader's window, drained at
    the end; the rank's workers make as many packs each, ``batch_size`` to a batch. Shares
    are packed until about ``SIMULATED_SAMPLES`` samples are, and their packs averaged; a
    larger share is packed in part, its packs before the drain scaled to the whole share."""
    numbers = sample_numbers(plan, tokenize, pack, settings)
    if not numbers:
        return estimate_batches(plan, tokenize, pack, settings, worker_config)
    share = plan.num_samples / worker_config.global_workers
    size = max(1, min(SIMULATED_SAMPLES, round(share)))
    weights = [t for t, _, _ in numbers]
    rng = random.Random(0)
    packs = []
    for _ in range(max(1, SIMULATED_SAMPLES // size)):
        packer = Packer(settings.max_length, pack.max_tiles_per_pack, pack.window)
        made = 0
        for _, tokens, units in rng.choices(numbers, weights=weights, k=size):
            made += len(packer.push(None, max(1, round(tokens)), units))
        waiting = len(packer.waiting)
        drained = len(list(packer.drain()))
        if size > waiting:  # the packs made before the drain, scaled to the share
            packs.append(made * max(0.0, share - waiting) / (size - waiting) + drained)
        else:
            packs.append(drained * share / size)
    return sum(packs) / len(packs) * worker_config.workers_per_rank / settings.batch_size


def measured_shards(source: Any) -> list[tuple[int, float, list]]:
    """``(shard number, scale, its entries)`` of the shards that stand for the source in the
    estimate: all of them (scale 1), or ``MEASURED_SHARDS`` spread evenly over the index's
    shard list (``token_weights.spread_shards``: the same ones on every rank), scaled up to the
    source's sample count. A shard whose sidecar is missing or malformed is left out (reading
    it will count its samples as skipped, or fail, as ``on_shard_error`` says); one that could
    not be read for transient faults is an error (``met_alike``)."""
    shards = source.index["shards"]
    readable = []
    for s in spread_shards(len(shards), MEASURED_SHARDS):
        try:
            readable.append((s, list(shards[s]["entries"])))
        except (ShardFormatError, StorageError) as e:
            if not met_alike(e):
                raise unequal_estimate(f"the sidecar of shard {shards[s]['name']}", e) from e
            log.warning("len(loader) is estimated without shard %s: %s", shards[s]["name"], e)
    held = sum(len(entries) for _, entries in readable)
    scale = source.size / held if held else 0.0
    return [(s, scale, entries) for s, entries in readable]


def characters_per_token(chosen: list[tuple], tokenize: Any, settings: Any) -> float:
    """Characters of text (the index's ``chars``) per text token, template included,
    measured on the ``(times, source, shard number, entry)`` of ``chosen``; 3.5 when none of
    them can be read (``encoded``)."""
    return chars_per_token_of(encoded(chosen, tokenize, settings), tokenize)


def chars_per_token_of(samples: list[dict], tokenize: Any) -> float:
    """Characters of text per text token of tokenized ``samples``; 3.5 without any."""
    chars = text = 0
    for sample in samples:
        sizes = sample["__meta__"].get("images", [])
        videos = tokenize.video_numbers(sample["__meta__"].get("videos", [])) or []
        image_tokens = sum(tokens for _, tokens in tokenize.image_numbers(sizes) + videos)
        chars += sum(sample["__meta__"].get("chars", []))
        text += sample["num_tokens"] - image_tokens
    return chars / text if chars and text else 3.5


def encoded(chosen: list[tuple], tokenize: Any, settings: Any) -> list[dict]:
    """The ``(times, source, shard number, entry)`` of ``chosen`` read and tokenized. A sample
    that cannot be read is left out if every rank fails on it alike (``met_alike``)."""
    spans = [
        span(
            source.urls[s],
            source.index["shards"][s]["name"],
            [entry],
            storage_options=source.storage_options,
            layout=source.index.get("layout"),
        )
        for _, source, s, entry in chosen
    ]
    quiet = SkipStats()  # a bad sample here is found again, and counted, when it is read
    read = ReadSamples(
        settings.storage_options, stats=quiet, policy=settings.read_policy, read_ahead=0
    )

    def samples_of(one: dict) -> list[dict]:
        try:
            return list(read(iter([one])))
        except StorageError as e:
            if not met_alike(e):
                raise unequal_estimate(f"a sample of {one['url']}", e) from e
            return []

    with ThreadPoolExecutor(8) as pool:  # small reads: at once, not one round trip each
        samples = [s for part in pool.map(samples_of, spans) for s in part]
    return list(tokenize.encode(samples, stats=quiet))
