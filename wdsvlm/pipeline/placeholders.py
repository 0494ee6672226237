"""Placeholders: the ids that stand for each image and video, put in place of the one token
the chat template puts where it goes (or, for a processor that writes a video's prompt into
the text, the prompt put in the text before it is tokenized); and why a sample's videos
cannot be tokenized by a family."""

from __future__ import annotations

from typing import Any

import numpy as np

IGNORE_INDEX = -100


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
