"""The writer's input: JSON, JSON Lines and Parquet files of LLaVA, Cauldron or ``messages``
records, made into one form.

Every record becomes a plain dict ``{"where", "id", "source", "messages", "images",
"videos"}`` where ``messages`` is a conversation as ``format.conversation`` keeps it
(``<image>`` and ``<video>`` markers in place) and ``images`` and ``videos`` the paths or URLs
of its files, resolved against the image root, in order (images and videos embedded in
Parquet: ``parquet.Embedded`` references, the images' bytes under ``data``). A record's videos
are its ``video`` (one, or a list) or else its ``videos``, as LLaVA-Video writes them; a video
given as a list of image files is its frames (``Frames``), at the record's ``fps``.

Documents and captions (OBELICS, MMC4, LLaVA-Pretrain rows) become records of their own form,
made in ``documents``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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
from .documents import LAYOUTS, DocumentOptions, detect_layout, document_record
from .parquet import Embedded, is_parquet, iter_parquet

log = logging.getLogger("wdsvlm.inputs")

FORMATS = ("auto", *RECORD_FORMATS, *LAYOUTS)
FRAME_FILES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


@dataclass(frozen=True)
class Frames:
    """A video given as its frames: their image files (resolved), in order, and its frame
    rate."""

    files: tuple[str, ...]
    fps: float

    def __str__(self) -> str:
        return f"the {len(self.files)} frames from {self.files[0]}" if self.files else "no frames"


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
    documents: DocumentOptions | None = None,
) -> Iterator[dict | InputError]:
    """Yield every record of one input file, normalized, or the ``InputError`` it raised.

    ``path`` is a JSON file holding a list of records, a JSON Lines file, or a Parquet file
    in the Hugging Face datasets layout (images as ``{bytes, path}`` structs or lists of
    them), local or any fsspec URL. Relative image paths are resolved against
    ``image_root``, by default the folder of ``path``. A record's images embedded in Parquet
    come as ``Embedded`` references, their bytes under ``data``. ``found`` gets the format
    of ``path`` (its name: the one given, or the one ``auto`` detected). ``documents``: how
    the images of documents and captions are found (``documents.DocumentOptions``).
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
            fmt = detect_layout(raw) or detect_format(raw, path)
            log.info("%s: format %s (by its first record's fields)", path, fmt)
        if found is not None:
            found[path] = fmt
        yield normalize(raw, fmt, where, path, image_root, origin, documents)


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
    raw: Any,
    fmt: str,
    where: str,
    path: str,
    image_root: str | None,
    origin=None,
    documents: DocumentOptions | None = None,
) -> dict | InputError:
    """One raw record (a JSON object or a Parquet row) of the file ``path`` in the writer's
    form, or its error. ``image_root``: where relative image paths start (default: the
    file's folder); ``origin``: a Parquet row's ``(path, row group, row in it)``; a
    document's or caption's (``fmt`` one of ``documents.LAYOUTS``) is made there."""
    if image_root is None:
        image_root = _folder(path)
    try:
        name = os.path.basename(path)
        return _normalize(raw, fmt, where, name, image_root, origin, documents)
    except InputError as e:
        return e


def _folder(path: str) -> str:
    return path.rsplit("/", 1)[0] if "://" in path else os.path.dirname(path) or "."


