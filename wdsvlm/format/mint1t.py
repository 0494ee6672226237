"""MINT-1T's WebDataset tars as published (its PDF subsets, ``mlfoundations/MINT-1T-PDF-CC-*``
on the Hugging Face Hub), read as documents in place.

A sample there is two members:

- ``KEY.json``: the document in OBELICS's shape: ``texts`` and ``images``, two lists of equal
  length in reading order, each position holding exactly one of a text or an image's name
  (``page_P_image_X``: object ``X`` of the PDF's page ``P``); ``image_metadata``, one entry per
  image (``page``, ``xref``, ``sha256``, ``width``, ``height``); and the PDF's own fields
  (``url``, ``pdf_name``, language scores...).
- ``KEY.tiff``: the document's images, one TIFF frame each, in the order of
  ``image_metadata``.

``document`` makes wdsvlm's document of them (``format/documents.py``): its texts and images
as elements in reading order, each image the frame of its ``image_metadata`` entry (matched by
page and xref; where the JSON names no such entry, the image's place among the document's
images), stored as its own uncompressed TIFF ``KEY.n.tiff`` (orientation applied), numbered in
element order; the JSON's other fields are kept in the record. It decodes every frame it keeps
(a frame is only reachable decoded), so ``wdsvlm index`` and the reader, which both call it,
keep the same images.

A sample whose structure is wrong is a ``BadSample``: no JSON (``missing_json``), JSON that
does not parse (``invalid_json``), ``texts``/``images`` that are not two lists of equal length
with exactly one entry per position (``bad_document``), no text (``missing_text``). An image
that cannot be had (no image member, no such frame, a frame that does not decode) is left out
of its document and counted (``Document.dropped``); the document is kept.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from PIL import Image, ImageOps

from ..errors import InputError
from .documents import check_elements, document_json
from .images import BAD_IMAGE_ERRORS
from .members import IMAGE, BadSample, media_name, members_of_kind

_IMAGE_NAME = re.compile(r"page_(\d+)_image_(\d+)")
_FRAME_ERRORS = (*BAD_IMAGE_ERRORS, EOFError)


@dataclass(frozen=True)
class Document:
    """A tar sample made a document (or a caption): wdsvlm's own ``members`` (``json``,
    ``0.tiff``...), its ``elements`` as the record holds them, and the images left out
    (``(reason, message)`` each)."""

    members: dict[str, bytes]
    elements: list[dict]
    dropped: list[tuple[str, str]] = field(default_factory=list)


def record(members: Mapping[str, bytes]) -> dict:
    """The sample's ``json`` member, parsed; ``BadSample`` if there is none or it is no JSON
    object."""
    if "json" not in members:
        raise BadSample("missing_json", f"no json member among {sorted(members)}")
    try:
        doc = json.loads(members["json"].decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadSample("invalid_json", f"its json member is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise BadSample("invalid_json", "its json member is not a JSON object")
    return doc


def is_mint1t(doc: Mapping[str, Any]) -> bool:
    """Whether a parsed JSON member has MINT-1T's parallel ``texts`` and ``images`` lists."""
    texts, images = doc.get("texts"), doc.get("images")
    return (
        isinstance(texts, list)
        and isinstance(images, list)
        and len(texts) == len(images)
        and all(t is None or isinstance(t, str) for t in texts)
        and all(i is None or isinstance(i, str) for i in images)
    )


