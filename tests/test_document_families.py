"""Documents and captions on each model family, proven against its processor and model.

A document is rendered without a chat template (``pipeline/documents.py``): its tokens must
be the ones the family's own processor makes of the document's text with each image written
as the family's chat template writes one (Qwen's inside ``<|vision_start|>`` ...
``<|vision_end|>``); its pieces, concatenated, must give back the whole document, labelled on
every text token but their first and never on an image's; a piece packed with other pieces
and conversations must give the model's logits of the piece run alone, its pixels the
processor's and, on Qwen, the mRoPE positions of ``get_rope_index`` on the piece alone.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

import wdsvlm
from wdsvlm.families import family_of
from wdsvlm.format.images import open_image
from wdsvlm.loader.build import pad_of
from wdsvlm.pipeline.collate import Collate
from wdsvlm.pipeline.stats import SkipStats
from wdsvlm.pipeline.tokenize import IGNORE_INDEX, Tokenize
from wdsvlm.testing.documents import image_png, random_documents, write_documents
from wdsvlm.testing.tiny import tiny_model, tiny_processor

from .conftest import EXAMPLE
from .test_documents import raw_samples
from .test_families import _spans, alone, dataset_samples, reference_pixels

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "smolvlm", "idefics3", "llava_onevision"]
MAX_LENGTH = 256
PACK_LENGTH = 512  # a packed row: room for several pieces and conversations


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """20 documents (40 to 300 words, 1 to 4 images) and captions (a fifth or so)."""
    made = random_documents(20, seed=11, words=(40, 300), images=(1, 4), caption_share=0.2)
    return write_documents(str(tmp_path_factory.mktemp("docs")), made, per_shard=10)


def document_sample(elements: list[dict], sizes: list[tuple[int, int]]) -> dict:
    record = {"id": "d0", "kind": "document", "elements": elements}
    sample = {"__key__": "d0", "__shard__": "s.tar", "json": json.dumps(record).encode()}
    for n, (w, h) in enumerate(sizes):
        sample[f"{n}.png"] = image_png(w, h, n)
    return sample


def images_of(sample: dict, numbers: list[int]) -> list:
    return [open_image(sample[f"{n}.png"]) for n in numbers]


def chat_image_text(processor) -> str:
    """What the processor's chat template puts in a user turn for an image between two
    texts: its image token and the special tokens right around it."""
    content = [{"type": "text", "text": "X"}, {"type": "image"}, {"type": "text", "text": "Y"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    specials = sorted(processor.tokenizer.get_added_vocab(), key=len, reverse=True)
    a = text.index(processor.image_token)
    b = a + len(processor.image_token)
    while found := next((t for t in specials if text[:a].endswith(t)), None):
        a -= len(found)
    while found := next((t for t in specials if text[b:].startswith(t)), None):
        b += len(found)
    return text[a:b]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_documents_tokens_are_what_the_processor_makes_of_its_text(family):
    # Texts apart and side by side, images between them, side by side and at both ends:
    # the processor takes the document's text with each image as its chat template puts one
    # (Qwen: inside <|vision_start|> ... <|vision_end|>), and must make the very ids the
    # document is rendered as.
    processor = tiny_processor(family)
    fam = family_of(processor)
    elements = [
        {"image": 0},
        {"text": "A title"},
        {"text": "The first paragraph, about a cat."},
        {"image": 1},
        {"image": 2},
        {"text": " and then a river, near the old city."},
        {"image": 3},
    ]
    sizes = [(64, 48), (96, 64), (48, 80), (32, 32)]
    sample = document_sample(elements, sizes)
    (out,) = Tokenize(family=fam).encode([dict(sample)])
    image = chat_image_text(processor)
    text = processor_text(processor, elements, image)
    ref = processor(text=[text], images=[images_of(sample, range(4))], return_tensors="pt")
    assert out["input_ids"].tolist() == ref["input_ids"][0].tolist()
    assert image == fam.image_wrap[0] + processor.image_token + fam.image_wrap[1]


def processor_text(processor, elements: list[dict], image: str) -> str:
    """A document's text as the processor takes it: ``image`` for each image, two newlines
    between two texts, the end-of-text token last."""
    text = ""
    for i, element in enumerate(elements):
        if "image" in element:
            text += image
        else:
            following = i + 1 < len(elements) and "text" in elements[i + 1]
            text += element["text"] + ("\n\n" if following else "")
    return text + processor.tokenizer.eos_token


def test_a_tokenizer_that_starts_texts_with_bos_starts_each_document_with_it():
    # Idefics3's Llama 3 tokenizer puts <|begin_of_text|> before a text, and so does its
    # processor before a document's; of the document's pieces, only the first has it.
    processor = tiny_processor("idefics3")
    processor.tokenizer.add_bos_token = True
    tok = processor.tokenizer
    elements = [{"image": 0}, {"text": "A title"}, {"text": "the cat " * 30}, {"image": 1}]
    sample = document_sample(elements, [(64, 48), (32, 32)])
    fam = family_of(processor)
    (out,) = Tokenize(family=fam).encode([dict(sample)])
    text = processor_text(processor, elements, processor.image_token)
    ref = processor(text=[text], images=[images_of(sample, [0, 1])], return_tensors="pt")
    assert out["input_ids"].tolist() == ref["input_ids"][0].tolist()
    assert out["input_ids"][0] == tok.bos_token_id and out["labels"][-1] == tok.eos_token_id
    pieces = Tokenize(family=fam, max_length=128).encode([dict(sample)])
    assert len(pieces) >= 2
    starts = [p["input_ids"][0] == tok.bos_token_id for p in pieces]
    assert starts == [True] + [False] * (len(pieces) - 1)
    assert np.array_equal(np.concatenate([p["input_ids"] for p in pieces]), out["input_ids"])


def blocks(fam, piece: dict) -> list[tuple[int, int]]:
    """``(start, stop)`` of each image's tokens in a piece, its wrapper included."""
    start, end = fam.image_wrap
    alone = len(piece["image_tiles"]) == 1
    out = []
    for at, (w, h) in zip(piece["image_at"], piece["__meta__"]["images"], strict=True):
        n = len(fam.image_token_ids(w, h, alone))
        out.append((at - bool(start), at + n + bool(end)))
    return out