def _normalize(
    raw: Any,
    fmt: str,
    where: str,
    name: str,
    image_root: str,
    origin: tuple | None = None,
    documents: DocumentOptions | None = None,
) -> dict:
    if not isinstance(raw, dict):
        raise InputError(where, "bad_record", f"expected a JSON object, got {type(raw).__name__}")
    record_id = raw.get("id")
    if record_id is None:  # a Parquet row has every column, null where it has no id
        record_id = f"{name}:{where.rsplit(' ', 1)[-1]}"
    else:
        record_id = record_id if isinstance(record_id, (str, int)) else str(record_id)
        where = f"{where} (id {record_id!r})"
    if fmt in LAYOUTS:
        source = str(raw.get("source") or _default_source(name, origin))
        args = (raw, fmt, where, record_id, source, image_root, origin, documents)
        return document_record(*args)
    messages = parse_messages(raw, fmt, where)
    images = _images_of(raw)
    videos = _videos_of(raw, where)
    source = raw.get("source")
    if not source and fmt == "cauldron":
        texts = raw.get("texts") or [{}]
        source = texts[0].get("source") if isinstance(texts[0], dict) else None
    source = source or raw.get("data_source") or _default_source(name, origin)
    check_turns(messages, where)
    place_images(messages, len(images), where, n_videos=len(videos))
    record = {
        "where": where,
        "id": record_id,
        "source": str(source),
        "messages": messages,
        "images": [_resolve(p, image_root, where) if not _embedded(p) else None for p in images],
        "videos": [_video(v, k, image_root, where, origin, raw) for k, v in enumerate(videos)],
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


def _video_column(raw: Mapping) -> str:
    return "video" if raw.get("video") is not None else "videos"


def _videos_of(raw: Mapping, where: str) -> list:
    """The record's videos: its ``video`` (one, or a list) or else its ``videos``; a list of
    image files is one video's frames (a list of such lists, several videos), each with its
    frame rate from the record's ``fps`` (one for all, or a list, one per video)."""
    videos = _as_list(raw.get(_video_column(raw)))
    if videos and all(_frame_file(v) for v in videos):
        videos = [videos]  # "video": ["f000.jpg", ...]: one video, its frames
    elif any(_frame_file(v) for v in videos):
        raise InputError(
            where,
            "bad_record",
            "its videos mix image files (frames) and video files: a list of frames must "
            "name image files only",
        )
    framed = [v for v in videos if isinstance(v, list)]
    if not framed:
        return videos
    rates = raw.get("fps")
    rates = rates if isinstance(rates, list) else [rates] * len(videos)
    if len(rates) != len(videos):
        raise InputError(
            where, "bad_record", f"{len(rates)} frame rates (fps) for {len(videos)} videos"
        )
    out = []
    for n, (video, fps) in enumerate(zip(videos, rates, strict=True)):
        if not isinstance(video, list):
            out.append(video)
            continue
        if not video or not all(_frame_file(f) for f in video):
            raise InputError(
                where, "bad_record", f"video {n}: a list of frames must name image files only"
            )
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < math.inf:
            raise InputError(
                where,
                "bad_record",
                f"video {n} is given as {len(video)} frames: its frame rate is needed "
                f"(the record's fps, a positive number, not {fps!r})",
            )
        out.append(Frames(tuple(video), float(fps)))
    return out


def _frame_file(value: Any) -> bool:
    """Whether ``value`` names an image file (a URL's query left aside)."""
    return isinstance(value, str) and value.split("?", 1)[0].lower().endswith(FRAME_FILES)


def _video(video: Any, k: int, root: str, where: str, origin: tuple | None, raw: Mapping) -> Any:
    """A video's reference: its file or URL resolved, its frames' files resolved, or where
    a Parquet row embeds its bytes."""
    if isinstance(video, Frames):
        files = tuple(_resolve(f, root, where, "frame") for f in video.files)
        return Frames(files, video.fps)
    if _embedded(video):
        if origin is None:
            raise InputError(where, "bad_record", "video bytes can be embedded only in Parquet")
        column = _video_column(raw)
        return Embedded(*origin, column, k if isinstance(raw.get(column), list) else None)
    return _resolve(video, root, where, "video")


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return value if isinstance(value, list) else [value]


def _resolve(image: Any, image_root: str, where: str, kind: str = "image") -> str:
    if isinstance(image, Mapping):  # a {bytes, path} struct with no bytes: its path
        image = image.get("path")
    if not isinstance(image, str) or not image:
        raise InputError(where, "bad_record", f"{kind} entry {image!r} is not a path")
    if "://" in image or os.path.isabs(image):
        return image
    return join(image_root, image)
