"""Documents and captions through the Loader: rendered without a chat template, cut into
pieces that never cut an image, every piece once a pass, exact and elastic resume in the
middle of a document."""

from __future__ import annotations

import json
import os
import tarfile
from collections import Counter

import numpy as np
import pytest
import torch

import wdsvlm
from wdsvlm.families.tiling import ImageConfig
from wdsvlm.pipeline.stats import SkipStats
from wdsvlm.pipeline.tokenize import IGNORE_INDEX, Tokenize
from wdsvlm.testing.documents import image_png, random_documents, write_documents

from .conftest import EXAMPLE

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SETTINGS = {
    "max_length": 128,
    "batch_size": 2,
    "tile_size": 32,
    "max_image_side": 64,
    "tokens_per_tile": 4,
    "shuffle_buffer": 8,
    "pack_window": 6,
    "seed": 5,
}


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    """36 documents and captions: 10 to 400 words, up to 4 images each."""
    made = random_documents(36, seed=3, words=(10, 400), images=(0, 4), caption_share=0.25)
    return write_documents(str(tmp_path_factory.mktemp("docs")), made, per_shard=7)


def raw_samples(folder: str) -> list[dict]:
    """The dataset's samples as the reader hands them on (members by suffix)."""
    out = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".tar"):
            continue
        by_key: dict[str, dict] = {}
        with tarfile.open(os.path.join(folder, name)) as tar:
            for info in tar:
                key, suffix = info.name.split(".", 1)
                sample = by_key.setdefault(key, {"__key__": key, "__shard__": name})
                sample[suffix] = tar.extractfile(info).read()
        out += by_key.values()
    return out


def stage(max_length=None, max_units=None, stats=None) -> Tokenize:
    return Tokenize(
        TOKENIZER,
        tokens_per_tile=4,
        image_config=ImageConfig(tile_size=32, max_image_side=64),
        max_length=max_length,
        max_units=max_units,
        stats=stats,
    )


def document_sample(elements, sizes, key="d0") -> dict:
    record = {"id": key, "kind": "document", "elements": elements}
    sample = {"__key__": key, "__shard__": "s.tar", "json": json.dumps(record).encode()}
    for n, (w, h) in enumerate(sizes):
        sample[f"{n}.png"] = image_png(w, h, n)
    sample["__meta__"] = {"images": [list(s) for s in sizes]}
    return sample


def test_pieces_concatenate_to_the_whole_document_and_never_cut_an_image(docs):
    whole_stage, cut_stage = stage(), stage(max_length=48)
    image_id = whole_stage.image_token_id
    for sample in raw_samples(docs):
        (whole,) = whole_stage.encode([dict(sample)])
        pieces = cut_stage.encode([dict(sample)])
        assert [p["__piece__"] for p in pieces] == list(range(len(pieces)))
        joined = np.concatenate([p["input_ids"] for p in pieces])
        assert np.array_equal(joined, whole["input_ids"]), sample["__key__"]
        assert sum(len(p["image_tiles"]) for p in pieces) == len(whole["image_tiles"])
        for p in pieces:
            ids, labels = p["input_ids"], p["labels"]
            assert len(ids) == p["num_tokens"] <= 48
            assert labels[0] == IGNORE_INDEX  # nothing before it predicts it
            image = ids == image_id
            assert (labels[image] == IGNORE_INDEX).all()  # never an image's tokens
            assert (labels[1:][~image[1:]] == ids[1:][~image[1:]]).all()  # all its text
            blocks = [(at, 4 * t) for at, t in zip(p["image_at"], p["image_tiles"], strict=True)]
            assert image.sum() == sum(n for _, n in blocks)
            for at, n in blocks:  # each image whole, in its piece
                assert image[at : at + n].all() and at + n <= len(ids)
            names = sorted(k for k in p if k.endswith(".png"))
            assert names == [f"{j}.png" for j in range(len(p["image_tiles"]))]
            assert p["__meta__"]["images"] == [
                whole["__meta__"]["images"][n] for n in p["__meta__"]["document_images"]
            ]


def test_a_document_is_rendered_with_separators_eos_and_loss_on_its_text_only():
    sample = document_sample(
        [{"text": "A title"}, {"text": "A paragraph."}, {"image": 0}, {"text": "The end."}],
        [(40, 30)],
    )
    t = stage()
    (out,) = t.encode([sample])
    tok = t.tokenizer
    text = tok.decode(out["input_ids"][out["input_ids"] != t.image_token_id])
    assert text == "A title\n\nA paragraph.The end." + tok.eos_token
    assert out["input_ids"][-1] == tok.eos_token_id and out["labels"][-1] == tok.eos_token_id
    loss = int((out["labels"] != IGNORE_INDEX).sum())
    text_tokens = int((out["input_ids"] != t.image_token_id).sum())
    assert loss == text_tokens - 1  # every text token but the first


