"""The writer's input of documents and captions: OBELICS, MMC4 and LLaVA-Pretrain rows made
into records of ``format.documents`` (``kind`` and ``elements`` in reading order).

- ``obelics`` (OBELICS's layout; JSON Lines or Parquet): ``texts`` and ``images``, two lists of
  one length with exactly one non-null entry per position, read in that order; ``metadata``
  and ``general_metadata`` kept in the record as they are. An image is a path (under
  ``--image-root``), a URL (fetched, or found in an img2dataset folder: ``image_folder``) or,
  in Parquet, a ``{bytes, path}`` struct as ``datasets`` stores an ``Image``.
- ``mmc4`` (MMC4's JSON Lines): ``text_list`` sentences and ``image_info`` entries, each image
  found by its ``image_name`` under ``--image-root`` (or its ``raw_url`` in an img2dataset
  folder) and placed before its ``matched_text_index`` sentence, as OpenFlamingo places it;
  an image whose ``matched_sim`` is under ``min_sim`` is left out (``below_min_sim``). The
  sentences between two images are one text, joined by a space.
- ``llava-pretrain`` (LLaVA-Pretrain's ``blip_laion_cc_sbu_558k.json``, and ReCap's Parquet):
  ``image`` and ``conversations``; a caption: the image, then the first ``gpt`` turn's value.

A row of the wrong structure raises ``InputError`` (``bad_document``, ``missing_text``). An
image is never a reason to refuse a row: one that cannot be had is dropped when the record is
checked (``document_check``), its reason counted.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import InputError
from ..format.documents import check_elements
from ..storage.fs import join
from .image_folder import Unavailable, image_folder
from .parquet import Embedded

LAYOUTS = ("obelics", "mmc4", "llava-pretrain")
"""The input layouts of documents and captions (``--format``)."""
KIND_OF_LAYOUT = {"obelics": "document", "mmc4": "document", "llava-pretrain": "caption"}
MIN_SIM = 0.24
"""MMC4's image-sentence similarity under which an image is left out: OpenFlamingo's default
(``--mmc4_textsim_threshold``)."""
OBELICS_KEPT = ("metadata", "general_metadata")
MMC4_KEPT = ("url",)


@dataclass(frozen=True)
class DocumentOptions:
    """How images of documents and captions are found and kept."""

    image_folder: str | None = None
    """A folder img2dataset wrote: images given as URLs are taken from there."""
    min_sim: float = MIN_SIM
    """MMC4: an image whose ``matched_sim`` is under this is left out."""
    storage_options: Mapping[str, Any] | None = None

    def __post_init__(self):
        if not isinstance(self.min_sim, (int, float)) or math.isnan(self.min_sim):
            raise ValueError(f"min_sim must be a number, not {self.min_sim!r}")


def detect_layout(raw: Any) -> str | None:
    """The document layout of a row by its fields, or None (a conversation's, or unknown):
    ``text_list`` and ``image_info`` (MMC4), or ``texts`` of strings and nulls beside
    ``images`` (OBELICS; Cauldron's ``texts`` are turns, dicts)."""
    if not isinstance(raw, Mapping):
        return None
    if "text_list" in raw and "image_info" in raw:
        return "mmc4"
    texts = raw.get("texts")
    if "images" in raw and isinstance(texts, list):
        if all(t is None or isinstance(t, str) for t in texts):
            return "obelics"
    return None


def document_record(
    raw: Mapping,
    layout: str,
    where: str,
    record_id: Any,
    source: str,
    image_root: str,
    origin: tuple | None,
    options: DocumentOptions | None = None,
) -> dict:
    """A row of ``layout`` as the writer's record: ``{"where", "id", "source", "kind",
    "elements", "images", "data", "extra", "dropped"}``, ``images`` every image the row gives
    (a path or URL, ``Embedded``, ``image_folder``'s reference, or ``Unavailable``), numbered
    in ``elements`` in reading order, ``data`` the bytes of those embedded in Parquet,
    ``dropped`` the images left out already (``below_min_sim``), ``joiner`` what joins two
    texts that meet once an image between them is dropped (MMC4's sentences: a space; None:
    they stay two). ``InputError`` naming ``where`` if the row's structure is wrong."""
    options = options or DocumentOptions()
    images: list = []
    data: list = []

    def image(value: Any, column: str, item: int | None, url: str | None = None) -> dict:
        ref, embedded = _image_ref(value, column, item, url, where, image_root, origin, options)
        images.append(ref)
        data.append(embedded)
        return {"image": len(images) - 1}

    dropped: Counter = Counter()
    if layout == "obelics":
        elements = _obelics(raw, where, image)
        extra = {k: raw[k] for k in OBELICS_KEPT if raw.get(k) is not None}
    elif layout == "mmc4":
        elements = _mmc4(raw, where, image, options.min_sim, dropped)
        extra = {k: raw[k] for k in MMC4_KEPT if raw.get(k) is not None}
    elif layout == "llava-pretrain":
        elements = _llava_pretrain(raw, where, image)
        extra = {}
    else:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    kind = KIND_OF_LAYOUT[layout]
    check_elements(elements, len(images), where, kind)
    return {
        "where": where,
        "id": record_id,
        "source": source,
        "kind": kind,
        "elements": elements,
        "images": images,
        "data": data if any(d is not None for d in data) else None,
        "videos": [],
        "extra": extra,
        "dropped": dropped,
        "joiner": " " if layout == "mmc4" else None,
    }


def _obelics(raw: Mapping, where: str, image) -> list[dict]:
    texts, images = raw.get("texts"), raw.get("images")
    if not isinstance(texts, list) or not isinstance(images, list):
        raise InputError(where, "bad_document", "'texts' and 'images' must both be lists")
    if len(texts) != len(images):
        raise InputError(
            where,
            "bad_document",
            f"'texts' and 'images' differ in length ({len(texts)} and {len(images)}): each "
            "position holds a text or an image",
        )
    elements = []
    for n, (text, img) in enumerate(zip(texts, images, strict=True)):
        if text is not None and img is not None:
            raise InputError(where, "bad_document", f"position {n} has both a text and an image")
        if text is None and img is None:
            raise InputError(where, "bad_document", f"position {n} has neither a text nor an image")
        if text is not None:
            if not isinstance(text, str):
                raise InputError(where, "bad_document", f"position {n}'s text is not a string")
            elements.append({"text": text})
        else:
            elements.append(image(img, "images", n))
    return elements


def _mmc4(raw: Mapping, where: str, image, min_sim: float, dropped: Counter) -> list[dict]:
    sentences, infos = raw.get("text_list"), raw.get("image_info")
    if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
        raise InputError(where, "bad_document", "'text_list' must be a list of sentences")
    if not isinstance(infos, list):
        raise InputError(where, "bad_document", "'image_info' must be a list")
    before: dict[int, list] = {}  # sentence -> the images placed before it, in order
    for n, info in enumerate(infos):
        at = info.get("matched_text_index") if isinstance(info, Mapping) else None
        if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at < len(sentences):
            raise InputError(
                where,
                "bad_document",
                f"image_info {n}: matched_text_index {at!r} is not a sentence of the "
                f"{len(sentences)} in text_list",
            )
        if not isinstance(info.get("image_name"), str) or not info["image_name"]:
            raise InputError(where, "bad_document", f"image_info {n} has no image_name")
        sim = info.get("matched_sim")
        if isinstance(sim, bool) or not isinstance(sim, (int, float)):
            raise InputError(where, "bad_document", f"image_info {n}: matched_sim {sim!r}")
        if sim < min_sim:
            dropped["below_min_sim"] += 1
            continue
        before.setdefault(at, []).append(info)
    elements, run = [], []
    for n, sentence in enumerate(sentences):
        if n in before and run:
            elements.append({"text": " ".join(run)})
            run = []
        for info in before.get(n, ()):
            elements.append(image(info["image_name"], "image_info", None, info.get("raw_url")))
        run.append(sentence)
    if run:
        elements.append({"text": " ".join(run)})
    return elements


def _llava_pretrain(raw: Mapping, where: str, image) -> list[dict]:
    turns = raw.get("conversations")
    if not isinstance(turns, list):
        raise InputError(where, "bad_document", "'conversations' must be a list of turns")
    answers = [
        t.get("value")
        for t in turns
        if isinstance(t, Mapping) and str(t.get("from", "")).lower() in ("gpt", "assistant")
    ]
    caption = answers[0] if answers else None
    if not isinstance(caption, str) or not caption.strip():
        raise InputError(where, "missing_text", "no caption: the first 'gpt' turn's value")
    value = raw.get("image")
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not values:
        raise InputError(where, "bad_document", "a caption needs its 'image'")
    listed = isinstance(value, list)
    elements = [image(v, "image", k if listed else None) for k, v in enumerate(values)]
    return [*elements, {"text": caption}]


def _image_ref(
    value: Any,
    column: str,
    item: int | None,
    url: str | None,
    where: str,
    image_root: str,
    origin: tuple | None,
    options: DocumentOptions,
) -> tuple[Any, bytes | None]:
    """An image's reference and, where a Parquet row embeds it, its bytes."""
    if isinstance(value, Mapping) and value.get("bytes") is not None:
        if origin is None:
            raise InputError(where, "bad_document", "image bytes can be embedded only in Parquet")
        return Embedded(*origin, column, item), bytes(value["bytes"])
    if isinstance(value, Mapping):  # a {bytes, path} struct with no bytes: its path
        value = value.get("path")
    if not isinstance(value, str) or not value:
        raise InputError(where, "bad_document", f"image entry {value!r} is not a path or URL")
    if options.image_folder is not None and (url or _is_web_url(value)):
        folder = image_folder(options.image_folder, options.storage_options)
        return folder.find(url or value), None
    if "://" in value or os.path.isabs(value):
        return value, None
    return join(image_root, value), None


def _is_web_url(value: str) -> bool:
    return value.startswith(("http://", "https://"))


__all__ = [
    "LAYOUTS",
    "MIN_SIM",
    "DocumentOptions",
    "Unavailable",
    "detect_layout",
    "document_record",
]
