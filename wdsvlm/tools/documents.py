"""Documents and captions as ``wdsvlm inspect`` shows them: each element in reading order,
each image in its place, and, with a tokenizer, where the Loader cuts the document into pieces
(``pipeline/documents.py``) and which images it drops for fitting no piece.

The pieces are the real ones: the document is tokenized by the Loader's own ``Tokenize`` with
the ``max_length`` and vision budget given, and its elements are then laid over the pieces'
tokens (a text's tokens fill each piece to its length; an image is in the piece that holds it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from ..families.tiling import ImageConfig, tile_count
from ..format.documents import SEPARATOR, check_elements
from ..pipeline.placeholders import IGNORE_INDEX


@dataclass
class Part:
    """One line of a document as shown: a text element (or the part of it a piece holds), an
    image, the separator between two texts, or the tokenizer's BOS or EOS."""

    kind: str  # "text", "image", "separator", "bos", "eos"
    number: int = 0  # the text's element number, or the image's number
    text: str = ""
    chars: int = 0
    tokens: tuple[int, int, int] | None = None  # a text's (first, end, of all) tokens here
    size: tuple[int, int] = (0, 0)
    units: int = 0
    image_tokens: int | None = None
    dropped: str | None = None  # why the image fits no piece

    def line(self, unit_name: str, max_chars: int) -> str:
        if self.kind == "separator":
            return f"[separator {SEPARATOR!r}]"
        if self.kind in ("bos", "eos"):
            return f"[{self.kind.upper()} {self.text}]"
        if self.kind == "image":
            w, h = self.size
            cost = counted(self.units, unit_name)
            if self.image_tokens is not None:
                cost += f" / {self.image_tokens} tokens"
            if self.dropped:
                return f"[image {self.number}: {w}x{h} px, DROPPED: {cost} alone, {self.dropped}]"
            return f"[image {self.number}: {w}x{h} px, {cost}]"
        text = self.text
        if len(text) > max_chars:
            text = text[:max_chars] + f"... ({len(self.text) - max_chars} more chars)"
        if self.tokens is None:
            how = f"{self.chars} chars"
        elif self.tokens[:2] == (0, self.tokens[2]):
            how = f"{self.chars} chars, {self.tokens[2]} tokens"
        else:
            first, end, total = self.tokens
            how = f"tokens {first}-{end} of {total}"
        return f"[text {self.number}, {how}] " + text.replace("\n", "\n    ")


@dataclass
class PieceShown:
    """One piece of a document: its numbers as the Loader makes it, and its parts."""

    number: int
    tokens: int
    image_tokens: int
    supervised: int
    units: int
    parts: list[Part] = field(default_factory=list)


@dataclass
class DocumentView:
    """A document or caption as ``inspect`` shows it: ``pieces`` with a tokenizer (cut at
    ``max_length`` and ``max_units``), else one piece of its elements with no token counts."""

    kind: str
    texts: int
    chars: int
    images: int
    pieces: list[PieceShown]
    tokenized: bool
    unit_name: str = "tiles"
    max_length: int | None = None
    max_units: int | None = None

    @property
    def dropped(self) -> list[Part]:
        return [p for piece in self.pieces for p in piece.parts if p.dropped]

    def lines(self, max_chars: int = 400) -> list[str]:
        head = (
            f"  {self.kind}: {_plural(self.texts, 'text')} ({self.chars} chars), "
            f"{_plural(self.images, 'image')}"
        )
        if self.tokenized:
            head += f"; {_plural(len(self.pieces), 'piece')}"
            head += f" at max_length {self.max_length}" if self.max_length else " (no max_length)"
            if self.max_units is not None:
                head += f", {self.max_units} {self.unit_name} a piece"
            if self.dropped:
                head += f"; {_plural(len(self.dropped), 'image')} dropped (over every budget)"
        lines = [head]
        for piece in self.pieces:
            if self.tokenized:
                units = counted(piece.units, self.unit_name)
                lines.append(
                    f"  --- piece {piece.number}: {piece.tokens} tokens ({piece.image_tokens} "
                    f"image, {piece.supervised} supervised), {units} ---"
                )
            lines += [f"  {part.line(self.unit_name, max_chars)}" for part in piece.parts]
        return lines

    def text(self) -> str:
        """The document as one string, each image as ``[image N]`` in its place (for the
        contact sheet)."""
        out, last = [], None
        for piece in self.pieces:
            for part in piece.parts:
                if part.kind == "text" and last is not None and last.number == part.number:
                    out[-1] += part.text  # the rest of a text cut between two pieces
                elif part.kind == "text":
                    out.append(part.text)
                elif part.kind == "image":
                    out.append(f"[image {part.number}{' dropped' if part.dropped else ''}]")
                last = part if part.kind == "text" else None
        return " ".join(out)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def counted(n: int, unit_name: str) -> str:
    """``"1 tile"``, ``"2 tiles"``, ``"1 patch"``: ``n`` of a family's vision units."""
    if n != 1:
        return f"{n} {unit_name}"
    return f"{n} {unit_name[:-2] if unit_name.endswith('ches') else unit_name[:-1]}"


def untokenized_view(
    kind: str, elements: list[dict], sizes: Sequence[tuple[int, int]], config: ImageConfig
) -> DocumentView:
    """A checked document's elements in order, images as the default tiling counts them."""
    parts = []
    for i, element in enumerate(elements):
        if "text" in element:
            parts.append(Part("text", i, element["text"], len(element["text"])))
            if i + 1 < len(elements) and "text" in elements[i + 1]:
                parts.append(Part("separator"))
        else:
            w, h = sizes[element["image"]]
            parts.append(
                Part("image", element["image"], size=(w, h), units=tile_count(w, h, config))
            )
    return _view(kind, elements, sizes, [PieceShown(0, 0, 0, 0, 0, parts)], False)


