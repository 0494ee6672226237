"""Conversations as wdsvlm keeps them, from the record formats it reads.

A conversation is ``[{"role": "system"|"user"|"assistant", "content": str}, ...]``: an
optional system turn first, then user and assistant turns by turns, each user turn answered.
Three record formats hold one, told apart by their fields: LLaVA's ``conversations``
(``[{from, value}]``), Cauldron's ``texts`` (``[{user, assistant}]``) and ``messages``
(``[{role, content}]``, a content a string or a list of text and image parts).

Image placement is kept as ``<image>`` markers in the message content, one per image, in the
order of the images (``<video>`` likewise for videos). A marker is a placeholder only in a
record that carries media of its kind: in a record with no video, ``<video>`` is text ("What
does the HTML <video> tag do?"), written and trained on as such; in a record with videos,
every ``<video>`` is one, and they must be one per video. A conversation that has no markers of
a kind it has media of gets them at the start of its first user turn; one whose marker count
differs from its media count of that kind is refused (a literal tag cannot be told from a
placeholder there). The writer reads records this way, the reader of tars that hold such
records in a JSON member, and the tokenizer stage counts placeholders by the same rule
(``check_markers``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ..errors import InputError

IMAGE_MARKER = "<image>"
VIDEO_MARKER = "<video>"
RECORD_FORMATS = ("llava", "cauldron", "messages")

_FORMAT_FIELDS = {"conversations": "llava", "texts": "cauldron", "messages": "messages"}
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "system": "system",
}


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


def conversation_of(doc: Any, where: str) -> list[dict]:
    """The checked messages of one record of any of the formats (told apart by its fields),
    without placing images."""
    if not isinstance(doc, Mapping):
        raise InputError(where, "bad_record", f"expected a JSON object, got {type(doc).__name__}")
    fmt = next((f for name, f in _FORMAT_FIELDS.items() if name in doc), None)
    if fmt is None:
        raise InputError(where, "bad_record", "none of 'conversations', 'texts', 'messages'")
    messages = parse_messages(doc, fmt, where)
    check_turns(messages, where)
    return messages


def parse_messages(raw: Mapping, fmt: str, where: str) -> list[dict]:
    """The messages of a record of format ``fmt`` (one of ``RECORD_FORMATS``), their turns
    not yet checked; ``InputError`` naming ``where`` if they are malformed."""
    return _PARSERS[fmt](raw, where)


def _llava(raw: Mapping, where: str) -> list[dict]:
    conversations = raw.get("conversations")
    if not isinstance(conversations, list) or not conversations:
        raise InputError(where, "bad_record", "'conversations' must be a non-empty list")
    messages = []
    for n, turn in enumerate(conversations, start=1):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise InputError(where, "bad_record", f"turn {n} needs 'from' and a string 'value'")
        role = _ROLES.get(str(turn.get("from", "")).lower())
        if role is None:
            raise InputError(
                where,
                "bad_record",
                f"turn {n} has unknown role {turn.get('from')!r} "
                f"(expected one of {', '.join(sorted(_ROLES))})",
            )
        messages.append({"role": role, "content": turn["value"]})
    return messages


def _cauldron(raw: Mapping, where: str) -> list[dict]:
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
    return messages


def _messages(raw: Mapping, where: str) -> list[dict]:
    """``messages``: ``[{"role", "content"}]``, a content a string or a list of parts
    (``{"type": "text", "text"}``, ``{"type": "image"}``: an image marker in its place)."""
    turns = raw.get("messages")
    if not isinstance(turns, list) or not turns:
        raise InputError(where, "bad_record", "'messages' must be a non-empty list")
    messages = []
    for n, turn in enumerate(turns, start=1):
        role = _ROLES.get(str(turn.get("role", "")).lower()) if isinstance(turn, Mapping) else None
        if role is None:
            raise InputError(
                where, "bad_record", f"message {n} needs a role of user/assistant/system"
            )
        messages.append({"role": role, "content": _content(turn.get("content"), n, where)})
    return messages


def _content(content: Any, n: int, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "image":
                parts.append(IMAGE_MARKER)
            elif kind == "video":
                parts.append(VIDEO_MARKER)
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise InputError(where, "bad_record", f"message {n}: unknown content part {part!r}")
        return "".join(parts)
    raise InputError(
        where, "bad_record", f"message {n}: content must be a string or a list of parts"
    )


_PARSERS = {"llava": _llava, "cauldron": _cauldron, "messages": _messages}


def check_turns(messages: list[dict], where: str) -> None:
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


_MARKER = re.compile(f"{re.escape(IMAGE_MARKER)}|{re.escape(VIDEO_MARKER)}")


def media_order(messages: list[dict], n_images: int, n_videos: int) -> list[str]:
    """``"image"`` or ``"video"`` for each placeholder of a conversation with ``n_images``
    images and ``n_videos`` videos, in order (markers of a kind it has none of are text)."""
    kinds = {
        IMAGE_MARKER: "image" if n_images else None,
        VIDEO_MARKER: "video" if n_videos else None,
    }
    found = (kinds[marker] for m in messages for marker in _MARKER.findall(m["content"]))
    return [kind for kind in found if kind is not None]


def marker_counts(messages: list[dict]) -> tuple[int, int]:
    """``(<image> markers, <video> markers)`` in the conversation's text."""
    images = sum(m["content"].count(IMAGE_MARKER) for m in messages)
    return images, sum(m["content"].count(VIDEO_MARKER) for m in messages)


