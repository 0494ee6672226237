"""The writer's input formats: LLaVA-style and Cauldron-style records, made into one form.

Every record becomes a plain dict ``{"where", "id", "source", "messages", "images"}`` where
``messages`` is ``[{"role": "system"|"user"|"assistant", "content": str}, ...]`` and
``images`` the image paths or URLs, resolved against the image root, in order.

Image placement is kept as ``<image>`` markers in the message content, one per image, in the
order of the images. A source that has no markers gets them at the start of its first user
turn; a source whose marker count differs from its image count is refused.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import fsspec

from ..errors import InputError
from ..storage.fs import join

log = logging.getLogger("wdsvlm.inputs")

IMAGE_MARKER = "<image>"
FORMATS = ("auto", "llava", "cauldron", "messages")

_LLAVA_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


def is_parquet(path: str) -> bool:
    return path.lower().endswith((".parquet", ".pq"))


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
        image_root = path.rsplit("/", 1)[0] if "://" in path else os.path.dirname(path) or "."
    name = os.path.basename(path)
    fmt = None if format == "auto" else format
    raws = _iter_parquet if is_parquet(path) else _iter_raw
    for where, raw, origin in raws(path, storage_options):
        if isinstance(raw, InputError):
            yield raw
            continue
        try:
            if fmt is None:
                fmt = detect_format(raw, path)
                log.info("%s: format %s (by its first record's fields)", path, fmt)
            if found is not None:
                found[path] = fmt
            yield _normalize(raw, fmt, where, name, image_root, origin)
        except InputError as e:
            yield e


def detect_format(raw: Any, path: str) -> str:
    """The format of a record by its fields: ``conversations`` (LLaVA), ``texts``
    (Cauldron) or ``messages`` (roles and contents)."""
    if isinstance(raw, Mapping):
        for name, fmt in _FORMAT_FIELDS.items():
            if name in raw:
                return fmt
    raise ValueError(
        f"cannot tell the format of {path}: its first record has none of 'conversations' "
        "(LLaVA), 'texts' (Cauldron) or 'messages'; pass --format llava, cauldron or messages"
    )


_FORMAT_FIELDS = {"conversations": "llava", "texts": "cauldron", "messages": "messages"}


def conversation_of(doc: Any, where: str) -> list[dict]:
    """The checked messages of one record of any of the formats (told apart by its fields),
    without placing images."""
    if not isinstance(doc, Mapping):
        raise InputError(where, "bad_record", f"expected a JSON object, got {type(doc).__name__}")
    fmt = next((f for name, f in _FORMAT_FIELDS.items() if name in doc), None)
    if fmt is None:
        raise InputError(where, "bad_record", "none of 'conversations', 'texts', 'messages'")
    messages, _ = _PARSERS[fmt](doc, where)
    _check_turns(messages, where)
    return messages


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


def _iter_parquet(
    path: str, storage_options=None, groups: Sequence[int] | None = None, first_row: int = 0
) -> Iterator[tuple[str, Any, tuple]]:
    """``(where, row as a dict, (path, row group, row in it))`` for each row of a Parquet
    file (of its row ``groups``, the first of them starting at row ``first_row``), read
    ``_BATCH_ROWS`` rows at a time, whatever the file's size."""
    with open_parquet(path, storage_options) as parquet:
        row = first_row
        for group in range(parquet.num_row_groups) if groups is None else groups:
            i = 0  # row in the group
            for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, row_groups=[group]):
                for raw in batch.to_pylist():
                    yield f"{path} row {row}", raw, (path, group, i)
                    row += 1
                    i += 1


_BATCH_ROWS = 64


@contextmanager
def open_parquet(path: str, storage_options=None):
    """A ``pyarrow.parquet.ParquetFile`` of ``path`` (local or any fsspec URL), its errors
    named with the file."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"{path}: Parquet input needs pyarrow: pip install 'wdsvlm[parquet]'"
        ) from None
    try:
        f = fsspec.open(path, "rb", **(storage_options or {})).open()
    except FileNotFoundError:
        raise FileNotFoundError(f"input file {path} not found") from None
    with f:
        try:
            parquet = pq.ParquetFile(f)
        except Exception as e:  # noqa: BLE001 - pyarrow's errors: named with the file
            raise ValueError(f"{path} is not a readable Parquet file: {e}") from None
        yield parquet


def parquet_format(parquet, path: str) -> str:
    """A Parquet file's format from its columns' names (no row read)."""
    return detect_format({name: None for name in parquet.schema_arrow.names}, path)


def normalize(
    raw: Any, fmt: str, where: str, path: str, image_root: str | None, origin=None
) -> dict | InputError:
    """One raw record (a JSON object or a Parquet row) in the writer's form, or its error."""
    if image_root is None:
        image_root = path.rsplit("/", 1)[0] if "://" in path else os.path.dirname(path) or "."
    try:
        return _normalize(raw, fmt, where, os.path.basename(path), image_root, origin)
    except InputError as e:
        return e


@dataclass(frozen=True)
class Embedded:
    """An image embedded in a Parquet input: row ``row`` of row group ``group`` of ``path``,
    its ``column`` (item ``item`` of it when the column holds a list). The writer reads the
    bytes again from there when it writes the shard, so no image bytes wait in memory."""

    path: str
    group: int
    row: int
    column: str
    item: int | None

    def __str__(self) -> str:
        item = "" if self.item is None else f"[{self.item}]"
        return f"{self.path} row group {self.group} row {self.row} {self.column}{item}"

    def read(self, storage_options: Mapping[str, Any] | None = None) -> bytes:
        value = _row_group_column(self.path, self.group, self.column, storage_options)[self.row]
        if self.item is not None:  # this image of the row's list, not the whole row
            value = value.values[self.item]
        return value["bytes"].as_py()


