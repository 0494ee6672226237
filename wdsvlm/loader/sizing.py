"""Epoch sizing: how many batches a pass packs into, the same number on every rank.

``len(loader)`` must be known before anything is read, on every rank alike, or DDP hangs
when one rank runs out of batches first. It is estimated from the sources' indexes (image
tokens and tiles exactly, from the image sizes; text tokens from the characters, at the
characters per token measured on a few samples) and agreed once through the process group.
"""

from __future__ import annotations

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import ShardFormatError, StorageError
from ..pipeline.images import UnusableImage
from ..pipeline.plan import Plan, WorkerConfig, span
from ..pipeline.read import ReadSamples
from ..pipeline.stats import SkipStats

log = logging.getLogger("wdsvlm.sizing")


def agreed(value: int) -> int:
    """Rank 0's ``value`` on every rank when a process group is up (one broadcast at set-up):
    the batches of an epoch must be the same number everywhere, even if one rank's estimate
    met a read fault."""
    try:
        import torch.distributed as dist
    except ImportError:
        return value
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


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
    size (its other sidecars are not read). Every rank computes the same number."""
    every = [  # (times a pass holds it, source, shard, entry) of the measured shards
        (source.per_pass / source.size * scale, source, s, entry)
        for source in plan.sources
        for s, scale, entries in measured_shards(source)
        for entry in entries
    ]
    chosen = every[:: max(1, len(every) // 32)]
    per_text_token = characters_per_token(chosen, tokenize, settings)
    tile_budget = pack.max_tiles_per_pack or 0
    max_length = settings.max_length
    tokens = tiles = 0.0
    for times, _, _, entry in every:  # each sample as often as a pass holds it
        try:
            images = [tokenize.image_numbers(w, h) for w, h in entry.get("images", [])]
        except UnusableImage:
            continue  # skipped when it is read: an image the family refuses
        n_tiles = sum(units for units, _ in images)
        n_tokens = sum(t for _, t in images) + sum(entry.get("chars", [])) / per_text_token
        if tile_budget and n_tiles > tile_budget:
            continue  # dropped: more tiles than a pack holds
        if n_tokens > max_length:
            if not pack.truncate:
                continue  # dropped
            n_tokens = max_length * 0.75
        tokens += n_tokens * times
        tiles += n_tiles * times
    packs = tokens / (max_length * 0.97)
    if tile_budget:
        packs = max(packs, tiles / (tile_budget * 0.97))
    batches = math.ceil(packs / worker_config.world_size / settings.batch_size)
    # and one batch per worker for the few packs each leaves at the end of a pass
    return batches + worker_config.workers_per_rank


MEASURED_SHARDS = 64


def measured_shards(source: Any) -> list[tuple[int, float, list]]:
    """``(shard number, scale, its entries)`` of the shards that stand for the source in the
    estimate: all of them (scale 1), or ``MEASURED_SHARDS`` spread evenly, scaled up to the
    source's sample count. A shard whose sidecar cannot be read is left out (reading it will
    count its samples as skipped, or fail, as ``on_shard_error`` says)."""
    shards = source.index["shards"]
    if len(shards) <= MEASURED_SHARDS:
        picked = list(range(len(shards)))
    else:
        step = len(shards) / MEASURED_SHARDS
        picked = sorted({int(i * step) for i in range(MEASURED_SHARDS)})
    readable = []
    for s in picked:
        try:
            readable.append((s, list(shards[s]["entries"])))
        except (ShardFormatError, StorageError) as e:
            log.warning("len(loader) is estimated without shard %s: %s", shards[s]["name"], e)
    held = sum(len(entries) for _, entries in readable)
    scale = source.size / held if held else 0.0
    return [(s, scale, entries) for s, entries in readable]


def characters_per_token(chosen: list[tuple], tokenize: Any, settings: Any) -> float:
    """Characters of text (the index's ``chars``) per text token, template included,
    measured on the ``(times, source, shard number, entry)`` of ``chosen``; 3.5 when none of
    them can be read."""
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
        settings.storage_options, stats=quiet, policy=settings.read_policy, on_shard_error="skip"
    )
    with ThreadPoolExecutor(8) as pool:  # small reads: at once, not one round trip each
        parts = pool.map(lambda part: list(read(iter(part))), [spans[i::8] for i in range(8)])
        samples = [s for part in parts for s in part]
    chars = text = 0
    for sample in tokenize.encode(samples, stats=quiet):
        sizes = sample["__meta__"].get("images", [])
        image_tokens = sum(tokenize.image_numbers(w, h)[1] for w, h in sizes)
        chars += sum(sample["__meta__"].get("chars", []))
        text += sample["num_tokens"] - image_tokens
    return chars / text if chars and text else 3.5
