"""Tokenize: chat messages in, ``input_ids`` and ``labels`` out, with image tokens in place.

The conversation is rendered with the tokenizer's chat template (ChatML when it has none) and
encoded in batches. Labels follow the Hugging Face convention (aligned with ``input_ids``; the
model shifts): only the assistant answers and the end-of-turn token right after each are
supervised, everything else is -100. Each ``<image>`` marker becomes ``tokens_per_tile * tiles``
image tokens, where the tile count comes from the decoded image or, before decoding, from the
image size in the index: so a sample's token count is known before any pixel is decoded, which
is what packing on metadata needs.

With a model family (``processor=``, see ``processors.py``) the conversation is rendered with
the processor's chat template as content lists (each ``<image>`` marker an image item), and
each image's placeholder token becomes the token ids the processor would put there for an
image of that size.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jinja2
import numpy as np

from ..errors import TemplateError
from ..families.processors import conversation
from ..pipeline.images import (
    ImageConfig,
    UnreadableImage,
    UnusableImage,
    image_members,
    image_size,
    tile_count,
)
from ..pipeline.places import Fetch, Place, StageRun, copied, places_of, present
from ..pipeline.stats import SkipStats
from ..write.inputs import IMAGE_MARKER

log = logging.getLogger("wdsvlm.tokenize")

IGNORE_INDEX = -100
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load_tokenizer(tokenizer: Any):
    """A Hugging Face tokenizer object as is, or one loaded by name or path."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    name = str(tokenizer)
    local = os.path.isabs(name) or name.startswith(("./", "../", "~"))  # "org/name" is a hub id
    if local and not os.path.exists(os.path.expanduser(name)):
        raise ValueError(f"cannot load the tokenizer {name!r}: there is no such folder")
    try:
        return AutoTokenizer.from_pretrained(str(tokenizer))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer {str(tokenizer)!r}: {e}") from None


# Image sizes whose costs and token ids stand for a processor's settings in fingerprint().
_PROBE_SIZES = [(1, 1), (64, 48), (640, 480), (300, 1700), (1600, 900)]
# A conversation every chat template renders: used once to find out whether it compiles.
_PROBE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]


def check_template(tokenizer, template: str, content_lists: bool = False) -> None:
    """Refuse a chat template that transformers cannot compile (a syntax error is the
    template's fault, not a sample's), naming where it fails; with ``content_lists``, one
    that cannot render messages whose content is a list of items (a model family's)."""
    probe = conversation(_PROBE) if content_lists else _PROBE
    try:
        tokenizer.apply_chat_template(probe, chat_template=template, tokenize=False)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(
            f"the chat template does not compile (line {e.lineno}: {e.message})"
        ) from None
    except TypeError as e:
        raise TemplateError(
            f"the chat template cannot render content lists ({e}); a model family's "
            "processor needs its own chat template (processor.chat_template)"
        ) from None
    except jinja2.TemplateError:
        pass  # it compiles; it refuses this conversation, as it may refuse a sample


