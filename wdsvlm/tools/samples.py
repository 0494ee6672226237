"""Looking at a dataset before training on it: a few samples as they are stored (``wdsvlm
inspect``), read through the loader's own stages, so they show what training sees."""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..families.tiling import ImageConfig, tile_count, tile_grid
from ..format.images import image_members
from ..format.videos import VideoInfo, video_members
from ..pipeline.documents import parse_record
from ..pipeline.stats import SkipStats
from .documents import DocumentView, checked_elements, document_view, untokenized_view

log = logging.getLogger("wdsvlm.inspect")

# Token kinds in a batch picture (``token_kinds``); 0 is padding.
PAD, TEXT, IMAGE, SUPERVISED = 0, 1, 2, 3


def _spans(picked: Sequence[tuple]) -> Iterator[dict]:
    """One read span per ``(shard URL, shard name, index entry, storage options, layout)``."""
    from ..pipeline.order import span

    for url, shard, entry, options, layout in picked:
        yield span(url, shard, [entry], storage_options=options, layout=layout)


def pick_entries(
    index: dict, urls: Sequence[str], n: int, keys: Sequence[str] = ()
) -> list[tuple[str, str, dict]]:
    """``(shard URL, shard name, entry)`` of the samples with ``keys`` (in that order), or else
    the first ``n`` samples. An unknown key is a ``ValueError`` naming it. Only the sidecars
    of the shards needed are read (for a key: those whose first and last keys, in the root
    index of version 2, bracket it; all, if it is not found there)."""

    def every():  # shard by shard, never a list of them all (a million rows at 1B samples)
        return zip(index["shards"], urls, strict=True)

    def among(chosen):
        return ((url, s["name"], e) for s, url in chosen for e in s["entries"])

    if not keys:
        return list(itertools.islice(among(every()), n))
    where: dict[str, tuple] = {}
    for key in keys:
        if key in where:
            continue
        bracketing = [
            (s, url)
            for s, url in every()
            if len(s.get("keys", [])) == 2 and s["keys"][0] <= key <= s["keys"][1]
        ]
        for chosen in (bracketing, every()):
            found = next(((u, name, e) for u, name, e in among(chosen) if e["key"] == key), None)
            if found is not None:
                where[key] = found
                break
    missing = [k for k in keys if k not in where]
    if missing:
        some = ", ".join(e["key"] for _, _, e in itertools.islice(among(every()), 3))
        raise ValueError(
            f"no sample with key {', '.join(missing)} in the dataset (keys look like {some})"
        )
    return [where[k] for k in keys]


@dataclass
class VideoView:
    """One video of a stored sample: its bytes, what the index records of it, the frames the
    processor samples (``sampled``, with ``tokens``) or, with no processor, a few evenly
    spaced ones."""

    data: bytes
    info: VideoInfo
    frames: list[int]
    sampled: bool
    tokens: int | None = None
    problem: str | None = None  # why the processor cannot sample it

    def describe(self) -> str:
        i = self.info
        text = (
            f"{i.width}x{i.height} px, {i.frames} frames at {i.fps:.4g} fps "
            f"({i.duration:.2f} s), {i.codec}"
        )
        if i.rotation:
            text += f", shown turned {i.rotation} degrees"
        shown = ", ".join(map(str, self.frames[:12])) + (", ..." if len(self.frames) > 12 else "")
        if self.problem:
            return text + f"; PROBLEM: the processor cannot sample it ({self.problem})"
        if self.sampled:
            return text + f"; {len(self.frames)} frames sampled ({shown}), {self.tokens} tokens"
        return text + f"; frames {shown} shown (pass --processor for the frames sampled)"


