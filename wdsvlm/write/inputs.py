"""The writer's input: JSON, JSON Lines and Parquet files of LLaVA, Cauldron or ``messages``
records, made into one form.

Every record becomes a plain dict ``{"where", "id", "source", "messages", "images"}`` where
``messages`` is a conversation as ``format.conversation`` keeps it (``<image>`` markers in
place) and ``images`` the image paths or URLs, resolved against the image root, in order
(images embedded in Parquet: ``parquet.Embedded`` references, their bytes under ``data``).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec

from ..errors import InputError
from ..format.conversation import (
    RECORD_FORMATS,
    check_turns,
    detect_format,
    parse_messages,
    place_images,
)
from ..storage.fs import join
from .parquet import Embedded, is_parquet, iter_parquet

log = logging.getLogger("wdsvlm.inputs")

FORMATS = ("auto", *RECORD_FORMATS)


def expand_inputs(inputs: list[str], storage_options=None) -> list[str]:
    """Input files with their globs expanded (sorted), local or any fsspec URL."""
    out = []
    for pattern in inputs:
        if not any(c in pattern for c in "*?["):
            out.append(pattern)
            continue
        fs, path = fsspec.core.url_to_fs(pattern, **(storage_options or {}))
        found = sorted(fs.glob(path))
        if not found:
            raise FileNotFoundError(f"no input files match {pattern}")
        protocol = pattern.split("://", 1)[0] + "://" if "://" in pattern else ""
        out += [protocol + p if protocol and "://" not in p else p for p in found]
    return out


def iter_records(
    path: str,
    *,
    format: str = "auto",
    image_root: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
    found: dict | None = None,
) -> Iterator[dict | InputError]:
    """Yield every record of one input file, normalized, or the ``InputError`` it raised.

    ``path`` is a JSON file holding a list of records, a JSON Lines file, or a Parquet file
    in the Hugging Face datasets layout (images as ``{bytes, path}`` structs or lists of
    them), local or any fsspec URL. Relative image paths are resolved against
    ``image_root``, by default the folder of ``path``. A record's images embedded in Parquet
    come as ``Embedded`` references, their bytes under ``data``. ``found`` gets the format
    of ``path`` (its name: the one given, or the one ``auto`` detected).
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
    if image_root is None:
        image_root = _folder(path)
    fmt = None if format == "auto" else format
    raws = iter_parquet if is_parquet(path) else _iter_raw
    for where, raw, origin in raws(path, storage_options):
        if isinstance(raw, InputError):
            yield raw
            continue
        if fmt is None:
            fmt = detect_format(raw, path)
            log.info("%s: format %s (by its first record's fields)", path, fmt)
        if found is not None:
            found[path] = fmt
        yield normalize(raw, fmt, where, path, image_root, origin)


def _iter_raw(path: str, storage_options=None) -> Iterator[tuple[str, Any, None]]:
    """``(where, parsed JSON or InputError, None)`` for each record of a JSON or JSON Lines
    file."""
    name = os.path.basename(path)
    try:
        with fsspec.open(path, "rb", **(storage_options or {})) as f:
            data = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"input file {path} not found") from None
    text = data.decode("utf-8-sig")
    if text.lstrip()[:1] == "[":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
        for i, raw in enumerate(records):
            yield f"{name} record {i}", raw, None
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name} line {lineno}"
        try:
            yield where, json.loads(line), None
        except json.JSONDecodeError as e:
            yield where, InputError(where, "invalid_json", f"invalid JSON: {e}"), None


def normalize(
    raw: Any, fmt: str, where: str, path: str, image_root: str | None, origin=None
) -> dict | InputError:
    """One raw record (a JSON object or a Parquet row) of the file ``path`` in the writer's
    form, or its error. ``image_root``: where relative image paths start (default: the
    file's folder); ``origin``: a Parquet row's ``(path, row group, row in it)``."""
    if image_root is None:
        image_root = _folder(path)
    try:
        return _normalize(raw, fmt, where, os.path.basename(path), image_root, origin)
    except InputError as e:
        return e


def _folder(path: str) -> str:
    return path.rsplit("/", 1)[0] if "://" in path else os.path.dirname(path) or "."


def _normalize(
    raw: Any, fmt: str, where: str, name: str, image_root: str, origin: tuple | None = None
) -> dict:
    if not isinstance(raw, dict):
        raise InputError(where, "bad_record", f"expected a JSON object, got {type(raw).__name__}")
    record_id = raw.get("id")
    if record_id is None:  # a Parquet row has every column, null where it has no id
        record_id = f"{name}:{where.rsplit(' ', 1)[-1]}"
    else:
        record_id = record_id if isinstance(record_id, (str, int)) else str(record_id)
        where = f"{where} (id {record_id!r})"
    messages = parse_messages(raw, fmt, where)
    images = _images_of(raw)
    source = raw.get("source")
    if not source and fmt == "cauldron":
        texts = raw.get("texts") or [{}]
        source = texts[0].get("source") if isinstance(texts[0], dict) else None
    source = source or raw.get("data_source") or _default_source(name, origin)
    check_turns(messages, where)
    place_images(messages, len(images), where)
    record = {
        "where": where,
        "id": record_id,
        "source": str(source),
        "messages": messages,
        "images": [_resolve(p, image_root, where) if not _embedded(p) else None for p in images],
    }
    if any(_embedded(p) for p in images):
        if origin is None:
            raise InputError(where, "bad_record", "image bytes can be embedded only in Parquet")
        column = _image_column(raw)
        listed = isinstance(raw.get(column), list)
        record["data"] = [bytes(p["bytes"]) if _embedded(p) else None for p in images]
        record["images"] = [
            Embedded(*origin, column, k if listed else None) if _embedded(p) else ref
            for k, (p, ref) in enumerate(zip(images, record["images"], strict=True))
        ]
    return record


def _embedded(image: Any) -> bool:
    return isinstance(image, Mapping) and image.get("bytes") is not None


_SPLIT_FILE = re.compile(r"(train|test|validation|val|dev)(-\d+-of-\d+)?", re.I)


def _default_source(name: str, origin: tuple | None) -> str:
    """A record's source when it names none: its file's name, or for a Parquet file named
    by its split (``train-00000-of-00004.parquet``, as the Hub names them) its folder's."""
    stem = os.path.splitext(name)[0]
    if origin is not None and _SPLIT_FILE.fullmatch(stem):
        folder = os.path.basename(os.path.dirname(origin[0].rstrip("/")))
        return folder or stem
    return stem


def _image_column(raw: Mapping) -> str:
    return "image" if raw.get("image") is not None else "images"


def _images_of(raw: Mapping) -> list:
    """The record's images: its ``image`` (one, or a list) or else its ``images``."""
    return _as_list(raw.get(_image_column(raw)))


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _resolve(image: Any, image_root: str, where: str) -> str:
    if isinstance(image, Mapping):  # a {bytes, path} struct with no bytes: its path
        image = image.get("path")
    if not isinstance(image, str) or not image:
        raise InputError(where, "bad_record", f"image entry {image!r} is not a path")
    if "://" in image or os.path.isabs(image):
        return image
    return join(image_root, image)
