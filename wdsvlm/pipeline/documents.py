"""Documents and captions as token streams, cut into pieces that never cut an image.

A document (or caption, ``format/documents.py``) is rendered without a chat template, element
by element in reading order:

- the tokenizer's BOS first, where its tokenizer puts one before a text (Llama-style; Qwen's
  has none), and its EOS last, after the last element;
- each text as its own tokens (special tokens in it are text: a web page that writes
  ``<|image_pad|>`` gets no image), followed by ``SEPARATOR`` where a text comes next;
- each image as its family's tokens for it: the ids that replace the chat template's
  placeholder (``Family.image_token_ids``), inside the family's wrapper where it has one
  (``Family.image_wrap``): what the family's chat template writes for an image, so the
  document is what its processor makes of the text with the image written there. Qwen's
  is ``<|vision_start|>`` ... ``<|vision_end|>`` (which also keeps two images side by side
  two runs of image tokens); SmolVLM's and Idefics3's expansion holds its own
  ``<fake_token_around_image>`` and rows/cols, and LLaVA-OneVision's template writes its
  ``<image>`` alone (its image newlines are in the model's features), so they have none.

Labels: every text token and the EOS are supervised, but a piece's first token (nothing
before it in its own sequence predicts it), and never an image's tokens nor their wrapper.

A document longer than ``max_length`` tokens, or with more vision units than ``max_units``,
is cut into pieces, filled greedily in reading order: an image goes whole into the piece
being filled if it fits there, else starts the next one; a text fills what is left of the
piece at token boundaries and goes on in the next. An image that fits neither there nor in a
piece on its own is dropped whole and counted (``image_over_budget``, named ``SHARD/KEY.n``),
the rest of its document kept (a LLaVA-OneVision image too large alone as crops is kept as
one view beside the piece's other images, where they fit); so is one the family refuses
(``unusable_image``: Qwen's aspect ratio over 200). A last piece of one token (the EOS after
a text that filled its piece) would train on nothing: it takes the text's last token along.
Concatenated in order, the pieces are the whole document's tokens. Each piece is a sample of
its own (``__piece__``: its number), with its images only: it packs, decodes and runs through
the model as any sample, alone. An image's tokens depend on whether it is its sample's only
one (LLaVA-OneVision), so they are those of the piece it is in.

Where pieces go: a document's pieces leave the tokenizer one after another, in the worker
that read the document, and the packing window then places them as any samples: in that
worker's rows (so on one rank), not necessarily in consecutive rows or in order. Nothing
needs more: each piece is a sequence of its own (its positions restart, its first token is
not supervised), so no loss depends on another piece being next to it. What matters is that
no piece is lost or trained on twice, at a pass's end or on resume: a piece not yet yielded
is held by its place ``[pass, place, piece]`` in the saved state, and taken back alone.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import InputError
from ..format.documents import SEPARATOR, check_elements, kind_of
from ..format.images import UnusableImage, image_members
from ..format.members import media_number
from .placeholders import IGNORE_INDEX
from .stats import SkipStats, sample_name


class Document:
    """A document or caption taken in by ``Tokenize``: its sample, checked elements and its
    images' displayed sizes."""

    def __init__(self, sample: dict, elements: list[dict], sizes: list[tuple[int, int]]):
        self.sample = sample
        self.elements = elements
        self.sizes = sizes
        self.text_ids: list[np.ndarray] = []  # its texts' tokens (``Documents.encode``)
        self.image_numbers: dict[tuple, tuple[int, int]] = {}  # (w, h, alone): tokens, units


def elements_of(record: dict) -> list[dict]:
    """A document's or caption's elements as its record holds them (``KeyError`` without)."""
    return record["elements"]


def held(piece: dict) -> dict:
    """What a tokenizer batch keeps of a piece not yet yielded: its place."""
    names = ("__pass__", "__pos__", "__piece__", "__shard__", "__key__")
    return {k: piece[k] for k in names if k in piece}