class Tokenize:
    """Pipeline stage: samples with a ``json`` member -> ``input_ids``, ``labels`` (int64
    arrays of equal length), ``num_tokens`` (image tokens included) and ``image_tiles``.

    ``tokenizer`` is a Hugging Face tokenizer or a name/path for ``AutoTokenizer``. The image
    token is ``image_token``, else the tokenizer's own ``image_token``, else ``<image>``; when
    the vocabulary lacks it, it is added as a special token to a copy of the tokenizer (logged
    with its id: resize the model's embeddings to ``len(stage.tokenizer)``).
    ``family`` (``processors.family_of(processor)``) replaces all of that by the family's
    tokenizer, chat template and image tokens; ``image_tiles`` then holds each image's vision
    units (patches or tiles). Every sample also gets ``image_at``: where each image's tokens
    start.
    Skips, counted: ``invalid_json``, ``image_count_mismatch``, ``template_error`` (the
    template refused the conversation), ``template_mismatch`` (an answer is not rendered
    verbatim, so its labels cannot be found). A template that does not compile is refused
    at once (``TemplateError``).
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        family: Any = None,
        tokens_per_tile: int = 64,
        image_config: ImageConfig | None = None,
        image_token: str | None = None,
        chat_template: str | None = None,
        batch_size: int = 32,
        stats: SkipStats | None = None,
    ):
        if tokens_per_tile < 1 or batch_size < 1:
            raise ValueError(
                f"tokens_per_tile ({tokens_per_tile}) and batch_size ({batch_size}) "
                "must be positive"
            )
        self.family = family
        if family is not None:
            tok = family.tokenizer
            self.image_token = family.placeholder
            chat_template = chat_template or family.processor.chat_template
        elif tokenizer is None:
            raise ValueError("Tokenize needs a tokenizer (or a model family)")
        else:
            tok = load_tokenizer(tokenizer)
            self.image_token = image_token or getattr(tok, "image_token", None) or IMAGE_MARKER
        if len(tok.encode(self.image_token, add_special_tokens=False)) != 1:
            if family is not None:
                raise ValueError(
                    f"the {family.name} processor's image token {self.image_token!r} is not "
                    "one token of its tokenizer"
                )
            tok = copy.deepcopy(tok)
            tok.add_tokens([self.image_token], special_tokens=True)
            log.warning(
                "added the image token %r to a copy of the tokenizer as id %d; the "
                "model's embeddings need %d rows",
                self.image_token,
                tok.convert_tokens_to_ids(self.image_token),
                len(tok),
            )
        self.tokenizer = tok
        self.image_token_id = tok.convert_tokens_to_ids(self.image_token)
        template = chat_template or tok.chat_template or CHATML_TEMPLATE
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default") or next(iter(template.values()))
        self.chat_template = template
        self.tokens_per_tile = tokens_per_tile
        self.image_config = image_config or ImageConfig()
        self.batch_size = batch_size
        self.stats = stats if stats is not None else SkipStats()
        # Special tokens longest first: the end-of-turn token is the one right after an answer.
        self._specials = sorted(set(tok.all_special_tokens), key=len, reverse=True)
        check_template(tok, template, content_lists=family is not None)

    def fingerprint(self) -> str:
        """A short hash of the tokenizer in use (its vocabulary, added tokens included, and
        its special tokens; not its serialised form, which a new release of tokenizers may
        write differently): a resumed loader must tokenize as the saved one did."""
        import hashlib

        tok = self.tokenizer
        facts = [sorted(tok.get_vocab().items()), sorted(tok.all_special_tokens)]
        if self.family is not None:  # and what the processor makes of images
            family = self.family
            image = family.image_processor.to_dict()
            facts += [family.name, json.dumps(image, sort_keys=True, default=str)]
            facts += [  # settings of the processor itself too (SmolVLM's image_seq_len, ...)
                [family.image_cost(w, h), family.image_token_ids(w, h).tolist()]
                for w, h in _PROBE_SIZES
            ]
        return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]

    def render(self, messages: list[dict], where: str = "a conversation") -> str:
        """The conversation as transformers renders it (``apply_chat_template``: the same
        sandbox, globals and extensions, ``{% generation %}`` included). A template that
        fails on it (``raise_exception``, an undefined name) raises ``TemplateError`` naming
        ``where`` (the sample's ``SHARD/KEY``)."""
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False
            )
        except (jinja2.TemplateError, TypeError) as e:  # TypeError: content it cannot take
            raise TemplateError(
                f"{where}: the chat template failed: {type(e).__name__}: {e}"
            ) from None

    def __call__(self, samples: Iterator[dict]) -> TokenizeRun:
        return TokenizeRun(self, samples, [])

    def restore(self, state: TokenizeState, samples: Iterator[dict], fetch: Fetch) -> TokenizeRun:
        """A run that goes on from ``state``: its held samples, taken back from ``fetch``,
        are encoded and yielded first."""
        return TokenizeRun(self, samples, present(fetch(state.held)))

    def again(self, samples: list[dict]) -> list[dict]:
        """Samples as this stage hands them on: tokenized (see ``encode``)."""
        return self.encode(samples)

    def _run(self, samples: Iterator[dict], rest: list[dict]) -> Iterator[dict]:
        if rest:
            yield from self._encode(list(rest), self.stats, rest)
        batch = []
        for sample in samples:
            batch.append(sample)
            if len(batch) == self.batch_size:
                yield from self._encode(batch, self.stats, rest)
                batch = []
        if batch:
            yield from self._encode(batch, self.stats, rest)

    def sizes_of(self, sample: dict) -> list[tuple[int, int]]:
        """Displayed sizes of the sample's images: from its index entry, else from the image
        headers (no decode)."""
        sizes = sample.get("__meta__", {}).get("images")
        if sizes is None:
            sizes = [image_size(sample[name]) for name in image_members(sample)]
            sample.setdefault("__meta__", {})["images"] = [list(s) for s in sizes]
        return [tuple(s) for s in sizes]

    def tiles_of(self, sample: dict) -> list[int]:
        """Vision units per image (tiles, or the family's patches or tiles): as decoded, or as
        the image sizes say they will be."""
        if self.family is not None:
            return [self.family.image_cost(w, h) for w, h in self.sizes_of(sample)]
        if "image_tiles" in sample:
            return list(sample["image_tiles"])
        return [tile_count(w, h, self.image_config) for w, h in self.sizes_of(sample)]

    def image_numbers(self, width: int, height: int) -> tuple[int, int]:
        """``(vision units, tokens)`` of an image displayed at ``width x height``."""
        if self.family is not None:
            ids = self.family.image_token_ids(width, height)
            return self.family.image_cost(width, height), len(ids)
        tiles = tile_count(width, height, self.image_config)
        return tiles, tiles * self.tokens_per_tile

    def _image_ids(self, sample: dict, tiles: list[int]) -> list[np.ndarray]:
        """The token ids that replace each image's one image token."""
        if self.family is not None:
            return [self.family.image_token_ids(w, h) for w, h in self.sizes_of(sample)]
        return [np.full(n * self.tokens_per_tile, self.image_token_id) for n in tiles]

    def _prepare(
        self, sample: dict, stats: SkipStats
    ) -> tuple[str, list[tuple[int, int]], list[int]] | None:
        try:
            messages = json.loads(sample["json"])["messages"]
            messages = [{"role": m["role"], "content": m["content"]} for m in messages]
            if not all(isinstance(m["content"], str) for m in messages):
                raise TypeError("message content must be a string")
        except (KeyError, TypeError, ValueError) as e:
            stats.skip("tokenize", "invalid_json", sample, f"{type(e).__name__}: {e}")
            return None
        try:
            tiles = self.tiles_of(sample)
        except UnreadableImage as e:  # no index sizes, and an image header is unreadable
            stats.skip("tokenize", "undecodable_image", sample, str(e))
            return None
        except UnusableImage as e:
            stats.skip("tokenize", "unusable_image", sample, str(e))
            return None
        markers = sum(m["content"].count(IMAGE_MARKER) for m in messages)
        if markers != len(tiles):
            stats.skip(
                "tokenize",
                "image_count_mismatch",
                sample,
                f"{markers} {IMAGE_MARKER} markers but {len(tiles)} images",
            )
            return None
        if self.family is not None:
            messages = conversation(messages)
        elif self.image_token != IMAGE_MARKER:
            for m in messages:
                m["content"] = m["content"].replace(IMAGE_MARKER, self.image_token)
        try:
            key = f"{sample.get('__shard__')}/{sample.get('__key__')}"
            text = self.render(messages, key)
        except TemplateError as e:  # the template refuses this conversation
            stats.skip("tokenize", "template_error", sample, str(e))
            return None
        try:
            return text, self._supervised(text, messages, key), tiles
        except TemplateError as e:  # rendered, but the answers cannot be found in it
            stats.skip("tokenize", "template_mismatch", sample, str(e))
            return None

    def _supervised(
        self, text: str, messages: list[dict], where: str = "a conversation"
    ) -> list[tuple[int, int]]:
        """Character ranges of the answers' text (each answer's last piece with its
        end-of-turn token) in ``text``.

        Where each message's text lies is read off a second rendering with a placeholder in
        place of each text piece (exact: a template's own text, such as a default system
        turn, is never taken for a message's). A template that does not render messages
        verbatim (it trims or rewrites them) is searched instead, each piece after the
        template's own text before it and after the previous piece, so an answer quoted
        earlier in a question is not mistaken for the answer.
        """
        pieces = [
            (n, piece)
            for n, m in enumerate(messages)
            for piece in (
                [m["content"]]
                if isinstance(m["content"], str)
                else [i["text"] for i in m["content"] if i.get("type") == "text"]
            )
        ]
        skeleton = self._skeleton(messages, len(pieces), where)
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
            eot = next((s for s in self._specials if text.startswith(s, after)), None)
            ranges.append((at, after + len(eot) if eot else end))
        return ranges

    def _skeleton(self, messages: list[dict], n_pieces: int, where: str) -> str | None:
        """The conversation rendered with the placeholder of piece k in place of each text
        piece k; None when the template refuses it."""
        count = iter(range(n_pieces))

        def marked(content):
            if isinstance(content, str):
                return _SENTINEL.format(next(count))
            return [
                {**i, "text": _SENTINEL.format(next(count))} if i.get("type") == "text" else i
                for i in content
            ]

        try:
            return self.render([{**m, "content": marked(m["content"])} for m in messages], where)
        except TemplateError:
            return None

    def _encode(
        self, batch: list[dict], stats: SkipStats, rest: list[dict] | None = None
    ) -> Iterator[dict]:
        """Tokenized ``batch``, skips counted in ``stats``; ``rest`` (a run's): kept as the
        samples of the batch taken in and not yet yielded."""
        prepared = [(s, p) for s in batch if (p := self._prepare(s, stats)) is not None]
        if not prepared:
            if rest is not None:
                rest.clear()
            return
        encoded = self.tokenizer(
            [p[0] for _, p in prepared], add_special_tokens=False, return_offsets_mapping=True
        )
        for i, (sample, (_, ranges, tiles)) in enumerate(prepared):
            if rest is not None:
                rest[:] = [s for s, _ in prepared[i + 1 :]]
            ids = np.asarray(encoded["input_ids"][i], dtype=np.int64)
            offsets = np.asarray(encoded["offset_mapping"][i], dtype=np.int64).reshape(-1, 2)
            supervised = np.zeros(len(ids), dtype=bool)
            for a, b in ranges:
                supervised |= (offsets[:, 1] > a) & (offsets[:, 0] < b)
            labels = np.where(supervised, ids, IGNORE_INDEX)
            places = np.flatnonzero(ids == self.image_token_id)
            if len(places) != len(tiles):
                stats.skip(
                    "tokenize",
                    "image_count_mismatch",
                    sample,
                    f"{len(places)} image tokens after templating, {len(tiles)} images",
                )
                continue
            ids, labels, image_at = _expand(ids, labels, places, self._image_ids(sample, tiles))
            stats.ok("tokenize")
            del sample["json"]
            sample["input_ids"] = ids
            sample["labels"] = labels
            sample["num_tokens"] = len(ids)
            sample["image_tiles"] = tiles
            sample["image_at"] = image_at
            yield sample
        if rest is not None:
            rest.clear()

    def encode(self, samples: list[dict], stats: SkipStats | None = None) -> list[dict]:
        """Tokenize ``samples`` at once (those that cannot be are skipped and counted, in
        ``stats`` when given, else in the stage's own)."""
        return list(self._encode(list(samples), self.stats if stats is None else stats))


