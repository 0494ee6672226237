"""Evaluation loaders: every sample once over all ranks and workers, in the indexes' order,
the same exact length on every rank, empty rows where a rank has run out, no carry-over."""

from __future__ import annotations

import json
import math
import os
import types

import pytest
import torch

import wdsvlm
from wdsvlm.hf import evaluation_loss
from wdsvlm.pipeline.collate import Collate
from wdsvlm.storage.fs import ReadPolicy
from wdsvlm.testing.stores import RangeServer, serving
from wdsvlm.write.writer import write_dataset

from .conftest import EXAMPLE, write_jsonl
from .test_ddp import ddp

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"tile_size": 128, "max_image_side": 256, "tokens_per_tile": 16}
OPTIONS = {"max_length": 1024, "batch_size": 4, "evaluation": True, **SMALL}


def index_order(folder=EXAMPLE, prefix=""):
    index = json.load(open(os.path.join(folder, "index.json")))
    return [f"{prefix}{s['name']}/{e['key']}" for s in index["shards"] for e in s["entries"]]


def by_global_worker(source, world, workers, **options):
    """Per global worker, the keys its batches hold; and per rank, (len, batches yielded)."""
    keys, lengths = [], []
    for rank in range(world):
        loader = wdsvlm.Loader(
            source, TOKENIZER, rank=rank, world_size=world, num_workers=workers, **options
        )
        slots = [[] for _ in range(max(1, workers))]
        batches = list(loader)
        for i, batch in enumerate(batches):  # batch i comes from slot i % workers
            slots[i % len(slots)] += [k for row in batch["sample_keys"] for k in row]
            empty = [r for r, row in enumerate(batch["sample_keys"]) if not row]
            assert all(batch["labels"][r].eq(-100).all() for r in empty)
        keys += slots
        lengths.append((len(loader), len(batches)))
    return keys, lengths


@pytest.mark.parametrize("world, workers", [(1, 0), (3, 0), (2, 2)])
@pytest.mark.processes
def test_every_sample_once_in_the_indexes_order_and_every_rank_alike(world, workers):
    keys, lengths = by_global_worker(EXAMPLE, world, workers, **OPTIONS)
    assert len({n for n, _ in lengths}) == 1 and all(n == got for n, got in lengths)
    order = index_order()
    place = {k: i for i, k in enumerate(order)}
    # each global worker reads a contiguous block of the order; the blocks follow each other
    read = [k for share in keys for k in sorted(share, key=place.get)]
    assert read == order


def test_a_rank_with_no_sample_yields_as_many_batches_of_empty_rows(tmp_path):
    """A validation set of one sample over three ranks: rank 0 yields it, ranks 1 and 2 the
    same number of batches, every row empty, so no collective waits."""
    records = [{"id": "only", "conversations": [
        {"from": "human", "value": "What is two and two?"},
        {"from": "gpt", "value": "Four."},
    ]}]  # fmt: skip
    folder = str(tmp_path / "one")
    write_dataset(write_jsonl(str(tmp_path / "one.jsonl"), records), folder, progress=False)
    batches = []
    for rank in range(3):
        loader = wdsvlm.Loader(folder, TOKENIZER, rank=rank, world_size=3, **OPTIONS)
        assert len(loader) == 1
        batches.append(list(loader))
    assert [len(b) for b in batches] == [1, 1, 1]
    assert len([k for row in batches[0][0]["sample_keys"] for k in row]) == 1
    assert int(batches[0][0]["num_loss_tokens"]) > 0
    for rank in (1, 2):
        batch = batches[rank][0]
        assert batch["sample_keys"] == [[]] * 4 and int(batch["num_loss_tokens"]) == 0
        assert batch["input_ids"].shape == batches[0][0]["input_ids"].shape


def test_each_iteration_is_the_whole_pass_whatever_the_last_one_did():
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, **OPTIONS)
    whole = [b["sample_keys"] for b in loader]
    next(iter(loader))  # stopped after one batch: nothing is carried over
    assert [b["sample_keys"] for b in loader] == whole
    assert sorted(k for b in whole for row in b for k in row) == sorted(index_order())