class Documents:
    """Renders documents of ``family`` and cuts them into pieces of at most ``max_length``
    tokens and ``max_units`` vision units (None: no bound)."""

    def __init__(self, family: Any, max_length: int | None, max_units: int | None):
        tok = family.tokenizer
        self.family = family
        self.tokenizer = tok
        self.max_length = max_length
        self.max_units = max_units
        ids = tok("a")["input_ids"]
        bos = tok.bos_token_id
        self.bos = [bos] if bos is not None and ids[:1] == [bos] else []
        self.eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
        self.wrap = [tok.convert_tokens_to_ids(t) if t else None for t in family.image_wrap]
        self.separator = SEPARATOR

    def fingerprint_facts(self) -> list:
        """What decides how a document is rendered, for the resume check."""
        return [self.bos, self.eos, self.wrap, self.separator]

    def take(
        self, record: dict, sample: dict, sizes: list, stats: SkipStats, sample_map: Any = None
    ) -> Document | None:
        """The document of ``record`` (``sample``'s, its images displayed at ``sizes``),
        checked; None where it is malformed (counted in ``stats``). ``sample_map`` (the
        Loader's ``map=``) runs on the record first: what it returns is the record whose
        elements are used."""
        kind = kind_of(record)
        if sample_map is not None:
            elements = sample_map(record, sample, stats, elements_of)
            if elements is None:  # dropped or skipped, and counted
                return None
        else:
            elements = record.get("elements")
        try:
            checked = check_elements(elements, len(sizes), sample_name(sample), kind)
        except InputError as e:
            stats.skip("tokenize", e.reason, sample, e.message)
            return None
        return Document(sample, checked, [tuple(s) for s in sizes])

    def encode(self, docs: list[Document]) -> None:
        """Tokenize the texts of ``docs`` (in one call), kept as each one's ``text_ids``."""
        texts = [self.texts(doc) for doc in docs]
        flat = self.encode_texts([t for part in texts for t in part])
        at = 0
        for doc, part in zip(docs, texts, strict=True):
            doc.text_ids, at = flat[at : at + len(part)], at + len(part)

    def run(
        self, doc: Document, stats: SkipStats, rest: list | None, after: list
    ) -> Iterator[dict]:
        """The pieces of ``doc`` it asks for (all, or the one a saved state holds), with
        ``rest`` kept as what is not yet yielded: its later pieces (as places), then
        ``after``."""
        try:
            pieces = chosen(self.pieces(doc, doc.text_ids, stats), doc.sample)
        except InputError as e:
            stats.skip("tokenize", e.reason, doc.sample, e.message)
            if rest is not None:
                rest[:] = after
            return
        stats.ok("tokenize")
        for j, piece in enumerate(pieces):
            if rest is not None:
                rest[:] = [held(p) for p in pieces[j + 1 :]] + after
            yield piece

    def texts(self, doc: Document) -> list[str]:
        """The strings a document's texts are tokenized as, in order (``SEPARATOR`` after
        a text that another follows)."""
        out, elements = [], doc.elements
        for i, element in enumerate(elements):
            if "text" in element:
                following = i + 1 < len(elements) and "text" in elements[i + 1]
                out.append(element["text"] + (self.separator if following else ""))
        return out

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        if not texts:
            return []
        encoded = self.tokenizer(texts, add_special_tokens=False, split_special_tokens=True)
        return [np.asarray(ids, dtype=np.int64) for ids in encoded["input_ids"]]

    def block(self, width: int, height: int, alone: bool) -> np.ndarray:
        """An image's tokens in a document: its ids, in the family's wrapper."""
        ids = self.family.image_token_ids(width, height, alone)
        start, end = self.wrap
        if start is None and end is None:
            return np.asarray(ids, dtype=np.int64)
        parts = [[start]] if start is not None else []
        parts.append(ids)
        if end is not None:
            parts.append([end])
        return np.concatenate(parts).astype(np.int64)

    def pieces(self, doc: Document, text_ids: list[np.ndarray], stats: SkipStats) -> list[dict]:
        """The document's pieces as samples (see the module), images over every budget
        dropped and counted in ``stats``."""
        texts = iter(text_ids)
        body = [  # ("text", ids, characters) or ("image", number)
            ("text", next(texts), len(e["text"])) if "text" in e else ("image", e["image"])
            for e in doc.elements
        ]
        items = self._ends(body)
        parts = self._split(
            items, doc.sizes, lambda n, numbers: self._dropped(doc, n, numbers, stats)
        )
        return [self._sample(doc, i, part) for i, part in enumerate(parts)]

    def estimated(self, entry: dict, per_text_token: float) -> list[tuple[int, int]]:
        """``(tokens, vision units)`` of each piece of the document whose index entry is
        ``entry``, its texts estimated at ``per_text_token`` characters a token (how the
        Loader sizes an epoch before reading it)."""
        sizes = [tuple(wh) for wh in entry.get("images", [])]
        body, shown = [], 0
        for n in entry.get("elements", []):
            if n < 0:
                body.append(("image", shown))
                shown += 1
            else:
                body.append(("text", np.zeros(max(1, round(n / per_text_token)), np.int64), n))
        items = self._ends(body)
        fake = Document({}, [], sizes)
        return [self._numbers(part, fake) for part in self._split(items, sizes, None)]

    def _ends(self, body: list[tuple]) -> list[tuple]:
        """A document's items: its BOS (where the tokenizer puts one), ``body``, its EOS."""
        head = [("text", np.asarray(self.bos, dtype=np.int64), 0)] if self.bos else []
        tail = [("text", np.asarray(self.eos, dtype=np.int64), 0)] if self.eos else []
        return head + body + tail

    def _split(self, items: list[tuple], sizes: list, dropped: Any) -> list[list[tuple]]:
        """``items`` (a document's, in order) cut into pieces (see the module); an image that
        fits none is left out and, with ``dropped``, told to it (its number, its numbers)."""
        doc = Document({}, [], sizes)
        limit = self.max_length if self.max_length is not None else float("inf")
        units = self.max_units if self.max_units is not None else float("inf")
        pieces: list[list[tuple]] = [[]]
        for item in items:
            if item[0] == "image":
                n = item[1]
                try:  # alone, and as one of several (LLaVA-OneVision's differ)
                    self._numbers([item, item], doc), self._numbers([item], doc)
                except UnusableImage as e:  # the family refuses its size
                    if dropped is not None:
                        dropped(n, e)
                    continue
                tokens, used = self._numbers(pieces[-1] + [item], doc)
                if tokens <= limit and used <= units:  # beside the piece's images: as one
                    pieces[-1].append(item)  # of several (LLaVA-OneVision: one view, not crops)
                    continue
                alone = self._numbers([("image", n)], doc)
                if alone[0] > limit or alone[1] > units:
                    if dropped is not None:
                        dropped(n, alone)
                    continue
                pieces.append([item])
                continue
            ids, chars, total = item[1], item[2], max(1, len(item[1]))
            while len(ids):
                room = limit - self._numbers(pieces[-1], doc)[0]
                if room <= 0:
                    pieces.append([])
                    continue
                take = ids[: int(min(room, len(ids)))]
                share = chars if len(take) == len(ids) else round(item[2] * len(take) / total)
                pieces[-1].append(("text", take, share))  # its characters, in proportion
                ids, chars = ids[len(take) :], chars - share
        pieces = [part for part in pieces if part]
        last = pieces[-1] if pieces else []
        if len(pieces) > 1 and len(last) == 1 and last[0][0] == "text" and len(last[0][1]) == 1:
            before = pieces[-2][-1]  # a piece of the end token alone would train on nothing:
            if before[0] == "text" and len(before[1]) > 1:  # it takes the last token before
                pieces[-2][-1] = ("text", before[1][:-1], before[2])
                last.insert(0, ("text", before[1][-1:], 0))
        return pieces

    def _numbers(self, part: list[tuple], doc: Document) -> tuple[int, int]:
        """Tokens and vision units of a piece holding ``part``."""
        images = [doc.sizes[item[1]] for item in part if item[0] == "image"]
        alone = len(images) == 1
        tokens = sum(len(item[1]) for item in part if item[0] == "text")
        used = 0
        for w, h in images:
            numbers = doc.image_numbers.get((w, h, alone))
            if numbers is None:  # asked for again and again while the piece fills
                numbers = len(self.block(w, h, alone)), self.family.image_cost(w, h, alone)
                doc.image_numbers[w, h, alone] = numbers
            tokens += numbers[0]
            used += numbers[1]
        return tokens, used

    def _dropped(self, doc: Document, n: int, why: Any, stats: SkipStats):
        """Count image ``n`` of ``doc`` dropped (named ``SHARD/KEY.n``): over every budget
        (``why``: its tokens and units alone), or refused by the family (``why``: the
        error)."""
        sample = doc.sample
        name = {"__shard__": sample.get("__shard__"), "__key__": f"{sample.get('__key__')}.{n}"}
        if isinstance(why, UnusableImage):
            reason, detail = "unusable_image", f"image {n} of the document: {why}"
        else:
            reason = "image_over_budget"
            detail = (
                f"image {n} of the document needs {why[0]} tokens and {why[1]} "
                f"{self.family.unit_name} alone, over max_length {self.max_length} or the "
                f"vision budget {self.max_units}"
            )
        stats.skip(
            "tokenize",
            reason,
            name,
            f"{detail}; dropped, the rest of the document kept",
            streak=False,
        )

    def _sample(self, doc: Document, number: int, part: list[tuple]) -> dict:
        """Piece ``number`` of ``doc`` (holding ``part``) as a tokenized sample."""
        sample = doc.sample
        names = image_members(sample)
        images = [item[1] for item in part if item[0] == "image"]
        alone = len(images) == 1
        out = {k: v for k, v in sample.items() if k not in names and k != "json"}
        ids, labels, image_at, tiles, length = [], [], [], [], 0
        for item in part:
            if item[0] == "text":
                ids.append(item[1])
                labels.append(item[1])
                length += len(item[1])
                continue
            w, h = doc.sizes[item[1]]
            block = self.block(w, h, alone)
            image_at.append(length + (self.wrap[0] is not None))
            tiles.append(self.family.image_cost(w, h, alone))
            ids.append(block)
            labels.append(np.full(len(block), IGNORE_INDEX, dtype=np.int64))
            length += len(block)
        out["input_ids"] = np.concatenate(ids).astype(np.int64)
        out["labels"] = np.concatenate(labels).astype(np.int64)
        out["labels"][0] = IGNORE_INDEX  # nothing before it in its sequence predicts it
        for j, n in enumerate(images):
            name = names[n]
            out[renamed(name, j)] = sample[name]
        meta = dict(sample.get("__meta__", {}))
        meta["images"] = [list(doc.sizes[n]) for n in images]
        meta["chars"] = [item[2] for item in part if item[0] == "text" and item[2]]
        meta["document_images"] = images  # which of the document's images it holds
        out["__meta__"] = meta
        out["__piece__"] = number
        out["num_tokens"] = length
        out["image_tiles"] = tiles
        out["image_at"] = image_at
        return out


def renamed(name: str, number: int) -> str:
    """A document's image member ``name`` as image ``number`` of a piece."""
    if media_number(name) is None:
        return f"{number}.{name}"
    return f"{number}.{name.split('.', 1)[1]}"


def parse_record(sample: dict) -> tuple[dict, str]:
    """A sample's JSON record and its kind (``ValueError``, ``KeyError``, ``TypeError`` where
    it is not JSON, lacks one, or names no kind of ours)."""
    record = json.loads(sample["json"])
    if not isinstance(record, dict):
        raise TypeError("the sample's JSON is not an object")
    return record, kind_of(record)


def chosen(pieces: list[dict], sample: dict) -> list[dict]:
    """The pieces a sample asks for: all, or only piece ``__piece__`` where it names one (a
    piece taken back from a saved state); an ``InputError`` if the document no longer has
    it."""
    wanted = sample.get("__piece__")
    if wanted is None:
        return pieces
    if wanted >= len(pieces):
        raise InputError(
            f"{sample.get('__shard__')}/{sample.get('__key__')}",
            "corrupt_tar",
            f"piece {wanted} of the document was saved, but it now has {len(pieces)}",
        )
    return [pieces[wanted]]