def document_view(
    sample: dict, record: dict, kind: str, tokenize: Any
) -> tuple[DocumentView | None, str | None]:
    """``sample`` (a document or caption whose JSON record is ``record``) as ``tokenize`` (the
    Loader's ``Tokenize``, with its ``max_length`` and vision budget) cuts it into pieces;
    ``(None, why)`` where the Loader would skip it."""
    documents = tokenize.documents
    stats = tokenize.stats  # shared by the samples shown: each reason is logged once

    def skipped(before: dict) -> str:
        new = [r for r, n in stats.counts.items() if n > before.get(r, 0)]
        return f"the loader would skip it: {', '.join(new) or 'not tokenized'}"

    before = dict(stats.counts)
    try:
        sizes = tokenize.sizes_of(dict(sample))
    except (OSError, ValueError) as e:  # an image header that does not parse
        return None, f"the loader would skip it: {type(e).__name__}: {e}"
    doc = documents.take(record, dict(sample), sizes, stats)
    if doc is None:
        return None, skipped(before)
    documents.encode([doc])
    pieces = tokenize.encode([dict(sample)], stats=stats)
    if not pieces:
        return None, skipped(before)
    shown = _laid_over(doc, pieces, documents, tokenize)
    view = _view(kind, doc.elements, sizes, shown, True)
    view.unit_name = tokenize.family.unit_name
    view.max_length, view.max_units = documents.max_length, documents.max_units
    return view, None


def _view(kind, elements, sizes, pieces, tokenized) -> DocumentView:
    texts = [e["text"] for e in elements if "text" in e]
    return DocumentView(kind, len(texts), sum(map(len, texts)), len(sizes), pieces, tokenized)


def _laid_over(doc: Any, pieces: list[dict], documents: Any, tokenize: Any) -> list[PieceShown]:
    """The document's elements laid over its ``pieces`` in order: a text fills each piece to
    its length and goes on in the next; an image is in the piece that holds it, or dropped."""
    tok, family = tokenize.tokenizer, tokenize.family
    shown = []
    for j, piece in enumerate(pieces):
        sizes = piece["__meta__"]["images"]
        alone = len(sizes) == 1
        shown.append(
            PieceShown(
                j,
                int(piece["num_tokens"]),
                sum(len(documents.block(w, h, alone)) for w, h in sizes),
                int((piece["labels"] != IGNORE_INDEX).sum()),
                int(sum(piece["image_tiles"])),
            )
        )
    home = {n: j for j, p in enumerate(pieces) for n in p["__meta__"]["document_images"]}
    items: list[tuple] = [("bos", -1, documents.bos)] if documents.bos else []
    texts = iter(doc.text_ids)
    for i, element in enumerate(doc.elements):
        items.append(("text", i, next(texts)) if "text" in element else ("image", element["image"]))
    if documents.eos:
        items.append(("eos", -1, documents.eos))
    current, used = 0, 0
    for item in items:
        if item[0] == "image":
            n = item[1]
            w, h = doc.sizes[n]
            if n not in home:
                shown[current].parts.append(_dropped(n, (w, h), documents, family))
                continue
            if home[n] != current:
                current, used = home[n], 0
            alone = len(pieces[current]["__meta__"]["images"]) == 1
            block = len(documents.block(w, h, alone))
            units = family.image_cost(w, h, alone)
            shown[current].parts.append(
                Part("image", n, size=(w, h), units=units, image_tokens=block)
            )
            used += block
            continue
        kind, number, ids = item
        total, first = len(ids), 0
        while first < total:
            room = shown[current].tokens - used
            if room <= 0 and current + 1 < len(shown):
                current, used = current + 1, 0
                continue
            end = first + max(room, 0) if current + 1 < len(shown) else total
            end = min(end, total)
            shown[current].parts.append(_text(kind, number, ids, first, end, doc, tok))
            used += end - first
            first = end
        if kind == "text" and _followed_by_text(doc.elements, number):
            parts = shown[current].parts
            parts[-1].text = parts[-1].text.removesuffix(SEPARATOR)
            parts.append(Part("separator"))
    return shown


def _followed_by_text(elements: list[dict], i: int) -> bool:
    return i + 1 < len(elements) and "text" in elements[i + 1]


def _text(kind: str, number: int, ids, first: int, end: int, doc: Any, tok: Any) -> Part:
    text = tok.decode(list(ids[first:end]))
    if kind != "text":
        return Part(kind, text=text)
    chars = len(doc.elements[number]["text"])
    return Part("text", number, text, chars, tokens=(first, end, len(ids)))


def _dropped(n: int, size: tuple[int, int], documents: Any, family: Any) -> Part:
    w, h = size
    tokens, units = len(documents.block(w, h, True)), family.image_cost(w, h, True)
    over = []
    if documents.max_length is not None and tokens > documents.max_length:
        over.append(f"over max_length {documents.max_length}")
    if documents.max_units is not None and units > documents.max_units:
        over.append(f"over the vision budget of {documents.max_units} {family.unit_name}")
    why = " and ".join(over) or "fits no piece"
    return Part("image", n, size=size, units=units, image_tokens=tokens, dropped=why)


def checked_elements(record: dict, kind: str, images: int, where: str) -> tuple[list, str | None]:
    """A record's elements checked as the Loader checks them; ``([], why)`` if they are not."""
    try:
        return check_elements(record.get("elements"), images, where, kind), None
    except InputError as e:
        return [], f"the loader would skip it: {e.reason} ({e.message})"