def test_an_image_that_fits_no_piece_is_dropped_and_counted_and_its_document_kept():
    sample = document_sample(
        [{"text": "before " * 5}, {"image": 0}, {"text": "after"}, {"image": 1}],
        [(64, 64), (32, 32)],
    )
    stats = SkipStats()
    t = stage(max_length=64, max_units=2, stats=stats)
    pieces = t.encode([sample])
    units = [t.family.image_cost(64, 64), t.family.image_cost(32, 32)]
    assert units[0] > 2 >= units[1]  # the first image fits no piece on its own
    assert stats.counts == Counter({"image_over_budget": 1})
    assert stats.examples["image_over_budget"] == ["s.tar/d0.0"]
    assert [p["__meta__"]["document_images"] for p in pieces] == [[1]]
    assert sum(len(p["image_tiles"]) for p in pieces) == 1


def seen_in(batch) -> list[tuple]:
    pieces = batch.get("sample_pieces") or [[None] * len(r) for r in batch["sample_keys"]]
    return [
        (p, key, piece)
        for keys, passes, row in zip(
            batch["sample_keys"], batch["sample_passes"], pieces, strict=True
        )
        for key, p, piece in zip(keys, passes, row, strict=True)
    ]


def expected_pieces(loader, docs) -> Counter:
    """Every piece of every document, once: from the loader's own tokenizer stage."""
    t = loader.tokenize
    out = Counter()
    for sample in raw_samples(docs):
        for piece in t.encode([sample]):
            out[(f"{piece['__shard__']}/{piece['__key__']}", piece["__piece__"])] += 1
    return out


def test_every_piece_of_every_document_comes_once_a_pass(docs):
    loader = wdsvlm.Loader(docs, TOKENIZER, num_workers=0, **SETTINGS)
    expected = expected_pieces(loader, docs)
    assert max(n for (_, n) in expected) >= 3  # documents of several pieces
    seen = []
    for epoch in range(3):  # a pass's last packs may ride in the next epoch's batches
        loader.set_epoch(epoch)
        seen += [s for batch in loader for s in seen_in(batch)]
    for pass_ in range(2):
        got = Counter((key, piece) for p, key, piece in seen if p == pass_)
        assert got == expected, f"pass {pass_}"


def states_and_batches(loader, epoch=0):
    loader.set_epoch(epoch)
    out = []
    for batch in loader:
        out.append((batch, loader.state_dict()))
    return out


def held_pieces(state) -> list:
    """The places ``[pass, place, piece]`` a saved state holds: pieces of a document whose
    other pieces came before."""
    found = []

    def walk(x):
        if isinstance(x, list) and len(x) == 3 and all(isinstance(v, int) for v in x):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    for worker in state["workers"]:
        walk({k: v for k, v in worker.items() if k != "read"})
    return found


def same_batch(a, b) -> bool:
    keys = ("input_ids", "labels", "position_ids", "pixel_values", "image_tiles")
    return all(torch.equal(a[k], b[k]) for k in keys) and seen_in(a) == seen_in(b)


