"""Mixture weights by tokens: each source's share of the supervised tokens (labels not
ignored) follows its weight, from an estimate every process computes alike from the index and
the tokenizer; the estimate of an entry of each kind; mixture files; resume."""

from __future__ import annotations

import json
import os
import sys

import pytest

import wdsvlm
from wdsvlm import Source
from wdsvlm.loader.report import supervised_by_source
from wdsvlm.pipeline.plan import Plan
from wdsvlm.pipeline.sources import resolve_sources
from wdsvlm.pipeline.token_weights import supervised_estimate, supervised_text
from wdsvlm.testing.conversations import conversation_dataset

from .conftest import EXAMPLE, REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
from measure_token_shares import SHAPES, WEIGHTS, worst_windows  # noqa: E402

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")


def test_an_entrys_supervised_text_is_its_answers_or_its_documents_texts():
    """A conversation's answers are its last turn and every second one before it (a system
    turn first or not), each with its end-of-turn token; a document's or caption's every text
    element (never an image), a caption with its end token; an entry without a kind is a
    conversation."""
    assert supervised_text({"chars": [40, 7, 30, 9]}) == (16, 2)  # user, answer, user, answer
    assert supervised_text({"chars": [100, 40, 7, 30, 9]}) == (16, 2)  # a system turn first
    assert supervised_text({"kind": 0, "chars": [5, 11]}) == (11, 1)
    document = {"kind": 1, "chars": [12, 30], "elements": [12, -1, 30, -1]}
    assert supervised_text(document) == (42, 0)
    assert supervised_text({"kind": 2, "chars": [25], "elements": [-1, 25]}) == (25, 1)
    assert supervised_estimate({"kind": 2, "chars": [35], "elements": [-1, 35]}) == 11.0


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    """Three conversation datasets of very different supervised tokens per sample."""
    folder = str(tmp_path_factory.mktemp("token-weights"))
    return {
        name: conversation_dataset(folder, name, 1200, turns, answer, samples_per_shard=300)
        for name, (turns, answer) in SHAPES.items()
    }


def sources(three, weights=WEIGHTS):
    return [Source(three[name], name=name, weight=w) for name, w in weights.items()]


def test_token_weights_divide_each_sources_weight_by_its_supervised_tokens_per_sample(three):
    """A pass's samples of each source are its weight over its supervised tokens per sample
    (the index's estimate here, with no tokenizer), so the pass holds the weights' shares
    of the estimated tokens; weighted by samples, it holds the weights' shares of samples."""
    by_samples = resolve_sources(sources(three))[0]
    by_tokens = resolve_sources(sources(three), weight_by="tokens")[0]
    per_pass = {s.name: s.per_pass for s in by_samples}
    assert per_pass == {"short": 1800, "medium": 1080, "long": 720}
    tokens = {s.name: s.per_pass * s.supervised_per_sample for s in by_tokens}
    total = sum(tokens.values())
    for name, weight in WEIGHTS.items():  # but for whole samples: about 65 of the long one
        assert tokens[name] / total == pytest.approx(weight, abs=0.005)
    assert abs(sum(s.per_pass for s in by_tokens) - 3600) <= 1  # as many samples, rounded
    assert [s.chunk_cap(32) for s in by_tokens] == [32, 3, 1]  # chunks of like tokens


def test_a_schedule_by_tokens_keeps_its_token_shares_at_every_batch(three):
    """Each of a schedule's weights is divided by its source's supervised tokens per sample,
    so the share of the samples at any batch, times those numbers, is the token share the
    schedule gives there."""
    points = [(0, 1.0), (100, 0.2)]
    mixture = [
        Source(three["short"], name="short", weight=points, schedule="linear"),
        Source(three["long"], name="long", weight=1.0),
    ]
    resolved, _, schedule = resolve_sources(mixture, weight_by="tokens")
    per_sample = [s.supervised_per_sample for s in resolved]
    for t in (0, 25, 50, 100, 300):
        tokens = [share * n for share, n in zip(schedule.shares(t), per_sample, strict=True)]
        short = {0: 1.0, 25: 0.8, 50: 0.6}.get(t, 0.2)
        assert tokens[0] / sum(tokens) == pytest.approx(short / (short + 1.0))