def test_a_mixture_is_every_sample_of_each_source_once_with_its_source_named():
    mixture = [
        wdsvlm.Source(EXAMPLE, weight=3.0, name="a"),
        wdsvlm.Source(EXAMPLE, weight=1.0, name="b"),
    ]
    keys, lengths = by_global_worker(mixture, 2, 0, **OPTIONS)
    assert len({n for n, _ in lengths}) == 1
    expected = index_order(prefix="a/") + index_order(prefix="b/")
    place = {k: i for i, k in enumerate(expected)}
    assert [k for share in keys for k in sorted(share, key=place.get)] == expected
    loader = wdsvlm.Loader(mixture, TOKENIZER, **OPTIONS)
    sources = {s for b in loader for row in b["sample_sources"] for s in row}
    assert sources == {"a", "b"}


def test_an_evaluation_loader_refuses_an_epoch_length():
    with pytest.raises(ValueError, match="batches_per_epoch is set with evaluation=True"):
        wdsvlm.Loader(EXAMPLE, TOKENIZER, batches_per_epoch=3, **OPTIONS)


def one_sample_dataset(folder: str, question: str, answer: str) -> str:
    records = [{"id": "only", "conversations": [
        {"from": "human", "value": question}, {"from": "gpt", "value": answer},
    ]}]  # fmt: skip
    write_dataset(write_jsonl(folder + ".jsonl", records), folder, progress=False)
    return folder