def reading_order(doc: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``("text", text)`` and ``("image", name)`` in reading order; ``BadSample`` where the
    lists are not two of equal length with exactly one string per position, or hold no
    text."""
    texts, images = doc.get("texts"), doc.get("images")
    if not isinstance(texts, list) or not isinstance(images, list):
        raise BadSample("bad_document", "its json has no 'texts' and 'images' lists")
    if len(texts) != len(images):
        raise BadSample(
            "bad_document", f"'texts' has {len(texts)} entries and 'images' {len(images)}"
        )
    order = []
    for i, (text, image) in enumerate(zip(texts, images, strict=True)):
        if (text is None) == (image is None):
            which = "neither a text nor an image" if text is None else "both a text and an image"
            raise BadSample("bad_document", f"position {i} holds {which}")
        value = text if image is None else image
        if not isinstance(value, str):
            raise BadSample("bad_document", f"position {i} holds {value!r}, not a string")
        order.append(("text", text) if image is None else ("image", image))
    if not any(kind == "text" and value.strip() for kind, value in order):
        raise BadSample("missing_text", "the document has no text")
    return order


def _frame_numbers(doc: Mapping[str, Any], names: list[str]) -> list[int]:
    """Each image's frame of the TIFF: its entry's place in ``image_metadata`` (by page and
    xref), else its place among the document's images."""
    places: dict[tuple, int] = {}
    metadata = doc.get("image_metadata")
    for n, entry in enumerate(metadata if isinstance(metadata, list) else []):
        if isinstance(entry, Mapping):
            places.setdefault((entry.get("page"), entry.get("xref")), n)
    numbers = []
    for order, name in enumerate(names):
        match = _IMAGE_NAME.fullmatch(name)
        place = places.get((int(match[1]), int(match[2]))) if match else None
        numbers.append(order if place is None else place)
    return numbers


def frame_bytes(img: Image.Image, number: int) -> bytes:
    """Frame ``number`` of an open multi-frame image, decoded and stored alone as an
    uncompressed TIFF, orientation applied; Pillow's error where it cannot be had."""
    img.seek(number)
    frame = ImageOps.exif_transpose(img)  # decodes it, as a copy
    if frame.mode not in ("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "I;16", "I", "F"):
        frame = frame.convert("RGBA" if "A" in frame.getbands() else "RGB")
    out = io.BytesIO()
    frame.save(out, format="TIFF", compression="raw")  # not the frame's own: a copy keeps it
    return out.getvalue()


def document(key: str, members: Mapping[str, bytes]) -> Document:
    """The document of a MINT-1T sample given its members by suffix (see the module)."""
    doc = record(members)
    order = reading_order(doc)
    names = [value for kind, value in order if kind == "image"]
    frames = _frame_numbers(doc, names)
    found = members_of_kind(members, IMAGE)  # the reader's rule; two are ambiguous_images
    if len(found) > 1:
        raise BadSample(
            "ambiguous_images", f"image members {found}: MINT-1T keeps a document's in one TIFF"
        )
    img, trouble = None, None
    if names and not found:
        trouble = ("missing_image", f"no image member holds its images (among {sorted(members)})")
    elif names:
        try:
            img = Image.open(io.BytesIO(members[found[0]]))
        except _FRAME_ERRORS as e:
            trouble = ("unreadable_image", f"its {found[0]} does not open: {e}")
    out: dict[str, bytes] = {}
    elements: list[dict] = []
    dropped: list[tuple[str, str]] = []
    image = 0
    try:
        for kind, value in order:
            if kind == "text":
                elements.append({"text": value})
                continue
            place = len(dropped) + image
            if trouble is not None:
                dropped.append((trouble[0], f"image {place} ({value}): {trouble[1]}"))
                continue
            frame = frames[place]
            try:
                data = frame_bytes(img, frame)
            except EOFError:
                message = f"image {place} ({value}): {found[0]} has no frame {frame}"
                dropped.append(("missing_image", message))
                continue
            except _FRAME_ERRORS as e:
                message = f"image {place} ({value}): frame {frame} does not decode: {e}"
                dropped.append(("unreadable_image", message))
                continue
            out[media_name(image, "tiff")] = data
            elements.append({"image": image})
            image += 1
    finally:
        if img is not None:
            img.close()
    try:
        elements = check_elements(elements, image, key)
    except InputError as e:
        raise BadSample(e.reason, e.message) from None
    extra = {k: v for k, v in doc.items() if k not in ("texts", "images")}
    out["json"] = document_json(key, "document", elements, extra=extra)
    return Document(out, elements, dropped)