@dataclass
class TokenizeState:
    """The places of the samples a tokenizer batch ``held``: taken in, not yet yielded."""

    held: list[Place] = field(default_factory=list)

    def held_places(self) -> list[Place]:
        return list(self.held)

    def saved(self) -> list[Place]:
        return copied(self.held)

    @classmethod
    def from_saved(cls, saved: list) -> TokenizeState:
        return cls(copied(saved))


class TokenizeRun(StageRun):
    """One iteration of a ``Tokenize``: ``rest``, the samples of the batch being encoded that
    are not yet yielded."""

    def __init__(self, stage: Tokenize, samples: Iterator[dict], rest: list[dict]):
        self.rest = rest
        super().__init__(stage._run(samples, rest))

    def state(self) -> TokenizeState:
        return TokenizeState(places_of(self.rest))


# A text piece's stand-in in the placeholder rendering (private-use characters: no template
# or tokenizer gives them a meaning).
_SENTINEL = "\ue000{}\ue001"
_SENTINEL_RE = re.compile("\ue000(\\d+)\ue001")


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


def _expand(
    ids: np.ndarray, labels: np.ndarray, places: np.ndarray, images: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """``ids`` and ``labels`` with the image token at each of ``places`` replaced by that
    image's ids (labelled -100), and where each image's ids start."""
    if not len(places):
        return ids, labels, []
    pieces, marks, image_at, at, length = [], [], [], 0, 0
    for place, image in zip(places, images, strict=True):
        pieces += [ids[at:place], image]
        marks += [labels[at:place], np.full(len(image), IGNORE_INDEX)]
        length += place - at
        image_at.append(int(length))
        length += len(image)
        at = place + 1
    pieces.append(ids[at:])
    marks.append(labels[at:])
    return (
        np.concatenate(pieces).astype(np.int64, copy=False),
        np.concatenate(marks).astype(np.int64, copy=False),
        image_at,
    )
