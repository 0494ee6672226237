"""Tokenize: chat messages in, ``input_ids`` and ``labels`` out, with image tokens in place.

The conversation is rendered with the tokenizer's chat template (ChatML when it has none) and
encoded in batches. Labels follow the Hugging Face convention (aligned with ``input_ids``; the
model shifts): only the assistant answers and the end-of-turn token right after each are
supervised, everything else is -100 (``labels.py`` finds the answers in the rendered text).

The family (``families/base.py``) decides how images become tokens: the default tiling
(``families/tiling.py``: each ``<image>`` marker becomes ``tokens_per_tile * tiles`` image
tokens) or a processor's family (the conversation rendered with the processor's chat template
as content lists, each image's placeholder replaced by the ids the processor would put there).
Either way the ids come from the image size in the index, so a sample's token count is known
before any pixel is decoded, which is what packing on metadata needs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jinja2
import numpy as np

from ..errors import InputError, TemplateError
from ..families.base import Family
from ..families.tiling import ImageConfig, TilingFamily
from ..format.conversation import messages_of
from ..format.images import UnreadableImage, UnusableImage, image_members, image_size
from ..format.videos import VideoInfo
from .documents import Document, Documents, parse_record
from .labels import answer_ranges, marked
from .placeholders import (
    IGNORE_INDEX,
    as_text,
    expand,
    expand_text,
    in_spans,
    span_starts,
    text_markers,
    text_tokens,
    video_refusal,
)
from .places import Fetch, TokenizeRun, TokenizeState, present
from .stats import SkipStats
from .template import CHATML_TEMPLATE, PROBE, check_template
from .usermap import SampleMap


class Tokenize:
    """Pipeline stage: samples with a ``json`` member -> ``input_ids``, ``labels`` (int64
    arrays of equal length), ``num_tokens`` (image tokens included) and ``image_tiles``.

    ``family`` (``families.base.Family``; ``registry.family_of(processor)`` for a model's)
    gives the tokenizer, chat template and image tokens; ``image_tiles`` holds each image's
    vision units (tiles or patches). Without it, the default tiling is made of ``tokenizer``
    (a Hugging Face tokenizer or a name/path for ``AutoTokenizer``), ``tokens_per_tile``,
    ``image_config`` and ``image_token`` (see ``TilingFamily``: an image token the vocabulary
    lacks is added to a copy of the tokenizer; resize the model's embeddings to
    ``len(stage.tokenizer)``). Every sample also gets ``image_at``: where each image's tokens
    start.
    ``sample_map`` (``usermap.SampleMap``, the Loader's ``map=``) runs on each sample's
    record first; what it drops is counted as ``filtered``, what it fails on (or returns
    messages that cannot be tokenized for) as ``map_error``.
    Skips, counted: ``invalid_json``, ``image_count_mismatch``, ``template_error`` (the
    template refused the conversation), ``template_mismatch`` (an answer is not rendered
    verbatim, so its labels cannot be found). A template that does not compile is refused
    at once (``TemplateError``).
    A document or caption (``format/documents.py``) is rendered by ``documents.Documents``
    and cut into pieces of at most ``max_length`` tokens and ``max_units`` vision units, each
    yielded as a sample of its own.
    """

    def __init__(
        self,
        tokenizer: Any = None,
        *,
        family: Family | None = None,
        tokens_per_tile: int = 64,
        image_config: ImageConfig | None = None,
        image_token: str | None = None,
        chat_template: str | None = None,
        batch_size: int = 32,
        stats: SkipStats | None = None,
        sample_map: SampleMap | None = None,
        max_length: int | None = None,
        max_units: int | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size ({batch_size}) must be positive")
        family = family or TilingFamily(
            image_config, tokenizer, tokens_per_tile=tokens_per_tile, image_token=image_token
        )
        self.family = family
        tok = family.tokenizer
        if tok is None:
            raise ValueError("Tokenize needs a tokenizer (or a model family)")
        self.image_token = family.placeholder
        if len(tok.encode(self.image_token, add_special_tokens=False)) != 1:
            raise ValueError(
                f"the {family.name} family's image token {self.image_token!r} is not one "
                "token of its tokenizer"
            )
        self.tokenizer = tok
        self.image_token_id = tok.convert_tokens_to_ids(self.image_token)
        # the family's videos (None: it takes none), and the one token its template puts
        # where a video goes
        self.video = getattr(family, "video", None)
        self.video_token_id = None if self.video is None else self.video.video_token_id
        template = chat_template or family.chat_template or tok.chat_template or CHATML_TEMPLATE
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default") or next(iter(template.values()))
        self.chat_template = template
        # the template a processor renders a conversation with videos by, where it has its own
        # (SmolVLM's) and none is asked for
        video_template = getattr(family, "video_chat_template", None)
        self.video_template = template if chat_template or not video_template else video_template
        self.batch_size = batch_size
        self.stats = stats if stats is not None else SkipStats()
        self.sample_map = sample_map
        self.documents = Documents(family, max_length, max_units)
        # Special tokens longest first: the end-of-turn token is the one right after an answer.
        self._specials = sorted(set(tok.all_special_tokens), key=len, reverse=True)
        check_template(tok, template, family.chat_messages(PROBE))

    def fingerprint(self, videos: bool = False, documents: bool = False) -> str:
        """A short hash of the tokenizer in use (its vocabulary, added tokens included, and
        its special tokens; not its serialised form, which a new release of tokenizers may
        write differently): a resumed loader must tokenize as the saved one did. With
        ``videos`` (the data holds some), what the family makes of videos too: a dataset of
        images keeps its fingerprint whatever the video processor's settings; with
        ``documents``, how documents are rendered (BOS, EOS, separator, image wrapper)."""
        import hashlib

        tok = self.tokenizer
        facts = [sorted(tok.get_vocab().items()), sorted(tok.all_special_tokens)]
        facts += self.family.fingerprint_facts()  # what a processor makes of images
        if videos and self.video is not None:
            facts.append(self.video.fingerprint_facts())
        if documents:
            facts.append(self.documents.fingerprint_facts())
        return hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:16]

    def render(
        self, messages: list[dict], where: str = "a conversation", videos: bool = False
    ) -> str:
        """The conversation as transformers renders it (``apply_chat_template``: the same
        sandbox, globals and extensions, ``{% generation %}`` included). A template that
        fails on it (``raise_exception``, an undefined name) raises ``TemplateError`` naming
        ``where`` (the sample's ``SHARD/KEY``)."""
        try:
            template = self.video_template if videos else self.chat_template
            return self.tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False
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
        """Vision units per image (the family's tiles or patches): as decoded, or as the image
        sizes say they will be."""
        if "image_tiles" in sample:
            return list(sample["image_tiles"])
        sizes = self.sizes_of(sample)
        return [self.family.image_cost(w, h, len(sizes) == 1) for w, h in sizes]

    def videos_of(self, sample: dict) -> list[VideoInfo]:
        """What the index records of the sample's videos, in order."""
        return [VideoInfo.from_dict(v) for v in sample.get("__meta__", {}).get("videos", [])]

    def image_numbers(self, sizes: list) -> list[tuple[int, int]]:
        """``(vision units, tokens)`` of each image of a sample whose images are displayed at
        ``sizes`` (``(width, height)`` each)."""
        alone = len(sizes) == 1
        family = self.family
        return [
            (family.image_cost(w, h, alone), len(family.image_token_ids(w, h, alone)))
            for w, h in sizes
        ]

    def video_numbers(self, videos: list[dict]) -> list[tuple[int, int]] | None:
        """``(vision units, tokens)`` of each video whose index records are ``videos``; None
        where the family takes no video or its processor cannot sample one of them (such a
        sample is skipped when it is read)."""
        if not videos:
            return []
        if self.video is None:
            return None
        infos = [VideoInfo.from_dict(v) for v in videos]
        try:
            return [(self.video.cost(i), len(self.video.token_ids(i))) for i in infos]
        except ValueError:  # a video its processor cannot sample: skipped when it is read
            return None

    def _image_ids(self, sample: dict) -> list[np.ndarray]:
        """The token ids that replace each image's one image token."""
        sizes = self.sizes_of(sample)
        return [self.family.image_token_ids(w, h, len(sizes) == 1) for w, h in sizes]

    def _prepare(
        self, sample: dict, stats: SkipStats
    ) -> tuple[str, list[tuple[int, int]], list[int]] | None:
        try:
            record, kind = parse_record(sample)
            if self.sample_map is None and kind == "conversation":
                messages = messages_of(record)
        except (KeyError, TypeError, ValueError) as e:
            stats.skip("tokenize", "invalid_json", sample, f"{type(e).__name__}: {e}")
            return None
        if kind != "conversation":  # a document or caption
            try:
                sizes = self.sizes_of(sample)
            except (UnreadableImage, UnusableImage) as e:
                stats.skip("tokenize", "undecodable_image", sample, str(e))
                return None
            return self.documents.take(record, sample, sizes, stats, self.sample_map)
        if self.sample_map is not None:  # what it returns is its own: a failure is map_error
            messages = self.sample_map(record, sample, stats, messages_of)
            if messages is None:  # dropped or skipped, and counted
                return None
        try:
            tiles = self.tiles_of(sample)
        except UnreadableImage as e:  # no index sizes, and an image header is unreadable
            stats.skip("tokenize", "undecodable_image", sample, str(e))
            return None
        except UnusableImage as e:
            stats.skip("tokenize", "unusable_image", sample, str(e))
            return None
        videos = self.videos_of(sample)
        try:  # markers of a kind the sample has no media of are text
            messages = as_text(messages, len(tiles), len(videos))
        except InputError as e:
            stats.skip("tokenize", e.reason, sample, e.message)
            return None
        refused = video_refusal(self.family, videos, len(tiles))
        if refused is not None:
            stats.skip("tokenize", refused[0], sample, refused[1])
            return None
        messages = self.family.chat_messages(messages)
        try:
            key = f"{sample.get('__shard__')}/{sample.get('__key__')}"
            text = self.render(messages, key, videos=bool(videos))
        except TemplateError as e:  # the template refuses this conversation
            stats.skip("tokenize", "template_error", sample, str(e))
            return None
        try:
            ranges = self._supervised(text, messages, key, videos=bool(videos))
        except TemplateError as e:  # rendered, but the answers cannot be found in it
            stats.skip("tokenize", "template_mismatch", sample, str(e))
            return None
        if videos and self.video.in_text:  # the prompts go in before tokenizing, as there
            count = max(len(self.video.frames(v)) for v in videos)  # as the processor says it
            prompts = [self.video.prompt(v, count) for v in videos]
            try:
                text, ranges, sample["__video_spans__"] = expand_text(
                    text, self.video.video_token, prompts, ranges
                )
            except ValueError as e:
                stats.skip("tokenize", "video_count_mismatch", sample, str(e))
                return None
        text, sample["__text_markers__"] = text_markers(text)  # those that stand for nothing
        return text, ranges, tiles

    def _supervised(
        self, text: str, messages: list[dict], where: str = "a conversation", videos: bool = False
    ) -> list[tuple[int, int]]:
        """Character ranges of the answers' text (with their end-of-turn tokens) in ``text``
        (see ``labels.answer_ranges``)."""
        try:
            skeleton = self.render(marked(messages), where, videos)
        except TemplateError:
            skeleton = None
        return answer_ranges(text, messages, skeleton, self._specials)

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
        self.documents.encode([p for _, p in prepared if isinstance(p, Document)])
        talks = [(s, p) for s, p in prepared if not isinstance(p, Document)]
        texts = [p[0] for _, p in talks]
        encoded = texts and self.tokenizer(
            texts, add_special_tokens=False, return_offsets_mapping=True
        )
        i = -1
        for at_, (sample, prepared_) in enumerate(prepared):
            after = [s for s, _ in prepared[at_ + 1 :]]
            if isinstance(prepared_, Document):
                yield from self.documents.run(prepared_, stats, rest, after)
                continue
            i += 1
            ranges, tiles = prepared_[1], prepared_[2]
            if rest is not None:
                rest[:] = after
            ids = np.asarray(encoded["input_ids"][i], dtype=np.int64)
            offsets = np.asarray(encoded["offset_mapping"][i], dtype=np.int64).reshape(-1, 2)
            markers = sample.pop("__text_markers__", ())  # as text, never the <image> token
            ids, offsets = text_tokens(ids, offsets, prepared_[0], markers, self.tokenizer)
            supervised = np.zeros(len(ids), dtype=bool)
            for a, b in ranges:
                supervised |= (offsets[:, 1] > a) & (offsets[:, 0] < b)
            labels = np.where(supervised, ids, IGNORE_INDEX)
            spans = sample.pop("__video_spans__", None)  # videos' prompts already in the text
            places = np.flatnonzero((ids == self.image_token_id) & ~in_spans(offsets, spans or ()))
            if len(places) != len(tiles):
                stats.skip(
                    "tokenize",
                    "image_count_mismatch",
                    sample,
                    f"{len(places)} image tokens after templating, {len(tiles)} images",
                )
                continue
            videos = self.videos_of(sample)
            at = np.flatnonzero(ids == self.video_token_id) if videos else places[:0]
            if spans is not None:  # (such a sample has no images: no piece moves them)
                at = span_starts(offsets, spans)
            if len(at) != len(videos):
                stats.skip(
                    "tokenize",
                    "video_count_mismatch",
                    sample,
                    f"{len(at)} video tokens after templating, {len(videos)} videos",
                )
                continue
            pieces = list(zip(places, self._image_ids(sample), strict=True))
            if spans is None:
                pieces += zip(at, [self.video.token_ids(v) for v in videos], strict=True)
            ids, labels, starts = expand(ids, labels, pieces)
            image_at = starts[: len(places)]
            if videos:
                sample["video_units"] = [self.video.cost(v) for v in videos]
                sample["video_at"] = starts[len(places) :] if spans is None else at.tolist()
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