def test_a_state_saved_in_the_middle_of_a_document_resumes_bit_for_bit(docs):
    loader = wdsvlm.Loader(docs, TOKENIZER, num_workers=0, **SETTINGS)
    run = states_and_batches(loader)
    middle = [k for k, (_, state) in enumerate(run[:-1]) if held_pieces(state)]
    assert middle, "no state held a document's later pieces"
    for k in middle[:: max(1, len(middle) // 4)]:
        resumed = wdsvlm.Loader(docs, TOKENIZER, num_workers=0, **SETTINGS)
        resumed.load_state_dict(run[k][1])
        resumed.set_epoch(0)
        rest = list(resumed)
        assert len(rest) == len(run) - k - 1
        assert all(same_batch(a, b) for a, (b, _) in zip(rest, run[k + 1 :], strict=True))


@pytest.mark.parametrize("new_world", [1, 3])
def test_elastic_resume_mid_document_keeps_every_piece_exactly_once(docs, new_world):
    ranks = [
        wdsvlm.Loader(docs, TOKENIZER, num_workers=0, rank=r, world_size=2, **SETTINGS)
        for r in range(2)
    ]
    expected = expected_pieces(ranks[0], docs)
    runs = [states_and_batches(loader) for loader in ranks]
    steps = min(len(r) for r in runs)
    k = next((k for k in range(steps - 1) if any(held_pieces(r[k][1]) for r in runs)), None)
    assert k is not None, "no step held a document's later pieces"
    before = [s for r in runs for batch, _ in r[: k + 1] for s in seen_in(batch)]
    states = [r[k][1] for r in runs]
    after = []
    for rank in range(new_world):
        loader = wdsvlm.Loader(
            docs, TOKENIZER, num_workers=0, rank=rank, world_size=new_world, **SETTINGS
        )
        loader.load_state_dict(states)
        for epoch in range(2):  # pass 0's last packs may ride in epoch 1's batches
            loader.set_epoch(epoch)
            after += [s for batch in loader for s in seen_in(batch)]
    got = Counter((key, piece) for p, key, piece in before + after if p == 0)
    assert got == expected


def test_conversations_documents_and_captions_mix_in_one_loader(docs):
    sources = [wdsvlm.Source(EXAMPLE, weight=0.5), wdsvlm.Source(docs, weight=0.5)]
    loader = wdsvlm.Loader(sources, TOKENIZER, num_workers=0, samples_per_pass=60, **SETTINGS)
    kinds = Counter()
    for batch in loader:
        pieces = batch.get("sample_pieces") or [[None] * len(r) for r in batch["sample_keys"]]
        for row_sources, row_pieces in zip(batch["sample_sources"], pieces, strict=True):
            for source, piece in zip(row_sources, row_pieces, strict=True):
                kinds[source, piece is not None] += 1
        labels = batch["labels"]
        assert batch["num_loss_tokens"] == (labels != IGNORE_INDEX).sum()
    names = {source for source, _ in kinds}
    assert len(names) == 2 and all(kinds[n, True] or kinds[n, False] for n in names)
    assert any(is_piece for _, is_piece in kinds) and any(not p for _, p in kinds)


@pytest.mark.processes
def test_a_state_saved_mid_document_with_workers_resumes_bit_for_bit(docs):
    settings = {**SETTINGS, "num_workers": 2}
    run = states_and_batches(wdsvlm.Loader(docs, TOKENIZER, **settings))
    k = next(k for k, (_, state) in enumerate(run[:-1]) if held_pieces(state))
    resumed = wdsvlm.Loader(docs, TOKENIZER, **settings)
    resumed.load_state_dict(run[k][1])
    resumed.set_epoch(0)
    rest = list(resumed)
    assert len(rest) == len(run) - k - 1
    assert all(same_batch(a, b) for a, (b, _) in zip(rest, run[k + 1 :], strict=True))


def test_an_evaluation_loader_gives_every_piece_once_and_equal_lengths_on_two_ranks(docs):
    ranks = [
        wdsvlm.Loader(
            docs, TOKENIZER, num_workers=0, rank=r, world_size=2, evaluation=True, **SETTINGS
        )
        for r in range(2)
    ]
    expected = expected_pieces(ranks[0], docs)
    seen, lengths = [], []
    for loader in ranks:
        batches = list(loader)
        lengths.append((len(loader), len(batches)))
        seen += [s for batch in batches for s in seen_in(batch)]
    assert lengths[0] == lengths[1] and lengths[0][0] == lengths[0][1]
    assert Counter((key, piece) for _, key, piece in seen) == expected


def test_how_documents_are_rendered_is_part_of_the_resume_check_of_data_that_holds_them(docs):
    t = stage()
    plain = t.fingerprint()
    assert t.fingerprint(documents=True) != plain
    before = t.fingerprint(documents=True)
    t.documents.wrap = [t.image_token_id, None]  # another image wrapper
    assert t.fingerprint(documents=True) != before and t.fingerprint() == plain
    loader = wdsvlm.Loader(docs, TOKENIZER, num_workers=0, **SETTINGS)
    conversations = wdsvlm.Loader(EXAMPLE, TOKENIZER, num_workers=0, **SETTINGS)
    assert loader.state_dict()["config"]["tokenizer"] == loader.tokenize.fingerprint(documents=True)
    assert conversations.state_dict()["config"]["tokenizer"] == conversations.tokenize.fingerprint()


def test_no_piece_is_a_lone_end_token_that_would_train_on_nothing():
    text = "the quick brown fox jumps over the lazy dog " * 5
    whole = stage()
    n = len(whole.documents.encode_texts([text])[0])
    sample = document_sample([{"text": text}], [])
    (one,) = whole.encode([dict(sample)])
    pieces = stage(max_length=n).encode([dict(sample)])  # the text fills a row: the EOS over
    assert [p["num_tokens"] for p in pieces] == [n - 1, 2]
    assert [int((p["labels"] != IGNORE_INDEX).sum()) for p in pieces] == [n - 2, 1]
    assert np.array_equal(np.concatenate([p["input_ids"] for p in pieces]), one["input_ids"])


def test_an_image_the_family_refuses_is_dropped_and_counted_and_its_document_kept():
    from wdsvlm.families import family_of
    from wdsvlm.testing.tiny import tiny_processor

    sample = document_sample(
        [{"text": "before"}, {"image": 0}, {"text": "after"}, {"image": 1}], [(1000, 4), (32, 32)]
    )
    stats = SkipStats()
    t = Tokenize(family=family_of(tiny_processor("qwen2_vl")), max_length=256, stats=stats)
    pieces = t.encode([sample])  # Qwen refuses an aspect ratio over 200
    assert stats.counts == Counter({"unusable_image": 1})
    assert stats.examples["unusable_image"] == ["s.tar/d0.0"]
    assert [p["__meta__"]["document_images"] for p in pieces] == [[1]]
    assert t.documents.estimated({"images": [[1000, 4], [32, 32]], "elements": [6, -1, 5, -1]}, 3.5)
