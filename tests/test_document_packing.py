"""Documents packed as the Loader packs them: the pieces the real Tokenize cuts a mix of
documents into (100 to 20,000 text tokens, 0 to 30 images each, Qwen2.5-VL's image tokens at
its published sizes), through the Pack stage with its window, against offline
best-fit-decreasing over the same pieces (``scripts/bench_documents.py`` on a small mix)."""

from __future__ import annotations

import importlib.util
import os

import pytest

from wdsvlm.pipeline.documents import Documents
from wdsvlm.pipeline.packer import Packer

from .conftest import REPO

MAX_LENGTH = 8192
BUDGET = 4 * MAX_LENGTH  # patches: images may fill the whole row (4 patches a Qwen token)


def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_documents", os.path.join(REPO, "scripts", "bench_documents.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def mix():
    """The bench's module, its family and the pieces Tokenize makes of 600 documents."""
    b = bench()
    family = b.family_named("qwen2_5_vl")
    samples = b.samples_of(b.document_mix(600, seed=0))
    return b, family, b.pieces_of(samples, family, MAX_LENGTH, BUDGET)


def test_documents_pack_within_half_a_point_of_offline_best_fit(mix):
    b, _, pieces = mix
    cut = b.per_document(pieces)
    assert cut["max"] >= 5 and 0.5 < cut["cut"] < 1  # long documents cut, short ones whole
    ours, stats = b.loader_fill(pieces, MAX_LENGTH, BUDGET, window=500)
    best_fit = b.bfd_fill(pieces, MAX_LENGTH, BUDGET)
    assert stats.samples == len(pieces)  # every piece packed once
    assert best_fit - ours <= 0.005, f"fill {ours:.2%} against best-fit's {best_fit:.2%}"


def test_a_piece_ends_short_only_before_an_image_that_does_not_fit(mix):
    """What the padding comes from: a document's pieces are full rows but where the next
    image would not fit whole (in tokens or vision units), and its last piece."""
    _, family, pieces = mix
    documents = Documents(family, MAX_LENGTH, BUDGET)
    wrapped = int(documents.wrap[0] is not None)  # an image's tokens start after its wrapper
    short = 0
    for piece, following in zip(pieces, pieces[1:], strict=False):
        if following["__key__"] != piece["__key__"] or piece["num_tokens"] == MAX_LENGTH:
            continue
        short += 1
        assert following["image_at"][:1] == [wrapped], piece  # the next starts with an image
        width, height = following["sizes"][0]
        alone = not piece["image_tiles"]
        tokens = len(documents.block(width, height, alone))
        units = family.image_cost(width, height, alone)
        assert (
            piece["num_tokens"] + tokens > MAX_LENGTH or sum(piece["image_tiles"]) + units > BUDGET
        ), piece
    assert short > 100  # the mix has images that end pieces early


def test_a_sample_that_waited_takes_the_largest_partner_within_a_tenth_of_its_tokens():
    """A seed that waited ``max_wait`` packs (500 of 1000 tokens) could be filled exactly by
    the small samples, but the fill holding the largest one that fits (460, leaving 40 tokens
    empty: under a tenth of its 460) is taken: the small ones stay for the gaps that only
    they can fill."""
    packer = Packer(1000, window=5, max_wait=0)  # the oldest waited long enough at once
    for tokens in (500, 460, 200, 200, 100):
        assert packer.push(tokens, tokens, 0) == []
    (first,) = packer.push(10, 10, 0)  # the window is full: one pack goes first
    assert sorted(first) == [460, 500]
    assert sorted(w[1] for w in packer.waiting) == [10, 100, 200, 200]


def test_the_longest_seed_keeps_its_exact_fill_over_a_partner_two_percent_short():
    packer = Packer(1000, window=5)
    for tokens in (900, 80, 40, 30, 30):
        assert packer.push(tokens, tokens, 0) == []
    (first,) = packer.push(10, 10, 0)
    assert sorted(first) == [30, 30, 40, 900]  # 80 beside it would leave 2% empty
