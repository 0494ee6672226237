"""Documents and captions: samples of text and images in one reading order, trained on as
they are (no chat template, no prompt).

A sample's ``KEY.json`` says its kind; without ``"kind"`` it is a conversation (``messages``,
``conversation.py``). A document or a caption holds ``elements`` instead, in reading order,
each either ``{"text": str}`` or ``{"image": n}``, the sample's image member ``KEY.n.*``; the
images are numbered in the order they appear (``0, 1, 2, ...``, each once)::

    {"id": "doc-17", "source": "obelics", "kind": "document",
     "elements": [{"text": "A title"}, {"image": 0}, {"text": "A paragraph..."}]}

- ``document``: an interleaved web document (OBELICS, MMC4, MINT-1T). It needs some text.
- ``caption``: an image-caption pair for pretraining: its images, then the caption.

Both are rendered the same way (``pipeline/documents.py``): each element in its place, text as
its own tokens, ``SEPARATOR`` between two texts that follow each other, an image as its
family's tokens; loss on the text, never on an image. Records may keep fields of their source
beside these (OBELICS's ``metadata`` and ``general_metadata``), which the Loader ignores.

The index keeps what planning and packing need without the tar: a document's entry has its
``kind`` and its ``elements`` as numbers (each text's characters, ``-1`` for an image), and
its images' sizes as every sample's do.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InputError

KINDS = ("conversation", "document", "caption")
"""What a sample is; its index entry says it by number (``KINDS.index``)."""
SEPARATOR = "\n\n"
"""What goes between two text elements that follow each other when a document is rendered."""
IMAGE_ELEMENT = -1
"""An image, among the numbers the index keeps of a document's elements."""


def kind_of(record: Mapping[str, Any]) -> str:
    """The kind of a sample's JSON record (``conversation`` where it says none)."""
    kind = record.get("kind", "conversation")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    return kind


def check_elements(elements: Any, images: int, where: str, kind: str = "document") -> list[dict]:
    """``elements`` as a document keeps them (``{"text"}`` / ``{"image"}`` dicts), checked
    against the sample's ``images`` image members; ``InputError`` naming ``where`` if they are
    not of that form (``bad_elements``), hold no text (``missing_text``) or number the images
    otherwise than ``0 .. images - 1`` in order (``image_count_mismatch``)."""
    if not isinstance(elements, list) or not elements:
        raise InputError(where, "bad_elements", "its elements are not a non-empty list")
    out, seen = [], 0
    for i, element in enumerate(elements):
        if not isinstance(element, Mapping) or len(element) != 1:
            raise InputError(
                where, "bad_elements", f"element {i} is not one {{'text'}} or {{'image'}}"
            )
        if "text" in element:
            if not isinstance(element["text"], str):
                raise InputError(where, "bad_elements", f"element {i}'s text is not a string")
            out.append({"text": element["text"]})
        elif "image" in element:
            if element["image"] != seen or isinstance(element["image"], bool):
                raise InputError(
                    where,
                    "image_count_mismatch",
                    f"element {i} is image {element['image']!r} where image {seen} comes next",
                )
            seen += 1
            out.append({"image": element["image"]})
        else:
            raise InputError(where, "bad_elements", f"element {i} is neither text nor image")
    if seen != images:
        raise InputError(
            where, "image_count_mismatch", f"{seen} image elements for {images} images"
        )
    if not any(e.get("text", "").strip() for e in out):
        raise InputError(where, "missing_text", f"the {kind} has no text")
    if kind == "caption" and any("image" in e for e in out[out.index(_first_text(out)) :]):
        raise InputError(where, "bad_elements", "a caption's images come before its text")
    return out


def _first_text(elements: Sequence[dict]) -> dict:
    return next(e for e in elements if "text" in e)


def element_numbers(elements: Sequence[Mapping[str, Any]]) -> list[int]:
    """What the index keeps of ``elements``: each text's characters, ``IMAGE_ELEMENT`` for an
    image."""
    return [len(e["text"]) if "text" in e else IMAGE_ELEMENT for e in elements]


def document_json(
    key: str,
    kind: str,
    elements: Sequence[Mapping[str, Any]],
    source: str = "",
    extra: Mapping[str, Any] | None = None,
) -> bytes:
    """A document's or caption's ``KEY.json``, as the writer writes it (``extra``: the
    source's own fields kept beside it)."""
    if kind not in KINDS[1:]:
        raise ValueError(f"kind must be document or caption, not {kind!r}")
    doc = {"id": key, "source": source, "kind": kind, "elements": list(elements)}
    doc.update({k: v for k, v in (extra or {}).items() if k not in doc})
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
