"""Placeholders: the ids that stand for each image and video, put in place of the one token
the chat template puts where it goes (or, for a processor that writes a video's prompt into
the text, the prompt put in the text before it is tokenized); markers that stand for nothing
kept as text; and why a sample's videos cannot be tokenized by a family.

A ``<video>`` or ``<image>`` marker is a placeholder only in a sample that has media of its
kind (``format.conversation``); elsewhere it is text, and is trained on as the text it is. It
goes through the family's chat template as a stand-in of the same length that no template or
processor takes for a placeholder (``as_text``), is put back in the rendered text
(``text_markers``), and where the tokenizer's vocabulary has the marker as a token of its own
(``<image>`` is one in many), that token is replaced by the marker's text tokens
(``text_tokens``), so no image or video token stands for nothing.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..format.conversation import IMAGE_MARKER, VIDEO_MARKER, check_markers

IGNORE_INDEX = -100
# Noncharacters (never in text that is interchanged) around the kind's name: as long as the
# marker, so the character ranges found in the rendered text hold once it is put back.
_STAND_INS = {IMAGE_MARKER: "\ufdd0image\ufdd1", VIDEO_MARKER: "\ufdd0video\ufdd1"}
_MARKERS = {stand_in: marker for marker, stand_in in _STAND_INS.items()}
_STAND_IN = re.compile("|".join(map(re.escape, _MARKERS)))


def as_text(messages: list[dict], images: int, videos: int) -> list[dict]:
    """``messages`` of a sample with ``images`` images and ``videos`` videos, each marker of a
    kind it has none of written as its stand-in: text to the chat template. ``InputError``
    (``check_markers``) where the placeholders of a kind it has are not one per medium."""
    check_markers(messages, images, videos, "the sample")
    text = [
        marker for marker, count in ((IMAGE_MARKER, images), (VIDEO_MARKER, videos)) if not count
    ]
    if not any(marker in m["content"] for m in messages for marker in text):
        return messages
    out = []
    for m in messages:
        content = m["content"]
        for marker in text:
            content = content.replace(marker, _STAND_INS[marker])
        out.append({**m, "content": content})
    return out


def text_markers(text: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered ``text`` with its stand-ins put back as the markers they were, and where
    each lies (``(start, end)``, the same in both)."""
    spans = [(m.start(), m.end()) for m in _STAND_IN.finditer(text)]
    if not spans:
        return text, []
    return _STAND_IN.sub(lambda m: _MARKERS[m.group()], text), spans


