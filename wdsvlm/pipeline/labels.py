"""Which characters of a rendered conversation are supervised: each answer's text and the
end-of-turn token right after it, found in what the chat template made of the messages.

Where each message's text lies is read off a second rendering with a placeholder in place of
each text piece (``marked``; exact: a template's own text, such as a default system turn, is
never taken for a message's). A template that does not render messages verbatim (it trims or
rewrites them) is searched instead, each piece after the template's own text before it and
after the previous piece, so an answer quoted earlier in a question is not mistaken for the
answer. Pure functions: the rendering itself is the caller's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..errors import TemplateError

# A text piece's stand-in in the placeholder rendering (private-use characters: no template
# or tokenizer gives them a meaning).
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")


def text_pieces(messages: list[dict]) -> list[tuple[int, str]]:
    """``(message number, text)`` of every text piece: a string content, or each text item
    of a content list."""
    return [
        (n, piece)
        for n, m in enumerate(messages)
        for piece in (
            [m["content"]]
            if isinstance(m["content"], str)
            else [i["text"] for i in m["content"] if i.get("type") == "text"]
        )
    ]


def marked(messages: list[dict]) -> list[dict]:
    """The conversation with the placeholder of piece k in place of each text piece k (in
    ``text_pieces`` order), to be rendered as the skeleton ``answer_ranges`` reads."""
    count = iter(range(len(text_pieces(messages))))

    def mark(content):
        if isinstance(content, str):
            return _SENTINEL.format(next(count))
        return [
            {**i, "text": _SENTINEL.format(next(count))} if i.get("type") == "text" else i
            for i in content
        ]

    return [{**m, "content": mark(m["content"])} for m in messages]


def answer_ranges(
    text: str, messages: list[dict], skeleton: str | None, specials: Sequence[str]
) -> list[tuple[int, int]]:
    """Character ranges of the answers' text (each answer's last piece with its end-of-turn
    token) in ``text``, the rendered ``messages``. ``skeleton``: the rendering of
    ``marked(messages)`` (None when the template refused it); ``specials``: the tokenizer's
    special tokens, longest first (the end-of-turn token is the one right after an answer).
    A ``TemplateError`` when an answer cannot be found."""
    pieces = text_pieces(messages)
    starts = _placed(text, skeleton, pieces) or _searched(text, pieces, skeleton)
    by_message: dict[int, list[int]] = {}
    for k, (owner, _) in enumerate(pieces):
        by_message.setdefault(owner, []).append(k)
    ranges = []
    for n, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        mine = by_message.get(n, [])
        if not mine or any(starts[k] is None for k in mine):
            raise TemplateError(
                f"the chat template does not render assistant turn {n + 1} "
                "verbatim, so its tokens cannot be found for the labels"
            )
        for k in mine[:-1]:  # text pieces around images inside an answer
            ranges.append((starts[k], starts[k] + len(pieces[k][1])))
        at = starts[mine[-1]]
        end = at + len(pieces[mine[-1]][1])
        after = end + len(text[end:]) - len(text[end:].lstrip(" "))
        eot = next((s for s in specials if text.startswith(s, after)), None)
        ranges.append((at, after + len(eot) if eot else end))
    return ranges


def _placed(text: str, skeleton: str | None, pieces: list) -> list[int | None] | None:
    """Where each text piece starts in ``text``, read off the placeholder rendering; None
    when the template does not render the pieces verbatim (the rebuilt text differs)."""
    if skeleton is None:
        return None
    starts: list[int | None] = [None] * len(pieces)
    rebuilt, at, length = [], 0, 0
    for match in _SENTINEL_RE.finditer(skeleton):
        k = int(match.group(1))
        if k >= len(pieces) or starts[k] is not None:
            return None  # a piece rendered twice: the template is not plain
        lead = skeleton[at : match.start()]
        starts[k] = length + len(lead)
        rebuilt += [lead, pieces[k][1]]
        length += len(lead) + len(pieces[k][1])
        at = match.end()
    rebuilt.append(skeleton[at:])
    return starts if "".join(rebuilt) == text else None


def _searched(
    text: str, pieces: list[tuple[int, str]], skeleton: str | None = None
) -> list[int | None]:
    """Where each piece starts in ``text``, searched in order: after the previous piece
    found and, where the placeholder rendering says what template text comes right before
    the piece, after that text (None for a piece not found: a template may drop a system
    turn)."""
    lead: dict[int, str] = {}
    if skeleton is not None:
        parts = _SENTINEL_RE.split(skeleton)  # template text, piece number, template text, ...
        for i in range(1, len(parts), 2):
            lead.setdefault(int(parts[i]), parts[i - 1])
    starts: list[int | None] = []
    pos = 0
    for k, (_, piece) in enumerate(pieces):
        before = lead.get(k)
        if before:
            at = text.find(before, pos)
            pos = pos if at < 0 else at + len(before)
        at = text.find(piece, pos)
        starts.append(None if at < 0 else at)
        pos = pos if at < 0 else at + len(piece)
    return starts
