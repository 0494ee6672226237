"""A document's or caption's record checked into the sample the writer writes.

Each image is read and probed as a conversation's are; one that cannot be had (not found, not
readable, not decodable, not downloaded by img2dataset) is not a reason to refuse the record:
it is dropped from the elements, the images after it renumbered (two texts that meet are
joined where the layout says how: MMC4's sentences), and counted by reason in
the sample's ``dropped`` (web documents lose many images; the text stays trainable). A caption
left with no image is not written at all (``left_out``), its image counted the same way.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ..errors import StorageError
from ..format.documents import IMAGE_ELEMENT, document_json, element_numbers
from ..format.images import UnreadableImage, probe_image, stored_bytes
from ..storage.fs import read_bytes
from .image_folder import Unavailable

log = logging.getLogger("wdsvlm.write")


def check_document(record: dict, storage_options: Mapping[str, Any] | None = None) -> dict:
    """The sample of a document's or caption's ``record`` (``documents.document_record``):
    ``{"where", "json", "source", "images", "videos", "media", "chars", "kind", "elements",
    "dropped"}``, ``elements`` the numbers the index keeps; or, for a caption whose image was
    dropped, ``{"where", "left_out": True, "kind", "dropped"}``."""
    where = record["where"]
    dropped = Counter(record.get("dropped") or {})
    embedded = record.get("data") or [None] * len(record["images"])
    kept: list[tuple | None] = []
    for n, (ref, data) in enumerate(zip(record["images"], embedded, strict=True)):
        checked = _check_image(ref, data, storage_options)
        if isinstance(checked, Unavailable):
            dropped[checked.reason] += 1
            log.info("%s: image %d dropped (%s): %s", where, n, checked.reason, checked.message)
            kept.append(None)
        else:
            kept.append(checked)
    elements, images = [], []
    joiner = record.get("joiner")
    for element in record["elements"]:
        if "image" not in element:
            if joiner is not None and elements and "text" in elements[-1]:
                element = {"text": elements.pop()["text"] + joiner + element["text"]}
            elements.append(element)
        elif kept[element["image"]] is not None:
            elements.append({"image": len(images)})
            images.append(kept[element["image"]])
    kind = record["kind"]
    if kind == "caption" and not images:
        return {"where": where, "left_out": True, "kind": kind, "dropped": dropped}
    numbers = element_numbers(elements)
    text = document_json(record["id"], kind, elements, record["source"], record.get("extra"))
    return {
        "where": where,
        "json": text,
        "source": record["source"],
        "images": images,
        "videos": [],
        "media": None,
        "chars": [n for n in numbers if n != IMAGE_ELEMENT],
        "kind": kind,
        "elements": numbers,
        "dropped": dropped,
    }


def _check_image(ref: Any, data: bytes | None, storage_options) -> tuple | Unavailable:
    """``(reference, ImageInfo, stored size)`` of one image, or why it is dropped."""
    if isinstance(ref, Unavailable):
        return ref
    if data is None:
        try:
            data = image_data(ref, storage_options)
        except FileNotFoundError:
            return Unavailable("missing_image", f"{ref} not found")
        except (OSError, StorageError) as e:
            return Unavailable("unreadable_image", f"{ref} cannot be read: {e}")
    try:
        info = probe_image(data)
    except UnreadableImage as e:
        return Unavailable("unreadable_image", f"{ref} is not a decodable image: {e}")
    size = len(stored_bytes(data, info)) if info.reencoded else len(data)
    return ref, info, size


def image_data(ref: Any, storage_options=None) -> bytes:
    """An image's bytes from its file or URL, or from where it is stored inside another file
    (a Parquet row, a tar member: references with a ``read``)."""
    if isinstance(ref, str):
        return read_bytes(ref, storage_options)
    return ref.read(storage_options)
