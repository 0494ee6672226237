"""Every setting of a Loader in one frozen, validated object, and the resume check derived
from it.

A field marked ``shapes_batches`` decides which batches come: a saved loader state resumes
only with the same value, and a difference is refused naming the field. Adding a setting
means adding a field here, and saying whether it shapes batches; the resume check follows by
itself, so it cannot be forgotten.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..format.containers import MAX_VIDEO_PIXELS, VIDEO_THREADS
from ..pipeline.order import SPAN_BYTES, SPAN_SAMPLES
from ..pipeline.plan import PLAN_VERSION, check_version
from ..pipeline.token_weights import check_weight_by
from ..storage.fs import ReadPolicy
from ..storage.node import LOCAL_BYTES
from .placement import LOCAL, check_workers
from .telemetry import telemetry_of
from .workers import check_context

log = logging.getLogger("wdsvlm.settings")

STATE_VERSION = 3


def _shapes(default: Any) -> Any:
    """A field whose value decides which batches come (checked on resume)."""
    return field(default=default, metadata={"shapes_batches": True})


@dataclass(frozen=True)
class LoaderSettings:
    """The Loader's settings: its keyword arguments, with their defaults."""

    max_length: int = _shapes(2048)
    """Tokens per packed row."""
    batch_size: int = _shapes(8)
    """Packed rows per batch."""
    num_workers: int = 0
    """Workers per rank (part of the topology, checked on resume apart)."""
    workers: Any = field(default=LOCAL, hash=False)
    """Where the workers run: ``"local"`` (DataLoader processes on this node) or
    ``wdsvlm.RayWorkers(...)`` (Ray actors); the same batches either way."""
    seed: int = _shapes(0)
    """Seeds the order of every pass and the shuffle buffer."""
    shuffle_buffer: int | None = _shapes(None)
    """Samples in the shuffle buffer; None: 1000, more for small samples (text), as many as
    the bytes of 1000 samples of 60 KB hold of the data's mean sample, up to 8192."""
    shuffle_bytes: int = _shapes(256 * 2**20)
    """Bytes the shuffle buffer may hold."""
    span_bytes: int = _shapes(SPAN_BYTES)
    """Bytes of neighbouring samples of a shard read with one ranged read (a chunk of the
    pass's order): smaller mixes better, larger makes fewer requests."""
    span_samples: int | None = _shapes(SPAN_SAMPLES)
    """The most samples a chunk holds (None: as many as ``span_bytes`` holds): small samples,
    such as text, then come from many shards, at a few more requests."""
    plan_version: int = _shapes(PLAN_VERSION)
    """The order of a pass: 3 (a worker plans its own share alone, in memory that does not grow
    with the dataset) or 2 (the order of wdsvlm before it, to resume a run saved then)."""
    tile_size: int = _shapes(512)
    """Side of an image tile, in pixels."""
    max_image_side: int = _shapes(1024)
    """Images are scaled down to at most this side before tiling."""
    upscale: bool = _shapes(False)
    """Scale small images up to a whole tile."""
    tokens_per_tile: int = _shapes(64)
    """Image tokens per tile."""
    max_tiles_per_pack: int | None = _shapes(None)
    """Tiles a packed row may hold (None: no limit)."""
    max_tiles_per_batch: int | None = _shapes(None)
    """Tiles a batch may hold: each pack gets ``max_tiles_per_batch // batch_size``."""
    pack_window: int = _shapes(500)
    """Samples in the packer's window."""
    truncate: bool = _shapes(False)
    """Cut a too-long sample after its last whole answer that fits, instead of dropping it."""
    evaluation: bool = False
    """An evaluation loader: every sample of every source once an iteration, in the indexes'
    order, no shuffle, no carry-over, the same exact ``len()`` on every rank, the last
    batches of a rank with fewer samples filled with empty rows (``loader/evaluation.py``)."""
    batches_per_epoch: int | None = None
    """``len(loader)``; None: estimated from the index. A resumed run keeps the saved one
    (an elastic resume onto another topology estimates it anew)."""
    samples_per_pass: int | None = None
    """Samples a pass holds when every source of a mixture gives ``weight=`` (None: the
    sources' total; with a weight schedule, about 50 batches' worth). Checked on resume
    through the sources' shares of a pass."""
    weight_by: str | None = None
    """What a mixture's weights are shares of: ``"samples"`` or ``"tokens"`` (the supervised
    tokens; ``pipeline/token_weights.py``); None: the mixture file's, else ``"samples"``.
    Checked on resume as the mixture weighs, this setting's or its file's."""
    image_token: str | None = _shapes(None)
    """The image token; None: the tokenizer's own, else ``<image>``."""
    chat_template: str | None = _shapes(None)
    """A Jinja chat template; None: the tokenizer's own, else ChatML."""
    processor: Any = field(default=None, hash=False, compare=False)
    """A Hugging Face processor (object, or name/path for ``AutoProcessor``) of a supported
    family: its images, tokens and chat template replace the default tiling (checked on
    resume through its fingerprint)."""
    map: Any = field(default=None, hash=False, compare=False)
    """Your own step before tokenization: ``map(sample, rng)`` gets the stored record (its
    ``messages``, ``source``, ...) with ``__key__``, ``__shard__``, ``__images__`` (the image
    bytes) and ``__meta__`` (the index entry), and returns it, its text changed or not, or
    None to drop it (counted as ``filtered``). With workers that start by ``spawn`` or the
    fork server, a function they can import (defined in a module, not a lambda nor in a
    notebook: refused when the Loader is built); ``rng`` is seeded from (seed, pass, place).
    Not checked on resume: resume with the same function."""
    image_map: Any = field(default=None, hash=False, compare=False)
    """Your own step on each decoded image: ``image_map(pixels, rng)`` gets uint8
    ``[height, width, 3]`` (RGB, as displayed, before resizing) and returns the same shape."""
    map_errors: str = "skip"
    """What an exception in ``map`` or ``image_map`` does: ``"skip"`` the sample (counted as
    ``map_error``, with its key and the traceback's last line) or ``"raise"``."""
    storage_options: Mapping[str, Any] | None = field(default=None, hash=False)
    """fsspec options for bucket URLs (never saved in a state: they may hold credentials)."""
    read_policy: ReadPolicy | None = None
    """Block size, retries, backoff and timeout of ranged reads."""
    read_ahead: int = 4
    """Spans each worker reads at once, ahead of their use (0: one at a time, when needed)."""
    on_shard_error: str = "raise"
    """``"raise"``, or ``"skip"``: an unreadable shard's samples are counted as skipped."""
    cache_dir: str | None = None
    """A local folder that keeps whole shards once read."""
    cache_bytes: int = 64 * 2**30
    """Bytes the shard cache may hold."""
    local_dir: str | None = None
    """A folder on this node's own disk for what the node's processes share: the copy of a
    shard table on a store, fetched once per node and mapped by every rank, worker and Ray
    actor of the node. None: the folder ``$WDSVLM_LOCAL_DIR`` names, else ``cache_dir/node``,
    else ``wdsvlm-<uid>`` in the temporary folder (a ``read_policy``'s ``node_dir``, where
    given, wins). The copies of the shards' sidecars on a store go there too."""
    local_bytes: int = LOCAL_BYTES
    """Bytes the node's copies of sidecars may take in ``local_dir`` (the least recently used
    removed first; 0: none kept, each process reads them from the store). A
    ``read_policy``'s ``node_bytes``, where given, wins."""
    pin_memory: bool = False
    prefetch_factor: int | None = None
    """Batches each DataLoader worker prepares ahead (None: 2)."""
    persistent_workers: bool = False
    multiprocessing_context: str | None = None
    """How workers start: None (``forkserver``), ``"forkserver"``, ``"spawn"`` or ``"fork"``."""
    max_video_pixels: int = MAX_VIDEO_PIXELS
    """Frames x width x height a video may have, as its index and its own headers state them:
    a video over it (or whose frame is over Pillow's bound for one image) is skipped before a
    frame is decoded, counted as ``video_too_large``."""
    video_threads: int = VIDEO_THREADS
    """FFmpeg's decode threads for a video, in each worker (0: FFmpeg's own count, one per
    core and one more)."""
    max_consecutive_failures: int = 100
    """Bad samples in a row, in one stage, that stop the run as a systematic fault."""
    rank: int | None = None
    """This process's rank; None: from torch.distributed or torchrun's environment."""
    world_size: int | None = None
    telemetry: Any = field(default=True, hash=False, compare=False)
    """``True``, ``False`` or ``wdsvlm.Telemetry(...)``: data-wait time and each stage's
    seconds for ``metrics()``, advice when steps wait, hangs named, a trace."""

    def __post_init__(self):
        telemetry_of(self.telemetry)  # checked now
        positive = [
            "max_length",
            "batch_size",
            "shuffle_bytes",
            "span_bytes",
            "tile_size",
            "max_image_side",
            "tokens_per_tile",
            "pack_window",
            "cache_bytes",
            "max_consecutive_failures",
            "max_video_pixels",
        ]
        at_least_zero = ["num_workers", "read_ahead", "video_threads", "local_bytes"]
        optional_positive = [
            "shuffle_buffer",
            "span_samples",
            "max_tiles_per_pack",
            "max_tiles_per_batch",
            "batches_per_epoch",
            "samples_per_pass",
            "prefetch_factor",
        ]
        for name in positive + at_least_zero + optional_positive:
            value = getattr(self, name)
            if value is None and name in optional_positive:
                continue
            least = 0 if name in at_least_zero else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(
                    f"{name} must be a whole number of at least {least}, not {value!r}"
                )
        for name in ("map", "image_map"):
            fn = getattr(self, name)
            if fn is not None and not callable(fn):
                raise ValueError(f"{name} must be a function, not {type(fn).__name__}")
        if self.evaluation not in (False, True):
            raise ValueError(f"evaluation must be True or False, not {self.evaluation!r}")
        if self.evaluation and self.batches_per_epoch is not None:
            raise ValueError(
                "batches_per_epoch is set with evaluation=True: an evaluation loader's length "
                "is one whole pass, counted exactly"
            )
        check_version(self.plan_version)
        if self.weight_by is not None:
            check_weight_by(self.weight_by)
        if self.map_errors not in ("skip", "raise"):
            raise ValueError(f'map_errors must be "skip" or "raise", not {self.map_errors!r}')
        if self.max_tiles_per_batch is not None and self.max_tiles_per_batch < self.batch_size:
            raise ValueError(
                f"max_tiles_per_batch ({self.max_tiles_per_batch}) must be at least "
                f"batch_size ({self.batch_size})"
            )
        if self.on_shard_error not in ("raise", "skip"):
            raise ValueError(
                f"on_shard_error must be 'raise' or 'skip', not {self.on_shard_error!r}"
            )
        check_context(self.multiprocessing_context)
        check_workers(self.workers, self.num_workers)
        if self.processor is not None:  # the processor decides these: refuse what is ignored
            tiling = ["image_token", "tile_size", "max_image_side", "upscale", "tokens_per_tile"]
            given = [n for n in tiling if getattr(self, n) != _DEFAULTS[n]]
            if given:
                raise ValueError(
                    f"{', '.join(given)} set together with processor=: the processor decides "
                    "the image sizes and image tokens, so these apply only without it"
                )
        if self.storage_options is not None:  # a copy: a caller's later change cannot leak in
            object.__setattr__(self, "storage_options", dict(self.storage_options))

    @property
    def tiles_per_pack(self) -> int | None:
        """The tile budget of one pack: ``max_tiles_per_pack``, within its share of
        ``max_tiles_per_batch`` (so that no batch can pass it)."""
        if self.max_tiles_per_batch is None:
            return self.max_tiles_per_pack
        share = self.max_tiles_per_batch // self.batch_size
        return min(share, self.max_tiles_per_pack or share)

    def shaping(self) -> dict[str, Any]:
        """The settings that decide which batches come, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if shapes_batches(f.name)}


_DEFAULTS = {f.name: f.default for f in fields(LoaderSettings)}


def shapes_batches(name: str) -> bool:
    return bool(LoaderSettings.__dataclass_fields__[name].metadata.get("shapes_batches"))


def settings_from(options: Mapping[str, Any]) -> LoaderSettings:
    """``LoaderSettings(**options)``, an unknown name refused with the known ones."""
    known = {f.name for f in fields(LoaderSettings)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"Loader got unknown settings {unknown}; the settings are: {', '.join(sorted(known))}"
        )
    return LoaderSettings(**options)


def signature_with_settings(function) -> inspect.Signature:
    """``function``'s signature with ``**settings`` spelled out as the settings' keywords, so
    that ``help()`` and editors show every name and default."""
    signature = inspect.signature(function)
    head = [p for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD]
    settings = [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type
        )
        for f in fields(LoaderSettings)
    ]
    return signature.replace(parameters=head + settings)


def fingerprint(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


# What a saved state must agree with that is not a setting.
_FACTS = (
    "dataset",
    "shards_sha256",
    "tokenizer",
    "batches_per_epoch",
    "schedule",
    "weight_by",
    "supervised_per_sample",
)
# facts a resume adopts from the saved run rather than checks
_KEPT = ("batches_per_epoch", "schedule_clock")


def resume_config(settings: LoaderSettings, **effective: Any) -> dict[str, Any]:
    """What a saved state must agree with to resume exactly: every batch-shaping setting, with
    the values in use where the settings leave them open (``effective``: the image token and
    chat template the tokenizer brought, the tile budget of a pack), plus the facts that are
    not settings (``_FACTS``)."""
    config = settings.shaping()
    for name, value in effective.items():
        if name in config or name in _FACTS or name in _KEPT:
            config[name] = value
        else:
            raise ValueError(f"{name} is not a batch-shaping setting or fact")
    if config.get("chat_template") is not None:  # the template's text can be long
        config["chat_template"] = fingerprint(config["chat_template"])
    return config


# The value a state saved before the setting was recorded was made with: it is checked as
# that (the places of such a state name other samples under another chunk size).
_BEFORE_RECORDED = {
    "span_bytes": 8 * 2**20,
    "span_samples": None,
    "schedule": None,
    "plan_version": 2,
    "weight_by": "samples",
    "supervised_per_sample": None,
}


def check_resume(saved: Mapping[str, Any], here: Mapping[str, Any]) -> None:
    """Refuse a saved ``config`` that differs from ``here`` in anything but the epoch length
    (a resumed run keeps its own), naming each difference."""
    saved = {**{k: v for k, v in _BEFORE_RECORDED.items() if k in here}, **saved}
    differ = [k for k in here if k not in _KEPT and k in saved and saved[k] != here[k]]
    if differ:
        raise ValueError(
            "cannot resume: the loader state was saved with other settings: "
            + ", ".join(f"{k} {saved[k]!r} -> {here[k]!r}" for k in differ)
            + ". Resume with the settings it was saved with"
            + (
                f" (plan_version={saved['plan_version']}: the order of the pass it was saved in)"
                if "plan_version" in differ
                else ""
            )
            + (
                " and on the data it was saved on (dataset and shards_sha256: the sources' "
                "shards and their content)"
                if {"dataset", "shards_sha256"} & set(differ)
                else ""
            )
            + ", or start a new epoch afresh "
            "with set_epoch() instead of loading it"
        )
    unknown = sorted(k for k in here if k not in saved)
    if unknown:  # a state of an older wdsvlm: what it did not record cannot be checked
        log.warning("the loader state does not record %s; resuming without checking them", unknown)


def upgrade_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state of an older version in this version's form."""
    version = state.get("version")
    if version == STATE_VERSION:
        return dict(state)
    if version in (1, 2):
        raise ValueError(
            f"loader state version {version}: it was saved by an earlier wdsvlm, whose places "
            "of samples were positions in each worker's reading order; this wdsvlm places "
            "them in each pass's global order, so it cannot go on from that state. Start the "
            "next epoch afresh instead: set_epoch(saved epoch + 1) without loading the state"
        )
    raise ValueError(f"loader state version {version!r}; this wdsvlm reads version {STATE_VERSION}")


__all__ = [
    "STATE_VERSION",
    "LoaderSettings",
    "check_resume",
    "resume_config",
    "settings_from",
    "signature_with_settings",
    "upgrade_state",
]