class TinyLM(torch.nn.Module):
    """A language model of an embedding and a projection: each token's logits depend on that
    token alone, so its loss is the same in any row, batch or rank."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 16)
        self.out = torch.nn.Linear(16, vocab)

    def forward(self, input_ids, position_ids):
        return types.SimpleNamespace(logits=self.out(self.embed(input_ids)))


def evaluate_mixtures(mixtures: dict, **topology) -> dict:
    """``evaluation_loss`` of the same tiny model over each mixture (name -> [(source name,
    folder)]) on this rank."""
    figures = {}
    for name, sources in mixtures.items():
        mixture = [wdsvlm.Source(folder, name=source) for source, folder in sources]
        loader = wdsvlm.Loader(mixture, TOKENIZER, **OPTIONS, **topology)
        torch.manual_seed(0)
        model = TinyLM(len(loader.tokenizer))
        figures[name] = evaluation_loss(model, loader)
    return figures


def _evaluate_rank(rank, job):
    return evaluate_mixtures(job["mixtures"])


@pytest.mark.processes
def test_a_mixture_evaluates_on_three_ranks_where_one_has_only_empty_rows(tmp_path):
    """Two one-sample sources over three ranks (real processes, one gloo group): the rank
    without a sample runs batches of empty rows, which carry ``sample_sources`` too, and every
    rank gets the per-source losses of one process evaluating alone. A source whose sample
    cannot be packed (longer than max_length) has no token on any rank: no loss for it, not
    0.0."""
    a = one_sample_dataset(str(tmp_path / "a"), "What is two and two?", "Four.")
    b = one_sample_dataset(str(tmp_path / "b"), "Name a colour.", "Blue, like the sky.")
    c = one_sample_dataset(str(tmp_path / "c"), "Say a lot.", "word " * 3000)
    mixtures = {"ab": [("a", a), ("b", b)], "abc": [("a", a), ("b", b), ("c", c)]}
    ranks = ddp({"run": _evaluate_rank, "mixtures": mixtures, "out": str(tmp_path)}, 3, 300)
    alone = evaluate_mixtures(mixtures, rank=0, world_size=1)
    for figures in ranks:
        assert figures.keys() == alone.keys()
        for name in mixtures:
            assert figures[name] == pytest.approx(alone[name], rel=1e-9)
    ab = ranks[0]["ab"]
    assert ab["tokens/a"] > 0 and ab["tokens/b"] > 0
    assert ab["tokens"] == ab["tokens/a"] + ab["tokens/b"]
    assert math.isfinite(ab["loss/a"]) and math.isfinite(ab["loss/b"])
    abc = ranks[0]["abc"]
    assert abc["tokens/c"] == 0 and "loss/c" not in abc
    assert {k: abc[k] for k in ab} == pytest.approx(ab, rel=1e-9)


def test_a_batch_of_empty_rows_of_a_mixture_names_its_rows_sources():
    """Every key a consumer reads is in every batch: a mixture's batch of empty rows (the end
    of an evaluation pass, or a batch whose every sample failed) has ``sample_sources``."""
    batch = Collate(16, 3, 0, sources=True)([])
    assert batch["sample_sources"] == [[], [], []] and batch["sample_keys"] == [[], [], []]
    assert "sample_sources" not in Collate(16, 3, 0)([])  # one source: no sources named


class FaultyStore(RangeServer):
    """A ``RangeServer`` whose GETs of the files named in ``failing`` answer 503 Service
    Unavailable (a store's transient fault) for as long as they are named there."""

    def __init__(self, folder: str):
        super().__init__(folder)
        self.failing: set[str] = set()
        server = self

        class Faulty(self.RequestHandlerClass):
            def do_GET(self):
                if os.path.basename(self.path) in server.failing:
                    return self.send_error(503)
                return super().do_GET()

        self.RequestHandlerClass = Faulty

    def tar_bytes(self) -> int:
        """The bytes of shards (not of the index) sent so far."""
        return sum(n for name, n in self.served_by_name.items() if name.endswith(".tar"))


def faulty_store(folder: str):
    return serving(FaultyStore(folder))


def _evaluate_through_its_store(rank, job):
    """This rank reads the example through a store of its own (its bytes counted): built,
    len() with the shards ``job["failing"]`` failing on rank ``job["faulty"]``, then the store
    well again and the whole pass, with an all_reduce every step (a rank with a step more or
    less would hang there)."""
    import torch.distributed as dist

    with faulty_store(EXAMPLE) as store:
        if rank == job["faulty"]:
            store.failing = set(job["failing"])
        loader = wdsvlm.Loader(
            store.url,
            TOKENIZER,
            read_policy=ReadPolicy(attempts=1),
            on_shard_error="skip",
            **OPTIONS,
        )
        built = store.tar_bytes()
        length = len(loader)
        counted = store.tar_bytes() - built
        store.failing = set()
        keys, steps = [], 0
        for batch in loader:
            dist.all_reduce(batch["num_loss_tokens"].clone())
            keys += [k for row in batch["sample_keys"] for k in row]
            steps += 1
    return {"len": length, "steps": steps, "keys": keys, "built": built, "counted": counted}


def example_tar_bytes() -> int:
    return sum(s["bytes"] for s in json.load(open(os.path.join(EXAMPLE, "index.json")))["shards"])


@pytest.mark.processes
def test_building_an_evaluation_loader_reads_no_shard_and_its_length_reads_each_once(tmp_path):
    """Three ranks (real processes, each through a store of its own that counts the bytes it
    sends): building the Loader reads the index only, and counting its length reads each
    rank's own share, about a third of the shards' bytes, not all of them on every rank."""
    job = {"run": _evaluate_through_its_store, "faulty": None, "failing": [], "out": str(tmp_path)}
    ranks = ddp(job, 3, 300)
    whole = example_tar_bytes()
    assert [r["built"] for r in ranks] == [0, 0, 0]
    assert all(0 < r["counted"] < 0.45 * whole for r in ranks)
    assert sum(r["counted"] for r in ranks) <= whole
    assert len({r["len"] for r in ranks}) == 1 and all(r["steps"] == r["len"] for r in ranks)
    assert sorted(k for r in ranks for k in r["keys"]) == sorted(index_order())


@pytest.mark.processes
def test_ranks_take_the_same_steps_when_one_could_not_read_a_shard_while_counting(tmp_path):
    """On rank 1 of 3 two shards answer 503 while the length is counted (one try a read, shard
    errors skipped), then read well: every rank still takes the same number of steps (an
    all_reduce each step), and every sample comes once, rank 1's share whole too."""
    failing = ["shapes-000001.tar", "shapes-000003.tar"]  # in each global worker's share
    job = {"run": _evaluate_through_its_store, "faulty": 1, "failing": failing}
    ranks = ddp({**job, "out": str(tmp_path)}, 3, 300)
    lengths = [r["len"] for r in ranks]
    assert len(set(lengths)) == 1, lengths
    assert [r["steps"] for r in ranks] == lengths
    assert sorted(k for r in ranks for k in r["keys"]) == sorted(index_order())


def test_without_a_process_group_a_shard_unread_while_counting_is_refused_or_bounded():
    """No process group to agree with: with two ranks a shard that could not be read while
    counting is an error naming it (a rank that read it would count another length); with
    one rank its share counts as one sample a row, and the pass, reading it well, evaluates
    every sample once in that many batches."""
    skip = {"read_policy": ReadPolicy(attempts=1), "on_shard_error": "skip", **OPTIONS}
    with faulty_store(EXAMPLE) as store:
        store.failing = {"shapes-000001.tar"}
        two = wdsvlm.Loader(store.url, TOKENIZER, rank=0, world_size=2, **skip)
        with pytest.raises(wdsvlm.StorageError, match="shapes-000001.tar could not be read"):
            len(two)
        one = wdsvlm.Loader(store.url, TOKENIZER, **skip)
        assert len(one) == -(-320 // OPTIONS["batch_size"])  # one sample a row
        store.failing = set()
        keys = [k for batch in one for row in batch["sample_keys"] for k in row]
    assert sorted(keys) == sorted(index_order())


def test_a_state_saved_before_the_length_was_counted_resumes_to_the_whole_pass():
    """``state_dict()`` of an evaluation loader taken before its first ``len()`` or
    iteration records the counted length: loaded back (this rank's state, or all ranks'
    states on another topology) the loader yields the whole pass, not zero batches."""
    whole = wdsvlm.Loader(EXAMPLE, TOKENIZER, **OPTIONS)
    length = len(whole)
    state = wdsvlm.Loader(EXAMPLE, TOKENIZER, **OPTIONS).state_dict()
    assert state["config"]["batches_per_epoch"] == length
    again = wdsvlm.Loader(EXAMPLE, TOKENIZER, **OPTIONS)
    again.load_state_dict(state)
    assert len(again) == length
    keys = [k for batch in again for row in batch["sample_keys"] for k in row]
    assert sorted(keys) == sorted(index_order())
    states = [
        wdsvlm.Loader(EXAMPLE, TOKENIZER, rank=rank, world_size=2, **OPTIONS).state_dict()
        for rank in range(2)
    ]
    elsewhere = wdsvlm.Loader(EXAMPLE, TOKENIZER, **OPTIONS)
    elsewhere.load_state_dict(states)
    assert len(elsewhere) == length
    keys = [k for batch in elsewhere for row in batch["sample_keys"] for k in row]
    assert sorted(keys) == sorted(index_order())
    # states already saved uncounted (a length of 0) resume to the counted length too
    uncounted = [{**s, "config": {**s["config"], "batches_per_epoch": 0}} for s in states]
    for saved in (uncounted[0], uncounted):
        loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, rank=0, world_size=2, **OPTIONS)
        loader.load_state_dict(saved)
        assert len(loader) == len(list(loader)) > 0
    elsewhere = wdsvlm.Loader(EXAMPLE, TOKENIZER, **OPTIONS)
    elsewhere.load_state_dict(uncounted)
    assert len(elsewhere) == len(list(elsewhere)) == length


def test_the_length_is_agreed_on_the_gpu_the_launcher_gave_this_rank(monkeypatch):
    """NCCL's all_reduce of the length runs on the GPU ``LOCAL_RANK`` names (torchrun sets
    it), not on ``cuda:0`` for every rank of a script that never called
    ``torch.cuda.set_device``; gloo's on the CPU."""
    from wdsvlm.loader.evaluation import collective_device

    monkeypatch.setenv("LOCAL_RANK", "3")
    assert collective_device("nccl") == torch.device("cuda", 3)
    assert collective_device("gloo") == torch.device("cpu")
