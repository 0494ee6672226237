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
import os
from collections.abc import Iterator
from typing import Any

import fsspec

from .errors import InputError
from .storage import join

IMAGE_MARKER = "<image>"
FORMATS = ("auto", "llava", "cauldron")

_LLAVA_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


def iter_records(
    path: str, *, format: str = "auto", image_root: str | None = None
) -> Iterator[dict | InputError]:
    """Yield every record of one input file, normalized, or the ``InputError`` it raised.

    ``path`` is a JSON file holding a list of records or a JSON Lines file (local or any
    fsspec URL). Relative image paths are resolved against ``image_root``, by default the
    folder of ``path``.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
    if image_root is None:
        image_root = path.rsplit("/", 1)[0] if "://" in path else os.path.dirname(path) or "."
    name = os.path.basename(path)
    fmt = None if format == "auto" else format
    for where, raw in _iter_raw(path):
        if isinstance(raw, InputError):
            yield raw
            continue
        try:
            if fmt is None:
                fmt = detect_format(raw, path)
            yield _normalize(raw, fmt, where, name, image_root)
        except InputError as e:
            yield e


def detect_format(raw: Any, path: str) -> str:
    if isinstance(raw, dict):
        if "conversations" in raw:
            return "llava"
        if "texts" in raw:
            return "cauldron"
    raise ValueError(
        f"cannot tell the format of {path}: its first record has neither 'conversations' "
        "(LLaVA) nor 'texts' (Cauldron); pass --format llava or --format cauldron"
    )


def _iter_raw(path: str) -> Iterator[tuple[str, Any]]:
    """``(where, parsed JSON or InputError)`` for each record of a JSON or JSON Lines file."""
    name = os.path.basename(path)
    try:
        with fsspec.open(path, "rb") as f:
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
            yield f"{name} record {i}", raw
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name} line {lineno}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            yield where, InputError(where, "invalid_json", f"invalid JSON: {e}")


def _normalize(raw: Any, fmt: str, where: str, name: str, image_root: str) -> dict:
    if not isinstance(raw, dict):
        raise InputError(where, "bad_record", f"expected a JSON object, got {type(raw).__name__}")
    record_id = raw.get("id", f"{name}:{where.rsplit(' ', 1)[-1]}")
    where = f"{where} (id {record_id!r})" if "id" in raw else where
    if fmt == "llava":
        messages, images = _llava(raw, where)
        source = raw.get("source") or os.path.splitext(name)[0]
    else:
        messages, images = _cauldron(raw, where)
        texts = raw.get("texts") or [{}]
        source = raw.get("source") or texts[0].get("source") or os.path.splitext(name)[0]
    _check_turns(messages, where)
    _place_images(messages, len(images), where)
    return {
        "where": where,
        "id": record_id,
        "source": str(source),
        "messages": messages,
        "images": [_resolve(p, image_root, where) for p in images],
    }


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
    return messages, _as_list(raw.get("image", raw.get("images")))


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
    images = [
        img.get("path") if isinstance(img, dict) else img for img in _as_list(raw.get("images"))
    ]
    return messages, images


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


def _place_images(messages: list[dict], n_images: int, where: str) -> None:
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
    if not isinstance(image, str) or not image:
        raise InputError(where, "bad_record", f"image entry {image!r} is not a path")
    if "://" in image or os.path.isabs(image):
        return image
    return join(image_root, image)