def text_tokens(
    ids: np.ndarray, offsets: np.ndarray, text: str, spans, tokenizer: Any
) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` and their character ``offsets`` in ``text`` with each token that is the
    vocabulary's own marker token (``<image>`` is one in many) at a marker of ``spans``
    replaced by the text tokens of what it covers (``split_special_tokens``), their offsets
    within it. The token is found by its id and by its offsets overlapping the marker's, not
    by equal offsets: an added token that strips the whitespace beside it (``lstrip`` /
    ``rstrip``), or a tokenizer that gives it the space before it, covers more than the
    marker."""
    out_ids, out_offsets, at = [], [], 0
    for a, b in spans:
        marker = marker_token_ids(tokenizer, text[a:b])
        over = (offsets[:, 0] < b) & (offsets[:, 1] > a) & np.isin(ids, marker)
        found = np.flatnonzero(over)
        found = found[found >= at]  # a token already replaced stays replaced
        if not len(found):  # tokenized as text already
            continue
        k = int(found[0])
        start, end = int(offsets[k, 0]), int(offsets[k, 1])
        piece = tokenizer(
            text[start:end],
            add_special_tokens=False,
            split_special_tokens=True,
            return_offsets_mapping=True,
        )
        out_ids += [ids[at:k], np.asarray(piece["input_ids"], dtype=np.int64)]
        moved = np.asarray(piece["offset_mapping"], dtype=np.int64).reshape(-1, 2) + start
        out_offsets += [offsets[at:k], moved]
        at = k + 1
    if not out_ids:
        return ids, offsets
    out_ids.append(ids[at:])
    out_offsets.append(offsets[at:])
    return np.concatenate(out_ids).astype(np.int64), np.concatenate(out_offsets).astype(np.int64)


def marker_token_ids(tokenizer: Any, marker: str) -> list[int]:
    """The id the vocabulary has for ``marker`` as a token of its own, if it has one (a piece
    of the vocabulary that holds the marker and more is not the image token: it stays)."""
    found = tokenizer.convert_tokens_to_ids(marker)
    return [] if found is None or found == getattr(tokenizer, "unk_token_id", None) else [found]


def expand(
    ids: np.ndarray, labels: np.ndarray, pieces: list[tuple[int, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """``ids`` and ``labels`` with the token at each ``place`` of ``pieces`` (``(place,
    piece ids)``, in any order) replaced by its piece's ids (labelled -100), and where each
    piece's ids start, in the order of ``pieces``."""
    if not pieces:
        return ids, labels, []
    order = sorted(range(len(pieces)), key=lambda k: pieces[k][0])
    out_ids, out_labels, starts = [], [], [0] * len(pieces)
    at = length = 0
    for k in order:
        place, piece = pieces[k]
        out_ids += [ids[at:place], piece]
        out_labels += [labels[at:place], np.full(len(piece), IGNORE_INDEX)]
        length += place - at
        starts[k] = int(length)
        length += len(piece)
        at = place + 1
    out_ids.append(ids[at:])
    out_labels.append(labels[at:])
    return (
        np.concatenate(out_ids).astype(np.int64, copy=False),
        np.concatenate(out_labels).astype(np.int64, copy=False),
        starts,
    )


def expand_text(
    text: str, token: str, prompts: list[str], ranges: list[tuple[int, int]]
) -> tuple[str, list[tuple[int, int]], list[tuple[int, int]]]:
    """``text`` with its occurrences of ``token``, in order, replaced by ``prompts`` (as a
    processor that writes a video's prompt into the text does); the character ``ranges`` (of
    the answers) moved with the text, and each prompt's ``(start, end)`` in the new text."""
    if text.count(token) != len(prompts):
        raise ValueError(
            f"{text.count(token)} video tokens after templating, {len(prompts)} videos"
        )
    out, spans, moves = [], [], []  # moves: (old position, shift from there on)
    at = shift = 0
    for prompt in prompts:
        found = text.index(token, at)
        out += [text[at:found], prompt]
        start = found + shift
        spans.append((start, start + len(prompt)))
        shift += len(prompt) - len(token)
        moves.append((found + len(token), shift))
        at = found + len(token)
    out.append(text[at:])

    def moved(position: int) -> int:
        return position + next((s for p, s in reversed(moves) if position >= p), 0)

    return "".join(out), [(moved(a), moved(b)) for a, b in ranges], spans


def in_spans(offsets: np.ndarray, spans) -> np.ndarray:
    """Which tokens (by their character ``offsets``) lie inside one of ``spans``."""
    inside = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        inside |= (offsets[:, 0] >= a) & (offsets[:, 1] <= b) & (offsets[:, 1] > 0)
    return inside


def span_starts(offsets: np.ndarray, spans) -> np.ndarray:
    """The first token of each of ``spans`` (by the tokens' character ``offsets``)."""
    return np.asarray([int(np.argmax(offsets[:, 1] > a)) for a, _ in spans], dtype=np.int64)


def video_refusal(family: Any, videos: list, images: int) -> tuple[str, str] | None:
    """Why a sample with ``videos`` (what the index records of each) and ``images`` cannot be
    tokenized by ``family``: ``(reason, message)``, or None."""
    video = getattr(family, "video", None)
    if videos and video is None:
        why = getattr(family, "no_video", "it has no video side")
        return "video_not_supported", f"the {family.name} family takes no video: {why}"
    for n, info in enumerate(videos):
        try:
            video.frames(info)
        except ValueError as e:  # e.g. fewer frames than the processor's num_frames
            return "unsampleable_video", f"video {n}: the video processor cannot sample it: {e}"
    if videos and images and not video.with_images:
        why = f"the {family.name} processor takes images or videos in a sample, not both"
        return "video_not_supported", why
    return None
