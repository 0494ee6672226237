"""Sources and mixtures: the datasets a plan reads, and each one's share of every pass.

``resolve_sources`` turns what a Loader is given (a dataset folder or URL, tar URLs, a
``Source`` or a list of them, a mixture file) into ``DataSource``s: each with its index, its
shard URLs and its share of a pass.

``Source(path, repeat=..., choose=..., weight=..., name=...)`` names one dataset of a mixture;
a mixture file (YAML or JSON) lists them. What a pass holds follows from the sources' sizes
alone (``pass_counts``), so it is the same on every topology:

- ``repeat=r`` (default 1.0): every sample ``floor(r)`` times, and a seeded subset of
  ``round(frac(r) * n)`` of the ``n`` samples once more (halves up). The subsets of successive
  passes are successive windows of one seeded permutation, so they rotate through the whole
  source: no sample gets its extra copy a second time before every sample has had one.
- ``choose=k``: ``repeat=k/n``.
- ``weight=w`` (every source, then): a pass holds ``samples_per_pass`` samples (default: the
  sources' total), split by weight with the same rounding, each share drawn as ``choose``.
- ``weight=[(batch, w), ...]`` with ``schedule="linear"`` or ``"step"``: a weight that follows
  the training Loader's batch count, pass by short pass (``schedule.py``).
- ``weight_by="tokens"`` (the mixture's, in its file or the Loader's setting): the weights are
  shares of the supervised tokens, each made a sample weight over the source's mean
  supervised tokens per sample (``token_weights.py``), the same number in every process.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import ShardFormatError
from ..format.index import load_index, shard_urls
from ..format.table import ShardTable
from ..format.tarscan import scan_index
from ..storage.fs import join
from .schedule import Schedule, check_points
from .token_weights import by_tokens, check_weight_by

log = logging.getLogger("wdsvlm.mixture")


@dataclass(frozen=True)
class Source:
    """One dataset of a mixture: a dataset folder or URL, or tar URLs (as ``Loader`` takes).

    ``repeat`` (samples per pass as a multiple of the source's size), ``choose`` (samples per
    pass) or ``weight`` (a share of ``samples_per_pass``, given for every source; or points
    ``[(batch, weight), ...]`` joined as ``schedule`` says, ``"linear"`` or ``"step"``); ``name``
    defaults to the path's last component, made unique in the mixture (``vqa``, ``vqa-2``);
    ``storage_options`` go to fsspec for this source (the Loader's own otherwise).
    """

    path: str | Sequence[str]
    repeat: float | None = None
    choose: int | None = None
    weight: Any = None
    name: str | None = None
    storage_options: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    schedule: str | None = None
    """With ``weight=[(batch, weight), ...]``: ``"linear"`` (the default) or ``"step"``
    (``schedule.py``)."""

    def __post_init__(self):
        given = [k for k in ("repeat", "choose", "weight") if getattr(self, k) is not None]
        where = f"Source({self.path!r})"
        if self.schedule is not None and self.weight is None:
            raise ValueError(f"{where}: schedule= goes with weight=[(batch, weight), ...]")
        if self.weight is not None and not isinstance(self.weight, numbers.Real):
            points = check_points(self.weight, self.schedule, where)
            object.__setattr__(self, "weight", points)
            object.__setattr__(self, "schedule", self.schedule or "linear")
        if len(given) > 1:
            raise ValueError(f"{where}: give one of repeat, choose and weight, not {given}")
        if self.repeat is not None and not (self.repeat >= 0 and math.isfinite(self.repeat)):
            raise ValueError(f"{where}: repeat must be a finite number >= 0, not {self.repeat}")
        if self.choose is not None and (isinstance(self.choose, bool) or self.choose < 0):
            raise ValueError(f"{where}: choose must be a whole number >= 0, not {self.choose}")
        if self.choose is not None and int(self.choose) != self.choose:
            raise ValueError(f"{where}: choose must be a whole number >= 0, not {self.choose}")
        if isinstance(self.weight, numbers.Real) and not (
            self.weight > 0 and math.isfinite(self.weight)
        ):
            raise ValueError(f"{where}: weight must be a finite number > 0, not {self.weight}")
        if self.name is not None and (not self.name or "/" in self.name):
            raise ValueError(f"{where}: a name must be non-empty and hold no '/': {self.name!r}")

    @property
    def default_name(self) -> str:
        path = self.path if isinstance(self.path, str) else self.path[0]
        last = path.rstrip("/").rsplit("/", 1)[-1]
        if last.endswith(".tar"):  # tar URLs: the folder that holds them
            last = path.rstrip("/").rsplit("/", 2)[-2] if path.count("/") else last
        return last.split("{")[0].rstrip("-_.") or "source"


def named(sources: Sequence[Source]) -> list[Source]:
    """The sources with their names: given ones kept, others their path's last component,
    made unique (``vqa``, ``vqa-2``, ...). Two sources given the same name are refused."""
    given = [s.name for s in sources if s.name is not None]
    twice = sorted({n for n in given if given.count(n) > 1})
    if twice:
        raise ValueError(f"two sources of the mixture have the same name: {twice}")
    taken = set(given)
    out = []
    for source in sources:
        if source.name is None:
            base = name = source.default_name
            k = 2
            while name in taken:
                name, k = f"{base}-{k}", k + 1
            taken.add(name)
            source = replace(source, name=name)
        out.append(source)
    return out


def pass_counts(
    sizes: Sequence[int], sources: Sequence[Source], samples_per_pass: int | None = None
) -> list[tuple[int, int]]:
    """Per source, ``(copies, extra)``: every sample ``copies`` times a pass, and ``extra``
    samples once more. ``sizes``: the sources' sample counts."""
    weighted = [s.weight is not None for s in sources]
    if any(weighted) and not all(weighted):
        raise ValueError(
            "a mixture gives weight= for every source or for none: weight is a share of "
            "samples_per_pass, repeat and choose are absolute; do not mix them"
        )
    if samples_per_pass is not None and not all(weighted):
        raise ValueError("samples_per_pass goes with weight= on every source")
    if any(not isinstance(s.weight, numbers.Real) for s in sources if s.weight is not None):
        raise ValueError("a weight schedule is counted pass by pass: see schedule_of")
    if all(weighted) and sources:
        total = sum(sizes) if samples_per_pass is None else samples_per_pass
        weights = sum(s.weight for s in sources)
        wanted = [_round_half_up(total * s.weight / weights) for s in sources]
        return [divmod(k, n) if n else (0, 0) for k, n in zip(wanted, sizes, strict=True)]
    out = []
    for source, n in zip(sources, sizes, strict=True):
        if source.choose is not None:
            out.append(divmod(int(source.choose), n) if n else (0, 0))
            continue
        r = 1.0 if source.repeat is None else float(source.repeat)
        copies = math.floor(r)
        out.append((copies, min(n, _round_half_up((r - copies) * n))))
    return out


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5 + 1e-9)