def image_mask(fam, piece: dict) -> np.ndarray:
    mask = np.zeros(len(piece["input_ids"]), dtype=bool)
    for a, b in blocks(fam, piece):
        mask[a:b] = True
    return mask


def cutters(fam, samples: list[dict]) -> tuple[Tokenize, Tokenize]:
    """The family's stage rendering whole documents, and one cutting them into pieces of at
    most ``MAX_LENGTH`` tokens and the vision units of the dearest image alone."""
    most = max(
        fam.image_cost(w, h, True)
        for s in samples
        for w, h in Tokenize(family=fam).sizes_of(dict(s))
    )
    return Tokenize(family=fam), Tokenize(family=fam, max_length=MAX_LENGTH, max_units=most)


@pytest.mark.parametrize("family", FAMILIES)
def test_pieces_concatenate_to_the_document_and_label_all_text_but_their_first_token(family, docs):
    fam = family_of(tiny_processor(family))
    tok = fam.tokenizer
    samples = raw_samples(docs)
    whole_stage, cut_stage = cutters(fam, samples)
    cut = other = 0
    for sample in samples:
        (whole,) = whole_stage.encode([dict(sample)])
        pieces = cut_stage.encode([dict(sample)])
        assert [p["__piece__"] for p in pieces] == list(range(len(pieces)))
        numbers = [n for p in pieces for n in p["__meta__"]["document_images"]]
        assert numbers == list(range(len(whole["image_tiles"])))  # every image, once
        cut += len(pieces) > 1
        joined = np.concatenate([p["input_ids"] for p in pieces])
        # The text of the pieces is the document's; each image's tokens are the family's for
        # its piece (LLaVA-OneVision: crops where it is its piece's only image, one view of
        # several), so they are the whole document's wherever that does not change.
        text = np.concatenate([p["input_ids"][~image_mask(fam, p)] for p in pieces])
        assert np.array_equal(text, whole["input_ids"][~image_mask(fam, whole)])
        if any((len(p["image_tiles"]) == 1) != (len(whole["image_tiles"]) == 1) for p in pieces):
            other += 1
            assert family == "llava_onevision" or np.array_equal(joined, whole["input_ids"])
        else:
            assert np.array_equal(joined, whole["input_ids"]), sample["__key__"]
        for p in pieces:
            ids, labels = p["input_ids"], p["labels"]
            assert len(ids) == p["num_tokens"] <= MAX_LENGTH
            assert sum(p["image_tiles"]) <= cut_stage.documents.max_units
            mask = image_mask(fam, p)
            start, end = (tok.convert_tokens_to_ids(t) if t else None for t in fam.image_wrap)
            for (a, b), (w, h) in zip(blocks(fam, p), p["__meta__"]["images"], strict=True):
                block = fam.image_token_ids(w, h, len(p["image_tiles"]) == 1).tolist()
                if start is not None:  # the image's ids inside its wrapper
                    block = [start, *block, end]
                assert ids[a:b].tolist() == block
            assert (labels[mask] == IGNORE_INDEX).all()  # never an image, nor its wrapper
            assert labels[0] == IGNORE_INDEX  # nothing before it in its sequence
            text_after = ~mask
            text_after[0] = False
            assert (labels[text_after] == ids[text_after]).all()  # all its other text
    assert cut >= 5
    if family == "llava_onevision":  # pieces of one image cut from documents of several
        assert other > 0