def check_markers(messages: list[dict], n_images: int, n_videos: int, where: str) -> None:
    """``InputError`` (``image_count_mismatch``, ``video_count_mismatch``) unless the markers
    of each kind the record has media of are one per medium; markers of a kind it has none
    of are text, never counted."""
    for marker, found, count in _placeholders(messages, n_images, n_videos):
        if found != count:
            raise _mismatch(where, marker, found, count)


def _mismatch(where: str, marker: str, found: int, count: int) -> InputError:
    kind = marker.strip("<>")
    message = f"{found} {marker} placeholder(s) in the text but {count} {kind}(s)"
    return InputError(where, f"{kind}_count_mismatch", message)


def _placeholders(messages: list[dict], n_images: int, n_videos: int) -> list[tuple]:
    """``(marker, markers found, media count)`` of each kind the record has media of: only
    those markers are placeholders."""
    images, videos = marker_counts(messages)
    kinds = ((VIDEO_MARKER, videos, n_videos), (IMAGE_MARKER, images, n_images))
    return [kind for kind in kinds if kind[2]]


def place_images(messages: list[dict], n_images: int, where: str, n_videos: int = 0) -> None:
    """One ``<image>`` marker per image and one ``<video>`` marker per video. A kind whose
    markers the text lacks gets them at the start of the first user turn (videos first); a
    record of videos and no images whose ``<image>`` markers are one per video (as
    LLaVA-Video writes them) has them read as ``<video>``. ``InputError`` when the text has
    markers of a kind it has media of but not one per medium; markers of a kind it has no
    media of are text, left as they are."""
    images, videos = marker_counts(messages)
    if n_videos and not n_images and not videos and images == n_videos:
        for m in messages:
            m["content"] = m["content"].replace(IMAGE_MARKER, VIDEO_MARKER)
        return
    head = ""
    for marker, found, count in _placeholders(messages, n_images, n_videos):
        if found == count:
            continue
        if found:
            raise _mismatch(where, marker, found, count)
        head += marker * count
    if head:
        first_user = next(m for m in messages if m["role"] == "user")
        first_user["content"] = head + "\n" + first_user["content"]


def messages_of(record: dict) -> list[dict]:
    """The record's ``messages`` as ``{"role", "content"}`` dicts; ``KeyError``, ``TypeError``
    or ``ValueError`` where they are missing or not of that form, or a content is not text."""
    messages = [{"role": m["role"], "content": m["content"]} for m in record["messages"]]
    if not all(isinstance(m["content"], str) for m in messages):
        raise TypeError("message content must be a string")
    return messages
