"""Looking at a dataset before training on it: a few samples as they are stored (``wdsvlm
inspect``), read through the loader's own stages, so they show what training sees."""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..families.tiling import ImageConfig, tile_count, tile_grid
from ..format.images import image_members
from ..pipeline.stats import SkipStats

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
    shards = list(zip(index["shards"], urls, strict=True))

    def among(chosen):
        return ((url, s["name"], e) for s, url in chosen for e in s["entries"])

    if not keys:
        return list(itertools.islice(among(shards), n))
    where: dict[str, tuple] = {}
    for key in keys:
        if key in where:
            continue
        bracketing = [
            (s, url)
            for s, url in shards
            if len(s.get("keys", [])) == 2 and s["keys"][0] <= key <= s["keys"][1]
        ]
        for chosen in (bracketing, shards):
            found = next(((u, name, e) for u, name, e in among(chosen) if e["key"] == key), None)
            if found is not None:
                where[key] = found
                break
    missing = [k for k in keys if k not in where]
    if missing:
        some = ", ".join(e["key"] for _, _, e in itertools.islice(among(shards), 3))
        raise ValueError(
            f"no sample with key {', '.join(missing)} in the dataset (keys look like {some})"
        )
    return [where[k] for k in keys]


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

    def describe(self, max_chars: int = 400) -> str:
        lines = [f"{self.key}  ({self.shard})"]
        for i, (size, tiles, grid) in enumerate(
            zip(self.sizes, self.tiles, self.grids, strict=True)
        ):
            how = f"{grid[0]}x{grid[1]} + thumbnail" if tiles > 1 else "one tile"
            noun = "tile" if tiles == 1 else "tiles"
            lines.append(f"  image {i}: {size[0]}x{size[1]} px, {tiles} {noun} ({how})")
        if not self.images:
            lines.append("  no images")
        for i, m in enumerate(self.messages):
            text = m["content"]
            if len(text) > max_chars:
                text = text[:max_chars] + f"... ({len(m['content']) - max_chars} more chars)"
            count = f", {self.turn_tokens[i]} tokens" if self.turn_tokens else ""
            lines.append(f"  [{m['role']}{count}] " + text.replace("\n", "\n    "))
        if self.problem:
            lines.append(f"  PROBLEM: {self.problem}")
        if self.tokens:
            t = self.tokens
            lines.append(
                f"  tokens: {t['total']} ({t['image']} image, {t['text']} text, "
                f"{t['supervised']} supervised)"
            )
        return "\n".join(lines)


def inspect_samples(
    source: Any,
    *,
    n: int = 5,
    keys: Sequence[str] = (),
    tokenizer: Any = None,
    image_config: ImageConfig | None = None,
    tokens_per_tile: int = 64,
    storage_options: Mapping[str, Any] | None = None,
) -> list[SampleView]:
    """The first ``n`` samples of ``source`` (or those with ``keys``), read by their index
    offsets; with a ``tokenizer``, their token counts as the loader would make them. A sample
    the loader would skip is shown with its ``problem``."""
    from ..pipeline.read import ReadSamples
    from ..pipeline.sources import resolve_sources

    config = image_config or ImageConfig()
    sources, mixture = resolve_sources(source, storage_options)
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
    if tokenizer is not None:
        from ..pipeline.tokenize import Tokenize

        tokenize = Tokenize(
            tokenizer, tokens_per_tile=tokens_per_tile, image_config=config, stats=stats
        )
    return [_view(sample, config, tokenize) for sample in samples]


def _view(sample: dict, config: ImageConfig, tokenize) -> SampleView:
    import json

    sizes = [tuple(s) for s in sample["__meta__"]["images"]]
    view = SampleView(
        key=sample["__key__"],
        shard=sample["__shard__"],
        messages=[],
        images=[sample[name] for name in image_members(sample)],
        sizes=sizes,
        tiles=[tile_count(w, h, config) for w, h in sizes],
        grids=[tile_grid(w, h, config) for w, h in sizes],
    )
    try:
        view.messages = [
            {"role": str(m["role"]), "content": str(m["content"])}
            for m in json.loads(sample["json"])["messages"]
        ]
    except (KeyError, TypeError, ValueError) as e:
        view.problem = f"invalid JSON member ({type(e).__name__}: {e})"
        return view
    if tokenize is None:
        return view
    encode = tokenize.tokenizer
    view.turn_tokens = [
        len(encode(m["content"], add_special_tokens=False)["input_ids"]) for m in view.messages
    ]
    before = dict(tokenize.stats.counts)
    encoded = tokenize.encode([dict(sample)])
    if encoded:
        kinds = token_kinds(encoded[0], tokenize.image_token_id)
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


def token_kinds(sample: dict, image_token_id: int) -> np.ndarray:
    """Each token of a tokenized sample as ``TEXT``, ``IMAGE`` or ``SUPERVISED`` (uint8)."""
    from ..pipeline.tokenize import IGNORE_INDEX

    kinds = np.full(len(sample["input_ids"]), TEXT, dtype=np.uint8)
    kinds[sample["input_ids"] == image_token_id] = IMAGE
    kinds[sample["labels"] != IGNORE_INDEX] = SUPERVISED
    return kinds
