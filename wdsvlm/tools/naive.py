"""The naive side of ``wdsvlm bench``: what a first VLM loader usually is.

webdataset's tar reader, a full PIL decode of every image, the same resize and tiling (tile by
tile crops), the chat template and a tokenizer call per sample, labels found by tokenizing each
conversation prefix, samples over ``max_length`` dropped, and batches of ``batch_size`` samples
padded to the longest.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from ..families.tiling import ImageConfig, tile_grid
from ..format.images import image_members, to_rgb
from ..pipeline.tokenize import IGNORE_INDEX, Tokenize


def naive_tiles(data: bytes, config: ImageConfig) -> np.ndarray:
    """An image's tiles ``[N, 3, S, S]`` (uint8), decoded at full size and cut crop by crop."""
    img = to_rgb(ImageOps.exif_transpose(Image.open(io.BytesIO(data))))
    cols, rows = tile_grid(img.width, img.height, config)
    s = config.tile_size
    grid = img.resize((cols * s, rows * s), Image.Resampling.BICUBIC, reducing_gap=3.0)
    tiles = [
        np.asarray(grid.crop((c * s, r * s, (c + 1) * s, (r + 1) * s))).transpose(2, 0, 1)
        for r in range(rows)
        for c in range(cols)
    ]
    if len(tiles) > 1:
        thumb = grid.resize((s, s), Image.Resampling.BICUBIC, reducing_gap=3.0)
        tiles.insert(0, np.asarray(thumb).transpose(2, 0, 1))
    return np.stack(tiles)


def naive_tokens(
    tokenize: Tokenize, messages: list[dict], tiles: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """``input_ids`` and ``labels`` the usual slow way: the chat template applied to each
    prefix of the conversation and tokenized again, answers located by token counts."""
    tokenizer, marker = tokenize.tokenizer, tokenize.image_token
    messages = [{**m, "content": m["content"].replace("<image>", marker)} for m in messages]

    def ids_of(msgs, prompt=False):
        text = tokenizer.apply_chat_template(
            msgs, chat_template=tokenize.chat_template, tokenize=False, add_generation_prompt=prompt
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    ids = ids_of(messages)
    labels = [IGNORE_INDEX] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start, stop = len(ids_of(messages[:i], prompt=True)), len(ids_of(messages[: i + 1]))
            while stop > start and not tokenizer.decode(ids[stop - 1]).strip():
                stop -= 1  # the newline after the end-of-turn token is not supervised
            labels[start:stop] = ids[start:stop]
    out_ids, out_labels, k = [], [], 0
    per_tile = tokenize.family.tokens_per_tile
    for t, label in zip(ids, labels, strict=True):
        if t == tokenize.image_token_id:
            out_ids += [t] * (tiles[k] * per_tile)
            out_labels += [IGNORE_INDEX] * (tiles[k] * per_tile)
            k += 1
        else:
            out_ids.append(t)
            out_labels.append(label)
    return np.asarray(out_ids, dtype=np.int64), np.asarray(out_labels, dtype=np.int64)


def naive_samples(samples: Iterator[dict], tokenize: Tokenize) -> Iterator[dict]:
    """webdataset samples (members by extension) -> tiles, ``input_ids`` and ``labels``."""
    for sample in samples:
        messages = json.loads(sample["json"])["messages"]
        per_image = [
            naive_tiles(sample[name], tokenize.family.config) for name in image_members(sample)
        ]
        tiles = [len(t) for t in per_image]
        ids, labels = naive_tokens(tokenize, messages, tiles)
        s = tokenize.family.config.tile_size
        yield {
            "__key__": sample["__key__"],
            "input_ids": ids,
            "labels": labels,
            "image_tiles": tiles,
            "pixel_values": np.concatenate(per_image)
            if per_image
            else np.zeros((0, 3, s, s), np.uint8),
        }


def pad_to_longest(samples: list[dict]) -> dict:
    """A naive batch: one row per sample, padded to the longest."""
    import torch

    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros((len(samples), longest), dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(samples), longest), dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n] = torch.from_numpy(s["input_ids"])
        labels[row, :n] = torch.from_numpy(s["labels"])
        mask[row, :n] = 1
    pixels = torch.from_numpy(np.concatenate([s["pixel_values"] for s in samples]))
    return {
        "input_ids": ids,
        "labels": labels,
        "attention_mask": mask,
        "pixel_values": pixels,
        "sample_keys": [[s["__key__"]] for s in samples],
    }


class _OpenShards:
    """webdataset stage: shard URLs -> open streams, through fsspec (local or bucket)."""

    def __init__(self, storage_options: Mapping[str, Any] | None):
        self.storage_options = storage_options

    def __call__(self, urls):
        from ..storage.fs import filesystem

        for item in urls:
            fs, path = filesystem(item["url"], self.storage_options)
            with fs.open(path, "rb") as stream:
                yield {"url": item["url"], "stream": stream}


class _Naive:
    """webdataset stage: ``naive_samples`` (a class, so that it pickles into workers)."""

    def __init__(self, tokenize: Tokenize):
        self.tokenize = tokenize

    def __call__(self, samples):
        return naive_samples(samples, self.tokenize)


def naive_pipeline(
    urls: list[str],
    tokenize: Tokenize,
    max_length: int,
    batch_size: int,
    storage_options: Mapping[str, Any] | None = None,
    layout: Mapping[str, Any] | None = None,
):
    """The naive pipeline as a webdataset ``DataPipeline`` of padded batches (shards split
    over DataLoader workers)."""
    return webdataset_batches(
        urls, _Naive(tokenize), max_length, batch_size, pad_to_longest, storage_options, layout
    )


def webdataset_batches(
    urls: list[str],
    stage,
    max_length: int,
    batch_size: int,
    collate,
    storage_options: Mapping[str, Any] | None = None,
    layout: Mapping[str, Any] | None = None,
):
    """A plain webdataset ``DataPipeline``: shards split over DataLoader workers, read with
    webdataset's tar reader, samples (members by extension; of another ``layout``, made
    wdsvlm's own) through ``stage``, those over ``max_length`` tokens dropped, batches of
    ``batch_size`` made by ``collate``."""
    import functools

    import webdataset as wds
    from webdataset.tariterators import group_by_keys, tar_file_expander

    return wds.DataPipeline(
        wds.SimpleShardList(urls),
        wds.split_by_worker,
        _OpenShards(storage_options),
        tar_file_expander,
        group_by_keys,
        _AsOwn(layout),
        stage,
        wds.select(functools.partial(_fits, max_length=max_length)),
        wds.batched(batch_size, collation_fn=collate, partial=True),
    )


class _AsOwn:
    """Samples of another layout (``layouts``) as wdsvlm's own members; those that make no
    sample of it are dropped (the Loader counts them)."""

    def __init__(self, layout: Mapping[str, Any] | None):
        from ..format.layouts import Layout

        self.layout = Layout.from_dict(layout)

    def __call__(self, samples: Iterator[dict]) -> Iterator[dict]:
        from ..format.layouts import BadSample

        for sample in samples:
            if self.layout.native:
                yield sample
                continue
            meta = {k: v for k, v in sample.items() if k.startswith("__")}
            members = {k: v for k, v in sample.items() if not k.startswith("__")}
            try:
                yield {**meta, **self.layout.convert(sample["__key__"], members)}
            except BadSample:
                continue


def _fits(sample: dict, max_length: int) -> bool:
    return len(sample["input_ids"]) <= max_length