MIXTURE_SUFFIXES = (".yaml", ".yml", ".json")


def is_mixture_file(path: Any) -> bool:
    return isinstance(path, str) and path.lower().endswith(MIXTURE_SUFFIXES)


def load_mixture(
    path: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[list[Source], int | None, str | None]:
    """The sources, ``samples_per_pass`` and ``weight_by`` of a mixture file: ``{"sources":
    [{"path": ..., "repeat": ...}, ...], "samples_per_pass": ..., "weight_by": ...}`` in YAML
    or JSON, any fsspec URL; source paths relative to the file's folder."""
    import fsspec

    try:
        with fsspec.open(path, "rt", **dict(storage_options or {})) as f:
            text = f.read()
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the mixture file: {e}") from e
    try:
        if path.lower().endswith(".json"):
            spec = json.loads(text)
        else:
            import yaml

            spec = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - any parse error, named with the file
        raise ValueError(f"{path}: not a valid mixture file: {e}") from e
    if not isinstance(spec, dict) or not isinstance(spec.get("sources"), list):
        raise ValueError(f'{path}: a mixture file holds {{"sources": [...]}}, not {spec!r:.200}')
    unknown = set(spec) - {"sources", "samples_per_pass", "weight_by"}
    if unknown:
        raise ValueError(f"{path}: unknown mixture fields {sorted(unknown)}")
    folder = path.rsplit("/", 1)[0] if "/" in path else "."
    sources = []
    for i, item in enumerate(spec["sources"]):
        if not isinstance(item, dict) or "path" not in item:
            raise ValueError(f"{path}: source {i} needs a path: {item!r:.200}")
        fields = {"path", "repeat", "choose", "weight", "name", "storage_options", "schedule"}
        if set(item) - fields:
            raise ValueError(f"{path}: source {i}: unknown fields {sorted(set(item) - fields)}")
        try:
            sources.append(Source(**{**item, "path": _relative(folder, item["path"])}))
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: source {i}: {e}") from e
    per_pass = spec.get("samples_per_pass")
    if per_pass is not None and (isinstance(per_pass, bool) or not isinstance(per_pass, int)):
        raise ValueError(f"{path}: samples_per_pass must be a whole number, not {per_pass!r}")
    weight_by = spec.get("weight_by")
    if weight_by is not None:
        check_weight_by(weight_by, f"{path}: weight_by")
    return sources, per_pass, weight_by


def _relative(folder: str, path: Any) -> Any:
    if not isinstance(path, str):
        return [_relative(folder, p) for p in path]
    if "://" in path or os.path.isabs(path):
        return path
    return join(folder, path) if "://" in folder else os.path.normpath(os.path.join(folder, path))


@dataclass
class DataSource:
    """One resolved source of the plan: its index, shard URLs and share of each pass."""

    name: str
    index: dict
    urls: list[str]
    copies: int = 1
    extra: int = 0
    storage_options: Mapping[str, Any] | None = None
    supervised_per_sample: float | None = None
    """With weights by tokens: the mean supervised tokens per sample its weight was divided by
    (``token_weights.py``); None with weights by samples."""
    span_share: float = 1.0
    """The share of ``span_samples`` a chunk of it holds at most: with weights by tokens, a
    chunk holds no more supervised tokens than one of the lightest source (``chunk_cap``)."""

    def chunk_cap(self, span_samples: int | None) -> int | None:
        """The most samples a chunk of this source holds, the plan's cap being
        ``span_samples``: a source heavy in supervised tokens comes in smaller chunks, so that
        the pass's even interleaving of visits is even in tokens too."""
        if span_samples is None or self.span_share >= 1:
            return span_samples
        return max(1, int(span_samples * self.span_share))

    @cached_property
    def sample_ends(self) -> np.ndarray:
        """Where each shard's samples end in the source's numbering (``[0, n0, n0 + n1,
        ...]``): sample ``i`` is in the shard ``searchsorted(ends, i, "right") - 1``."""
        shards = self.index["shards"]
        if isinstance(shards, ShardTable):  # a column of the mapped table
            counts = shards.samples
        else:
            counts = np.fromiter((s["samples"] for s in shards), dtype=np.int64, count=len(shards))
        return np.concatenate([[0], np.cumsum(counts)])

    @cached_property
    def size(self) -> int:
        """Samples in the source (its index's shards together)."""
        return int(self.sample_ends[-1])

    @cached_property
    def bytes(self) -> int:
        """Bytes of the source's shards together (as the index says)."""
        shards = self.index["shards"]
        if isinstance(shards, ShardTable):
            return int(shards.bytes.sum())
        return sum(s.get("bytes") or 0 for s in shards)

    @property
    def per_pass(self) -> int:
        return self.copies * self.size + self.extra


def resolve_source(
    source: str | Sequence[str], storage_options: Mapping[str, Any] | None = None, policy=None
) -> tuple[dict, list[str]]:
    """The index of ``source`` and the URL of each of its shards.

    ``source`` is a dataset folder or URL prefix (its ``index.json`` is read), or tar URLs: a
    brace pattern such as ``s3://b/ds/data-{000000..000006}.tar``, or a list. Tar URLs are
    looked up in the ``index.json`` beside them when there is one, else their headers are
    scanned once to build the index in memory.
    """
    if isinstance(source, str) and not source.endswith(".tar"):
        index = load_index(source, storage_options, policy)
        return index, shard_urls(source, index)
    urls = _expand(source)
    folder = urls[0].rsplit("/", 1)[0] if "/" in urls[0] else "."
    same_folder = all((u.rsplit("/", 1)[0] if "/" in u else ".") == folder for u in urls)
    full = None
    if same_folder:
        try:
            full = load_index(folder, storage_options, policy)
        except ShardFormatError as e:  # no usable index beside the shards: scan them instead
            log.debug("no index beside %s (%s)", urls[0], e)
    if full is not None:
        by_name = {s["name"]: s for s in full["shards"]}
        names = [u.rsplit("/", 1)[-1] for u in urls]
        if all(n in by_name for n in names):
            return {**full, "shards": [by_name[n] for n in names]}, urls
    log.warning(
        "no index.json lists %s: scanning %d shards to build one in memory (`wdsvlm index` "
        "writes one once, for tars of any layout)",
        urls[0],
        len(urls),
    )
    return scan_index(urls, storage_options), urls


def _expand(source: str | Sequence[str]) -> list[str]:
    import braceexpand

    patterns = [source] if isinstance(source, str) else list(source)
    urls = [u for p in patterns for u in braceexpand.braceexpand(p)]
    if not urls:
        raise ValueError(f"no shard URLs in {source!r}")
    return urls


def resolve_sources(
    source: Any,
    storage_options: Mapping[str, Any] | None = None,
    policy=None,
    samples_per_pass: int | None = None,
    weight_by: str | None = None,
    supervised: Callable[[list[DataSource]], list[float]] | None = None,
) -> tuple[list[DataSource], bool, Schedule | None]:
    """The plan's sources, each with its index, URLs and share of a pass, whether they form a
    mixture (keys then name their source), and their weight schedule if any. ``source``: a
    dataset folder or URL, tar URLs (a brace pattern or a list), a ``Source``, a list of
    ``Source``, or a mixture file (``.yaml``, ``.yml``, ``.json``). ``weight_by``: what the
    weights are shares of (None: the mixture file's, else ``"samples"``); by ``"tokens"``,
    ``supervised`` gives each source's mean supervised tokens per sample (default: its index's
    estimate, ``token_weights.index_supervised``)."""
    mixture, from_file = True, None
    if is_mixture_file(source):
        sources, per_pass, from_file = load_mixture(source, storage_options)
        samples_per_pass = samples_per_pass if samples_per_pass is not None else per_pass
    elif isinstance(source, Source):
        sources = [source]
    elif not isinstance(source, str) and any(isinstance(s, Source) for s in source):
        if not all(isinstance(s, Source) for s in source):
            raise TypeError("a mixture is a list of wdsvlm.Source; wrap each path in Source(...)")
        sources = list(source)
    else:
        sources, mixture = [Source(source)], False
    if not sources:
        raise ValueError("the mixture has no sources")
    sources = named(sources)
    resolved = []
    for s in sources:
        options = s.storage_options if s.storage_options is not None else storage_options
        index, urls = resolve_source(s.path, options, policy)
        resolved.append(DataSource(s.name, index, urls, storage_options=options))
    if check_weight_by(weight_by or from_file or "samples") == "tokens":
        sources = by_tokens(sources, resolved, supervised)
    sizes = [r.size for r in resolved]
    schedule = schedule_of(sources, sizes, samples_per_pass)
    if schedule is not None:
        counts = [(c, e) for c, e, _ in schedule.pass_counts(0)]
    else:
        counts = pass_counts(sizes, sources, samples_per_pass)
    for r, (copies, extra) in zip(resolved, counts, strict=True):
        r.copies, r.extra = copies, extra
    return resolved, mixture or len(resolved) > 1, schedule


def schedule_of(
    sources: Sequence[Source], sizes: Sequence[int], samples_per_pass: int | None
) -> Schedule | None:
    """The mixture's ``Schedule`` where a source's weight is on one, else None. Every source
    then gives ``weight=`` (a number is a weight that stays); ``samples_per_pass`` defaults
    to the sources' total until the Loader shortens the passes (``loader/build.py``)."""
    if all(s.schedule is None for s in sources):
        return None
    if any(s.weight is None for s in sources):
        raise ValueError(
            "a mixture with a weight schedule gives weight= for every source (a number is a "
            "weight that stays)"
        )
    points = [
        ((0.0, float(s.weight)),) if isinstance(s.weight, numbers.Real) else s.weight
        for s in sources
    ]
    kinds = [s.schedule or "step" for s in sources]
    given = samples_per_pass is not None
    return Schedule(points, kinds, list(sizes), samples_per_pass or sum(sizes), given=given)