@dataclass
class SampleView:
    """One stored sample as ``inspect`` shows it."""

    key: str
    shard: str
    messages: list[dict]
    images: list[bytes]
    sizes: list[tuple[int, int]]
    tiles: list[int]
    grids: list[tuple[int, int]]
    turn_tokens: list[int] | None = None  # text tokens of each turn's content
    tokens: dict[str, int] | None = None  # whole sample: total, image, text, supervised
    problem: str | None = None  # why the loader would skip it (invalid JSON, ...)
    videos: list[VideoView] = field(default_factory=list)
    document: DocumentView | None = None  # a document's or caption's elements and pieces

    def describe(self, max_chars: int = 400) -> str:
        lines = [f"{self.key}  ({self.shard})"]
        if self.document is not None:
            return "\n".join(lines + self.document.lines(max_chars) + self._totals())
        for i, (size, tiles, grid) in enumerate(
            zip(self.sizes, self.tiles, self.grids, strict=True)
        ):
            how = f"{grid[0]}x{grid[1]} + thumbnail" if tiles > 1 else "one tile"
            noun = "tile" if tiles == 1 else "tiles"
            lines.append(f"  image {i}: {size[0]}x{size[1]} px, {tiles} {noun} ({how})")
        lines += [f"  video {i}: {video.describe()}" for i, video in enumerate(self.videos)]
        if not self.images and not self.videos:
            lines.append("  no images")
        for i, m in enumerate(self.messages):
            text = m["content"]
            if len(text) > max_chars:
                text = text[:max_chars] + f"... ({len(m['content']) - max_chars} more chars)"
            count = f", {self.turn_tokens[i]} tokens" if self.turn_tokens else ""
            lines.append(f"  [{m['role']}{count}] " + text.replace("\n", "\n    "))
        return "\n".join(lines + self._totals())

    def _totals(self) -> list[str]:
        lines = [f"  PROBLEM: {self.problem}"] if self.problem else []
        if self.tokens:
            t = self.tokens
            pieces = self.document.pieces if self.document is not None else ()
            lines.append(
                f"  tokens: {t['total']} ({t['image']} {'vision' if self.videos else 'image'}, "
                f"{t['text']} text, {t['supervised']} supervised)"
                + (f" in {len(pieces)} pieces" if len(pieces) > 1 else "")
            )
        return lines


def inspect_samples(
    source: Any,
    *,
    n: int = 5,
    keys: Sequence[str] = (),
    tokenizer: Any = None,
    image_config: ImageConfig | None = None,
    tokens_per_tile: int = 64,
    storage_options: Mapping[str, Any] | None = None,
    processor: Any = None,
    max_length: int | None = None,
    max_units: int | None = None,
) -> list[SampleView]:
    """The first ``n`` samples of ``source`` (or those with ``keys``), read by their index
    offsets; with a ``tokenizer`` or a ``processor``, their token counts as the loader would
    make them (with a processor, the frames it samples of each video). A document or caption
    is shown element by element, each image in its place; with a tokenizer or processor, cut
    into pieces as the Loader cuts it at ``max_length`` tokens and ``max_units`` vision units
    a piece (the Loader's ``max_length`` and ``max_tiles_per_pack``). A sample the loader
    would skip is shown with its ``problem``."""
    from ..pipeline.read import ReadSamples
    from ..pipeline.sources import resolve_sources

    config = image_config or ImageConfig()
    sources, mixture, _ = resolve_sources(source, storage_options)
    if not mixture:
        s = sources[0]
        picked = [
            (url, shard, entry, s.storage_options, s.index.get("layout"))
            for url, shard, entry in pick_entries(s.index, s.urls, n, keys)
        ]
    else:  # a mixture: the first n of each source, or keys named "SOURCE/KEY"
        names = {s.name for s in sources}
        strays = [k for k in keys if k.split("/", 1)[0] not in names or "/" not in k]
        if strays:
            raise ValueError(
                f"keys of a mixture are SOURCE/KEY with a source of {sorted(names)}: "
                f"{', '.join(strays)}"
            )
        picked = []
        for s in sources:
            wanted = [k.split("/", 1)[1] for k in keys if k.split("/", 1)[0] == s.name]
            if keys and not wanted:
                continue
            picked += [
                (url, f"{s.name}/{shard}", entry, s.storage_options, s.index.get("layout"))
                for url, shard, entry in pick_entries(s.index, s.urls, n, wanted)
            ]
    stats = SkipStats(max_consecutive=sys.maxsize)  # bad samples are shown, however many
    samples = list(ReadSamples(storage_options, stats=stats)(_spans(picked)))
    if stats.counts:
        log.warning("could not read every sample: %s", stats.as_dict(examples=3))
    tokenize = None
    if processor is not None:
        from ..families.registry import family_of
        from ..pipeline.tokenize import Tokenize

        tokenize = Tokenize(
            family=family_of(processor), stats=stats, max_length=max_length, max_units=max_units
        )
    elif tokenizer is not None:
        from ..pipeline.tokenize import Tokenize

        tokenize = Tokenize(
            tokenizer,
            tokens_per_tile=tokens_per_tile,
            image_config=config,
            stats=stats,
            max_length=max_length,
            max_units=max_units,
        )
    return [_view(sample, config, tokenize) for sample in samples]