def _reference(processor, family: str, sample: dict, piece: dict) -> dict:
    """What the model takes for ``piece`` alone: its ids, the processor's pixels of its
    images (the image token once for each, so that the processor counts them per sample)."""
    numbers = piece["__meta__"]["document_images"]
    ids = torch.from_numpy(piece["input_ids"])[None]
    if not numbers:
        return {"input_ids": ids}
    ref = processor(
        text=[processor.image_token * len(numbers)],
        images=[images_of(sample, numbers)],
        return_tensors="pt",
    )
    ref.pop("attention_mask", None)
    ref["input_ids"] = ids
    if family.startswith("qwen"):
        ref["mm_token_type_ids"] = (ids == processor.image_token_id).int()
    return ref


def packed_batches(fam, docs: str) -> tuple[list[tuple[dict, list[list[dict]]]], dict]:
    """Batches of 2 rows of ``PACK_LENGTH`` tokens (made by Collate) holding every piece (of
    at most ``MAX_LENGTH`` tokens) of the dataset's first documents of several pieces and a
    few short conversations, taken in turn, each with its rows' samples; and the stored
    samples by ``(shard, key)``."""
    stage = Tokenize(family=fam, max_length=MAX_LENGTH)
    documents = [s for s in raw_samples(docs) if len(stage.encode([dict(s)])) > 1][:4]
    talks = [
        s
        for key, members in sorted(dataset_samples(EXAMPLE).items())
        for s in [{"__shard__": key.split("/")[0], "__key__": key.split("/")[1], **members}]
        if stage.encode([dict(s)])[0]["num_tokens"] <= MAX_LENGTH
    ][:4]
    samples = []
    for document, talk in zip(documents, talks, strict=True):
        samples += stage.encode([dict(document)]) + stage.encode([dict(talk)])
    packs: list[list[dict]] = [[]]  # in turn, as many as fit a row: rows of both kinds
    for sample in samples:
        if sum(s["num_tokens"] for s in packs[-1]) + sample["num_tokens"] > PACK_LENGTH:
            packs.append([])
        packs[-1].append(sample)
    collate = Collate(PACK_LENGTH, 2, pad_of(fam.tokenizer), family=fam)
    batches = [(collate(packs[i : i + 2]), packs[i : i + 2]) for i in range(0, len(packs), 2)]
    return batches, {(s["__shard__"], s["__key__"]): s for s in documents + talks}


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_pieces_and_conversations_give_the_logits_and_pixels_of_each_alone(family, docs):
    processor = tiny_processor(family)
    model = tiny_model(family, processor).eval()
    fam = family_of(processor)
    kinds = dict.fromkeys(("piece", "later piece", "talk", "rows with both"), 0)
    kinds.update({"1 image": 0, "images": 0})  # pieces of one image, of several
    batches, stored = packed_batches(fam, docs)
    with torch.no_grad():
        for batch, rows in batches:
            check_batch(processor, model, family, stored, batch, rows, kinds)
    # several pieces, a document's later ones, conversations and rows holding both kinds
    assert kinds["piece"] >= 8 and kinds["later piece"] >= 4 and kinds["talk"] == 4, kinds
    assert kinds["rows with both"] >= 1, kinds
    # pieces of one image and of several (LLaVA-OneVision: crops, or one view each)
    assert kinds["1 image"] >= 1 and kinds["images"] >= 1, kinds