def test_weight_by_tokens_needs_a_weight_on_every_source_and_a_known_spelling(three, tmp_path):
    with pytest.raises(ValueError, match="goes with weight= on every source"):
        resolve_sources([Source(three["short"]), Source(three["long"])], weight_by="tokens")
    with pytest.raises(ValueError, match="weight_by must be one of"):
        wdsvlm.Loader(sources(three), TOKENIZER, weight_by="words")
    path = tmp_path / "mixture.json"
    path.write_text(json.dumps({"sources": [{"path": three["short"]}], "weight_by": "chars"}))
    with pytest.raises(ValueError, match=f"{path}: weight_by must be one of"):
        Plan(str(path))


def run(loader, batches):
    """The first ``batches`` batches' supervised tokens per source, epoch after epoch (adding
    up to each batch's ``num_loss_tokens``)."""
    out, epoch = [], 0
    while len(out) < batches:
        loader.set_epoch(epoch)
        for batch in loader:
            out.append(dict(supervised_by_source(batch)))
            assert sum(out[-1].values()) == int(batch["num_loss_tokens"])  # every one, once
            if len(out) == batches:
                break
        epoch += 1
    return out


def test_the_batches_hold_each_sources_token_share_of_the_supervised_tokens(three):
    """Weights 0.5 / 0.3 / 0.2 by tokens over sources of about 13, 124 and 548 supervised
    tokens a sample: over 150 batches of 4 x 1024 the batches' supervised tokens (labels not
    ignored) are within 1.5 points of the weights (the packing window holds back a few
    thousand tokens of short samples at the start: 48.8% for the short source at 150 batches,
    50.0% at 600). The shuffle buffer hands each source's tokens on as evenly as they came
    (by tokens), so what moves a window of 50 batches (about 33 samples of the long source) is
    the packing window's order: every window (sliding by 10) is within 4 points (3.1 here;
    5.3 with the buffer's uniform draws; `scripts/measure_token_shares.py` measures 200
    batches of 8 x 2048). Weighted by samples, the same weights give the long source about 72%
    of the supervised tokens."""
    loader = wdsvlm.Loader(
        sources(three), TOKENIZER, max_length=1024, batch_size=4, weight_by="tokens"
    )
    per_batch = run(loader, 150)
    every = {name: sum(b.get(name, 0) for b in per_batch) for name in WEIGHTS}
    total = sum(every.values())
    for name, weight in WEIGHTS.items():
        assert every[name] / total == pytest.approx(weight, abs=0.015), every
    worst = worst_windows(per_batch, WEIGHTS, 50)
    assert max(abs(off) for off, _ in worst.values()) < 0.04, worst
    shares = loader.stats()["sources_supervised"]  # this epoch's, as the batches held them
    assert set(shares) == set(WEIGHTS) and sum(shares.values()) == pytest.approx(1.0)


def test_every_rank_of_any_topology_works_out_the_same_numbers_and_passes(three):
    """The supervised tokens per sample, the pass's counts and chunks are the same on every
    rank of 1, 2 and 3 (the same samples calibrate them everywhere), so every rank plans the
    same passes and a resume on another topology finds them again."""
    planned = set()
    for rank, world_size in [(0, 1), (1, 2), (2, 3)]:
        loader = wdsvlm.Loader(
            sources(three),
            TOKENIZER,
            max_length=1024,
            batch_size=4,
            weight_by="tokens",
            rank=rank,
            world_size=world_size,
        )
        numbers = [
            (s.supervised_per_sample, s.copies, s.extra, s.chunk_cap(32))
            for s in loader.plan.sources
        ]
        planned.add((tuple(numbers), loader.plan.order(0).entry_at(1000)))
    assert len(planned) == 1