_groups: OrderedDict[tuple, Any] = OrderedDict()  # the last row groups read, per process


def _row_group_column(path: str, group: int, column: str, storage_options) -> list:
    key = (path, group, column)
    if key in _groups:
        _groups.move_to_end(key)
        return _groups[key]
    with open_parquet(path, storage_options) as parquet:
        values = parquet.read_row_group(group, columns=[column])[column]
    _groups[key] = values  # Arrow's buffers: no Python object per image until asked for
    while len(_groups) > 2:
        _groups.popitem(last=False)
    return values


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
    messages, images = _PARSERS[fmt](raw, where)
    source = raw.get("source")
    if not source and fmt == "cauldron":
        texts = raw.get("texts") or [{}]
        source = texts[0].get("source") if isinstance(texts[0], dict) else None
    source = source or raw.get("data_source") or _default_source(name, origin)
    _check_turns(messages, where)
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


def _llava(raw: dict, where: str) -> tuple[list[dict], list]:
    conversations = raw.get("conversations")
    if not isinstance(conversations, list) or not conversations:
        raise InputError(where, "bad_record", "'conversations' must be a non-empty list")
    messages = []
    for n, turn in enumerate(conversations, start=1):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise InputError(where, "bad_record", f"turn {n} needs 'from' and a string 'value'")
        role = _LLAVA_ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise InputError(
                where,
                "bad_record",
                f"turn {n} has unknown role {turn.get('from')!r} "
                f"(expected one of {', '.join(sorted(_LLAVA_ROLES))})",
            )
        messages.append({"role": role, "content": turn["value"]})
    return messages, _images_of(raw)


def _cauldron(raw: dict, where: str) -> tuple[list[dict], list]:
    texts = raw.get("texts")
    if not isinstance(texts, list) or not texts:
        raise InputError(where, "bad_record", "'texts' must be a non-empty list of turns")
    messages = []
    if isinstance(raw.get("system"), str) and raw["system"]:
        messages.append({"role": "system", "content": raw["system"]})
    for n, turn in enumerate(texts, start=1):
        if not isinstance(turn, dict) or not isinstance(turn.get("user"), str):
            raise InputError(where, "bad_record", f"text {n} needs a string 'user'")
        answer = turn.get("assistant")
        if not isinstance(answer, str) or not answer.strip():
            raise InputError(where, "no_assistant_answer", f"text {n} has no assistant answer")
        messages.append({"role": "user", "content": turn["user"]})
        messages.append({"role": "assistant", "content": answer})
    return messages, _images_of(raw)


def _messages(raw: Mapping, where: str) -> tuple[list[dict], list]:
    """``messages``: ``[{"role", "content"}]``, a content a string or a list of parts
    (``{"type": "text", "text"}``, ``{"type": "image"}``: an image marker in its place)."""
    turns = raw.get("messages")
    if not isinstance(turns, list) or not turns:
        raise InputError(where, "bad_record", "'messages' must be a non-empty list")
    messages = []
    for n, turn in enumerate(turns, start=1):
        role = (
            _LLAVA_ROLES.get(str(turn.get("role", "")).lower())
            if isinstance(turn, Mapping)
            else None
        )
        if role is None:
            raise InputError(
                where, "bad_record", f"message {n} needs a role of user/assistant/system"
            )
        messages.append({"role": role, "content": _content(turn.get("content"), n, where)})
    return messages, _images_of(raw)


def _content(content: Any, n: int, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "image":
                parts.append(IMAGE_MARKER)
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise InputError(where, "bad_record", f"message {n}: unknown content part {part!r}")
        return "".join(parts)
    raise InputError(
        where, "bad_record", f"message {n}: content must be a string or a list of parts"
    )


_PARSERS = {"llava": _llava, "cauldron": _cauldron, "messages": _messages}


def _check_turns(messages: list[dict], where: str) -> None:
    """An optional system turn first, then user and assistant turns by turns, each answered."""
    expected = "user"
    for n, message in enumerate(messages, start=1):
        role = message["role"]
        if role == "system":
            if n != 1:
                raise InputError(where, "bad_record", f"turn {n}: a system turn must come first")
            continue
        if role != expected:
            if expected == "assistant":
                raise InputError(
                    where, "no_assistant_answer", f"user turn {n - 1} has no assistant answer"
                )
            raise InputError(where, "bad_record", f"turn {n} is an answer to no user turn")
        if role == "assistant" and not message["content"].strip():
            raise InputError(where, "no_assistant_answer", f"assistant turn {n} is empty")
        expected = "assistant" if role == "user" else "user"
    if expected == "assistant":
        raise InputError(where, "no_assistant_answer", "the last user turn has no assistant answer")
    if not any(m["role"] == "user" for m in messages):
        raise InputError(where, "bad_record", "no user turn")


def place_images(messages: list[dict], n_images: int, where: str) -> None:
    markers = sum(m["content"].count(IMAGE_MARKER) for m in messages)
    if markers == n_images:
        return
    if markers == 0:
        first_user = next(m for m in messages if m["role"] == "user")
        first_user["content"] = IMAGE_MARKER * n_images + "\n" + first_user["content"]
        return
    raise InputError(
        where,
        "image_count_mismatch",
        f"{markers} {IMAGE_MARKER} placeholder(s) in the text but {n_images} image(s)",
    )


def _resolve(image: Any, image_root: str, where: str) -> str:
    if isinstance(image, Mapping):  # a {bytes, path} struct with no bytes: its path
        image = image.get("path")
    if not isinstance(image, str) or not image:
        raise InputError(where, "bad_record", f"image entry {image!r} is not a path")
    if "://" in image or os.path.isabs(image):
        return image
    return join(image_root, image)