def check_batch(processor, model, family, stored, batch, rows, kinds) -> None:
    """Each sample of ``batch`` (of ``rows``) against its piece or conversation run alone."""
    inputs = wdsvlm.model_inputs(batch)
    model_pixels = inputs.get("pixel_values")
    if model_pixels is not None and family in ("smolvlm", "idefics3"):
        model_pixels = model_pixels[0]
    pixel_at = 0
    packed = model(**inputs).logits
    for row in rows:
        kinds["rows with both"] += len({"__piece__" in s for s in row}) == 2
    spans = list(_spans(batch))
    for (r, start, stop, key), sample in zip(spans, [s for row in rows for s in row], strict=True):
        ids = batch["input_ids"][r, start:stop]
        assert batch["labels"][r, start:stop].tolist() == sample["labels"].tolist()
        raw = stored[sample["__shard__"], sample["__key__"]]
        if "__piece__" not in sample:
            ref = alone(processor, raw)
            kinds["talk"] += 1
        else:
            ref = _reference(processor, family, raw, sample)
            kinds["piece"] += 1
            kinds["later piece"] += sample["__piece__"] > 0
            images = len(sample["image_tiles"])
            kinds["1 image"] += images == 1
            kinds["images"] += images > 1
        assert torch.equal(ids, ref["input_ids"][0]), key
        if "pixel_values" in ref:  # the processor's pixels of each image, in order
            expected = reference_pixels(family, ref)
            mine = model_pixels[pixel_at : pixel_at + len(expected)]
            assert torch.equal(mine, expected), (key, sample.get("__piece__"))
            pixel_at += len(expected)
        if family.startswith("qwen") and "image_grid_thw" in ref:
            rope, _ = model.model.get_rope_index(
                ref["input_ids"],
                mm_token_type_ids=ref["mm_token_type_ids"],
                image_grid_thw=ref["image_grid_thw"],
            )
            assert torch.equal(batch["position_ids"][1:, r, start:stop], rope[:, 0]), key
        logits = model(**ref, use_cache=False).logits[0]
        torch.testing.assert_close(packed[r, start:stop], logits, rtol=0, atol=1e-5)
    assert model_pixels is None or pixel_at == len(model_pixels)  # no pixels but theirs


def test_an_image_too_large_alone_is_kept_as_one_view_beside_the_pieces_other_images():
    # LLaVA-OneVision makes an image its sample's only one into crops (151 tokens, 25 views
    # at 300x200 here), and one of several into one view (17 tokens): beside another image
    # it fits a piece that it would not fit alone.
    processor = tiny_processor("llava_onevision")
    fam = family_of(processor)
    assert len(fam.image_token_ids(300, 200, True)) > 100 >= 3 * 17
    elements = [{"text": "A few words"}, {"image": 0}, {"image": 1}, {"text": "The end."}]
    sample = document_sample(elements, [(32, 32), (300, 200)])
    stats = SkipStats()
    pieces = Tokenize(family=fam, max_length=100, max_units=8, stats=stats).encode([sample])
    assert not stats.counts  # nothing dropped
    assert [p["__meta__"]["document_images"] for p in pieces] == [[0, 1]]
    text = processor_text(processor, elements, processor.image_token)
    ref = processor(text=[text], images=[images_of(sample, [0, 1])], return_tensors="pt")
    assert pieces[0]["input_ids"].tolist() == ref["input_ids"][0].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loaders_batches_of_documents_and_conversations_give_the_logits_of_each_alone(
    family, docs
):
    # The Loader over a mixture: its own stage cuts the documents at its max_length and
    # vision budget, and each piece of its batches must be the piece the processor and the
    # model make alone.
    processor = tiny_processor(family)
    model = tiny_model(family, processor).eval()
    loader = wdsvlm.Loader(
        [wdsvlm.Source(EXAMPLE, weight=0.5), wdsvlm.Source(docs, weight=0.5)],
        processor=processor,
        max_length=PACK_LENGTH,
        batch_size=2,
        shuffle_buffer=8,
        pack_window=16,
        samples_per_pass=40,
        num_workers=0,
        seed=3,
    )
    raw = {(s["__shard__"], s["__key__"]): s for s in raw_samples(docs)}
    for key, members in dataset_samples(EXAMPLE).items():
        shard, name = key.split("/")
        raw[shard, name] = {"__shard__": shard, "__key__": name, **members}
    kinds = dict.fromkeys(("piece", "later piece", "talk", "rows with both"), 0)
    kinds.update({"1 image": 0, "images": 0})
    with torch.no_grad():
        for batch in itertools.islice(loader, 8):  # until a document's later piece came
            rows = []
            for keys, pieces in zip(batch["sample_keys"], batch["sample_pieces"], strict=True):
                rows.append([])
                for key, piece in zip(keys, pieces, strict=True):
                    shard, name = key.split("/")[-2:]  # a mixture's keys name their source
                    tokenized = loader.tokenize.encode([dict(raw[shard, name])])
                    rows[-1].append(tokenized[piece or 0])
            check_batch(processor, model, family, raw, batch, rows, kinds)
            if kinds["piece"] >= 3 and kinds["later piece"] >= 1:
                break
    assert kinds["piece"] >= 3 and kinds["later piece"] >= 1, kinds