def test_samples_that_packing_drops_count_no_supervised_tokens(three):
    """At ``max_length`` 640 about half of the long source's samples are too long and dropped
    (``too_many_tokens``): its supervised tokens per sample fall to about half, so that it
    gets twice the samples and keeps its token share."""
    options = {"batch_size": 4, "weight_by": "tokens"}
    whole = wdsvlm.Loader(sources(three), TOKENIZER, max_length=1024, **options)
    cut = wdsvlm.Loader(sources(three), TOKENIZER, max_length=640, **options)
    [short, _, long] = [s.supervised_per_sample for s in whole.plan.sources]
    [short_cut, _, long_cut] = [s.supervised_per_sample for s in cut.plan.sources]
    assert short_cut == short and 0.3 < long_cut / long < 0.7


def test_a_mixture_file_weighs_by_tokens_as_the_loader_setting_does(three, tmp_path):
    items = [{"path": three[n], "name": n, "weight": w} for n, w in WEIGHTS.items()]
    path = tmp_path / "mixture.yaml"
    path.write_text(json.dumps({"sources": items, "weight_by": "tokens"}))
    options = {"max_length": 1024, "batch_size": 4}
    from_file = wdsvlm.Loader(str(path), TOKENIZER, **options)
    given = wdsvlm.Loader(sources(three), TOKENIZER, weight_by="tokens", **options)
    assert [s.per_pass for s in from_file.plan.sources] == [s.per_pass for s in given.plan.sources]
    assert from_file.plan.sources[0].supervised_per_sample is not None


def test_a_state_saved_weighing_by_tokens_resumes_exactly_and_not_by_samples(three):
    """The estimate is part of the resume check: the same numbers are worked out again, and
    the next batches are the very ones; a Loader weighing by samples refuses the state."""
    options = {"max_length": 1024, "batch_size": 4, "weight_by": "tokens"}
    loader = wdsvlm.Loader(sources(three), TOKENIZER, **options)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    following = [next(batches)["input_ids"] for _ in range(2)]
    again = wdsvlm.Loader(sources(three), TOKENIZER, **options)
    again.load_state_dict(state)
    resumed = iter(again)
    assert all(bool((next(resumed)["input_ids"] == ids).all()) for ids in following)
    by_samples = wdsvlm.Loader(sources(three), TOKENIZER, max_length=1024, batch_size=4)
    with pytest.raises(ValueError, match="weight_by 'tokens' -> 'samples'"):
        by_samples.load_state_dict(state)


def test_a_shuffle_by_tokens_hands_each_sources_tokens_on_as_evenly_as_they_came():
    """A rare source of long samples (every 20th, 2000 characters of answer) among short
    ones: drawn uniformly from a buffer of 500, its share of each window of 400 samples
    handed on wanders; drawn by tokens, it stays near its share of what came in."""
    from wdsvlm.pipeline.shuffle import Shuffle
    from wdsvlm.pipeline.token_weights import supervised_estimate

    def inputs():
        for i in range(8000):
            long = i % 20 == 0
            yield {
                "__key__": str(i),
                "__pass__": 0,
                "__pos__": i,
                "__worker__": 0,
                "__source__": "long" if long else "short",
                "__meta__": {"chars": [30, 2000 if long else 20]},
            }

    def worst(by_tokens: bool) -> float:
        out = list(Shuffle(500, seed=1, by_tokens=by_tokens)(inputs()))
        shares = []
        for start in range(1000, len(out) - 1400, 100):  # past the buffer's filling
            window = out[start : start + 400]
            tokens = [supervised_estimate(s["__meta__"]) for s in window]
            long = sum(t for t, s in zip(tokens, window, strict=True) if s["__source__"] == "long")
            shares.append(long / sum(tokens))
        came = sum(supervised_estimate(s["__meta__"]) for s in inputs() if s["__pos__"] % 20 == 0)
        every = sum(supervised_estimate(s["__meta__"]) for s in inputs())
        return max(abs(x - came / every) for x in shares)

    uniform, even = worst(False), worst(True)
    assert even < 0.02 and even < uniform / 3, (uniform, even)