SHOWN_FRAMES = 4  # frames of a video shown when no processor says which it samples


def _videos(sample: dict, tokenize) -> list[VideoView]:
    planner = getattr(tokenize.family, "video", None) if tokenize is not None else None
    out = []
    metas = sample["__meta__"].get("videos", ())
    for name, meta in zip(video_members(sample), metas, strict=True):
        info = VideoInfo.from_dict(meta)
        count = min(SHOWN_FRAMES, info.frames)
        spaced = [int(i) for i in np.linspace(0, info.frames - 1, count).round()]
        if planner is None:
            out.append(VideoView(sample[name], info, spaced, False))
            continue
        try:
            frames = [int(i) for i in planner.frames(info)]
        except ValueError as e:  # e.g. fewer frames than the processor's num_frames
            out.append(VideoView(sample[name], info, spaced, False, problem=str(e)))
            continue
        out.append(VideoView(sample[name], info, frames, True, len(planner.token_ids(info))))
    return out


def _view(sample: dict, config: ImageConfig, tokenize) -> SampleView:
    sizes = [tuple(s) for s in sample["__meta__"]["images"]]
    view = SampleView(
        key=sample["__key__"],
        shard=sample["__shard__"],
        messages=[],
        images=[sample[name] for name in image_members(sample)],
        sizes=sizes,
        tiles=[tile_count(w, h, config) for w, h in sizes],
        grids=[tile_grid(w, h, config) for w, h in sizes],
        videos=_videos(sample, tokenize),
    )
    try:
        record, kind = parse_record(sample)
        if kind == "conversation":
            view.messages = [
                {"role": str(m["role"]), "content": str(m["content"])} for m in record["messages"]
            ]
    except (KeyError, TypeError, ValueError) as e:
        view.problem = f"invalid JSON member ({type(e).__name__}: {e})"
        return view
    if kind != "conversation":
        return _document(view, sample, record, kind, config, tokenize)
    if tokenize is None:
        return view
    encode = tokenize.tokenizer
    view.turn_tokens = [
        len(encode(m["content"], add_special_tokens=False)["input_ids"]) for m in view.messages
    ]
    before = dict(tokenize.stats.counts)
    encoded = tokenize.encode([dict(sample)])
    if encoded:
        kinds = token_kinds(encoded[0], tokenize.image_token_id, tokenize.video_token_id)
        view.tokens = {
            "total": len(kinds),
            "image": int((kinds == IMAGE).sum()),
            "text": int((kinds == TEXT).sum()),
            "supervised": int((kinds == SUPERVISED).sum()),
        }
    else:
        reasons = [r for r, n in tokenize.stats.counts.items() if n > before.get(r, 0)]
        view.problem = f"the loader would skip it: {', '.join(reasons) or 'not tokenized'}"
    return view


def _document(view: SampleView, sample: dict, record: dict, kind: str, config, tokenize):
    """``view`` of a document or caption: its elements in place, and its pieces."""
    if tokenize is None:
        elements, view.problem = checked_elements(record, kind, len(view.sizes), view.key)
        if view.problem is None:
            view.document = untokenized_view(kind, elements, view.sizes, config)
        return view
    view.document, view.problem = document_view(sample, record, kind, tokenize)
    if view.document is not None:
        pieces = view.document.pieces
        total, image = sum(p.tokens for p in pieces), sum(p.image_tokens for p in pieces)
        view.tokens = {
            "total": total,
            "image": image,
            "text": total - image,
            "supervised": sum(p.supervised for p in pieces),
        }
    return view


def token_kinds(sample: dict, image_token_id: int, video_token_id: int | None = None) -> np.ndarray:
    """Each token of a tokenized sample as ``TEXT``, ``IMAGE`` (an image's or a video's) or
    ``SUPERVISED`` (uint8)."""
    from ..pipeline.tokenize import IGNORE_INDEX

    kinds = np.full(len(sample["input_ids"]), TEXT, dtype=np.uint8)
    kinds[sample["input_ids"] == image_token_id] = IMAGE
    if video_token_id is not None:
        kinds[sample["input_ids"] == video_token_id] = IMAGE
    kinds[sample["labels"] != IGNORE_INDEX] = SUPERVISED
    return kinds
