"""wdsvlm.hf: the Hugging Face Trainer and TRL's SFTTrainer on a Loader, under torchrun with 2
ranks (tests/hf_job.py), and the documented Accelerate loop; the settings it refuses; the
weights and Loader states its checkpoints hold."""

from __future__ import annotations

import inspect
import json
import math
import os
import sys
import weakref

import pytest
import torch
import transformers

import wdsvlm
import wdsvlm.hf
from wdsvlm.errors import WdsvlmError
from wdsvlm.testing.tiny import tiny_model, tiny_processor

from .conftest import REPO, run_process

DATA = os.path.join(REPO, "shards_example")
CASES = {  # the case: the steps it resumes from (tests/hf_job.py)
    "trainer-qwen2_5_vl": (3, 6),
    "trainer-smolvlm": (3,),
    "sft-qwen2_5_vl": (3,),
    "sft-smolvlm": (3,),
}


def torchrun(out, phase: str) -> None:
    command = [
        os.path.join(os.path.dirname(sys.executable), "torchrun"),
        "--standalone",
        "--nproc_per_node=2",
        os.path.join(REPO, "tests", "hf_job.py"),
        str(out),
        phase,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    run = run_process(command, timeout=420, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case's reports: {case: {"whole" or STEP resumed from: [rank 0's, rank 1's]}}."""
    out = tmp_path_factory.mktemp("hf")
    torchrun(out, "whole")
    torchrun(out, "resumed")
    reports = {}
    for case, resumed in CASES.items():
        reports[case] = {
            label: [json.load(open(out / case / f"{name}-{rank}.json")) for rank in (0, 1)]
            for label, name in [("whole", "whole")] + [(at, f"from-{at}") for at in resumed]
        }
    return reports


@pytest.mark.processes
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_a_run_resumed_from_its_checkpoint_takes_the_same_samples_with_the_same_losses(runs, case):
    for rank in (0, 1):
        whole = runs[case]["whole"][rank]
        accumulation, steps = whole["accumulation"], whole["steps"]
        # one optimizer step per accumulated batches
        assert len(whole["keys"]) == steps * accumulation
        assert sorted(whole["losses"], key=int) == [str(s) for s in range(1, steps + 1)]
        assert all(math.isfinite(x) for x in whole["losses"].values())
        assert whole["losses"][str(steps)] < whole["losses"]["1"]  # it learns
        if case == "trainer-qwen2_5_vl":  # into epoch 1, resumed also at the end of epoch 0
            assert whole["epochs"] > 1 and 6 in CASES[case]
        for at in CASES[case]:
            resumed = runs[case][at][rank]
            # no batch replayed or skipped: the resumed run's are the uninterrupted run's
            assert resumed["keys"] == whole["keys"][at * accumulation :]
            assert sorted(resumed["losses"]) == sorted(whole["losses"])
            for step in range(at + 1, steps + 1):
                assert abs(resumed["losses"][str(step)] - whole["losses"][str(step)]) <= 1e-6
            assert resumed["epochs"] == whole["epochs"]
    # each rank took its own samples from its Loader (a sample once per pass over both ranks):
    # Accelerate did not re-shard them
    ranks = [
        {k for row_keys in r["keys"] for row in row_keys for k in row} for r in runs[case]["whole"]
    ]
    assert ranks[0] and ranks[1] and not ranks[0] & ranks[1]


@pytest.mark.processes
@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_the_loss_of_a_step_is_the_mean_over_every_supervised_token_of_both_ranks(runs, case):
    """Computed by hand over both ranks' batches of step 1 (2 accumulated batches each for the
    Qwen cases): a loss averaged per rank or per batch would differ by about 1e-3."""
    for rank in (0, 1):
        whole = runs[case]["whole"][rank]
        assert math.isclose(whole["losses"]["1"], whole["by_hand"], rel_tol=1e-5)


@pytest.mark.processes
@pytest.mark.timeout(900)
def test_evaluation_is_the_mean_over_every_validation_token_and_leaves_training_as_it_was(runs):
    """trainer-smolvlm evaluates a mixture of two shards every 2 steps (tests/hf_job.py): the
    training Loader's state is the same before and after each evaluation, the run resumed
    from step 3 evaluates to the same losses at steps 4 and 6, and evaluate() at the end
    equals the loss summed over every supervised token of the validation set by hand (on
    other packs), in all and per source, on both ranks."""
    case = runs["trainer-smolvlm"]
    for rank in (0, 1):
        whole, resumed = case["whole"][rank], case[3][rank]
        assert whole["untouched"] == [True, True, True, True]  # steps 2, 4, 6 and the end
        assert sorted(whole["evals"], key=int) == ["2", "4", "6"]
        for step in ("4", "6"):
            assert math.isclose(
                resumed["evals"][step]["eval_loss"], whole["evals"][step]["eval_loss"],
                rel_tol=1e-6,
            )  # fmt: skip
        final, by_hand = whole["final_eval"], whole["eval_by_hand"]
        for key in ("loss", "loss_c", "loss_d"):
            assert math.isclose(final[f"eval_{key}"], by_hand[key], rel_tol=1e-5), key
        assert set(whole["evals"]["2"]) >= {"eval_loss", "eval_loss_c", "eval_loss_d"}
    assert (
        case["whole"][0]["final_eval"]["eval_loss"] == case["whole"][1]["final_eval"]["eval_loss"]
    )


@pytest.mark.processes
@pytest.mark.timeout(420)
def test_the_accelerate_loop_trains_each_rank_on_its_own_batches(tmp_path):
    torchrun(tmp_path, "accelerate")
    reports = [json.load(open(tmp_path / f"accelerate-{rank}.json")) for rank in (0, 1)]
    assert reports[0]["weights"] == reports[1]["weights"]  # DDP kept the ranks in step
    assert reports[0]["losses"] == reports[1]["losses"]  # the loss over both ranks' tokens
    assert len(reports[0]["losses"]) == 4 and reports[0]["losses"][-1] < reports[0]["losses"][0]
    keys = [{k for rows in r["keys"] for row in rows for k in row} for r in reports]
    assert keys[0] and keys[1] and not keys[0] & keys[1]


# --- one process -------------------------------------------------------------------------


def arguments(tmp_path, **change) -> transformers.TrainingArguments:
    settings = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
    )
    return transformers.TrainingArguments(**{**settings, **change})


@pytest.fixture(scope="module")
def qwen_processor():
    return tiny_processor("qwen2_5_vl")


@pytest.fixture
def qwen(qwen_processor):
    """A processor and a fresh Loader over it."""
    loader = wdsvlm.Loader(DATA, processor=qwen_processor, max_length=1024, batch_size=2)
    yield qwen_processor, loader
    loader.close()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"dataloader_drop_last": True}, "dataloader_drop_last=True cannot be used"),
        (
            {"train_sampling_strategy": "group_by_length"},
            "train_sampling_strategy='group_by_length' cannot be used",
        ),
        ({"average_tokens_across_devices": False}, "average_tokens_across_devices=False"),
        ({"dataloader_num_workers": 2}, r"set wdsvlm.Loader\(num_workers=...\) instead"),
        ({"ignore_data_skip": True}, "ignore_data_skip=True cannot be used"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor cannot be used"),
    ],
)
def test_settings_that_cannot_work_with_packed_batches_are_refused(qwen, tmp_path, change, message):
    processor, loader = qwen
    model = tiny_model("qwen2_5_vl", processor)
    with pytest.raises(ValueError, match=message):
        wdsvlm.hf.Trainer(model=model, args=arguments(tmp_path, **change), loader=loader)


def test_a_dataset_or_collator_passed_with_the_loader_is_refused(qwen, tmp_path):
    processor, loader = qwen
    model = tiny_model("qwen2_5_vl", processor)
    for key in ("train_dataset", "data_collator"):
        with pytest.raises(TypeError, match=f"{key} cannot be passed with loader="):
            wdsvlm.hf.Trainer(model=model, args=arguments(tmp_path), loader=loader, **{key: [1]})
    with pytest.raises(TypeError, match="needs loader="):
        wdsvlm.hf.Trainer(model=model, args=arguments(tmp_path))
    with pytest.raises(TypeError, match="takes a transformers.Trainer class"):
        wdsvlm.hf.with_loader(dict)


def test_an_attention_that_cannot_keep_packed_samples_apart_is_refused(qwen, tmp_path):
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("wdsvlm_test_attention", sdpa_attention_forward)
    processor, loader = qwen
    model = tiny_model("qwen2_5_vl", processor)
    model.set_attn_implementation("wdsvlm_test_attention")
    with pytest.raises(ValueError, match="'wdsvlm_test_attention' builds no attention mask"):
        wdsvlm.hf.Trainer(model=model, args=arguments(tmp_path), loader=loader)


def test_a_qwen2_5_vl_whose_video_timing_is_not_the_published_one_is_refused(
    qwen, videos, tmp_path
):
    """The Loader steps a video's temporal positions 2 per second, as Qwen2.5-VL is published;
    on data with videos, a model configured otherwise (its config class defaults to 4) would
    get wrong positions. Data without videos has no such positions: any value does."""
    from .conftest import write_jsonl

    processor, loader = qwen
    model = tiny_model("qwen2_5_vl", processor)
    model.config.vision_config.tokens_per_second = 4
    wdsvlm.hf.Trainer(model=model, args=arguments(tmp_path), loader=loader)  # images only
    (tmp_path / "a.mp4").write_bytes(videos["fps25"][1])
    convo = [{"from": "human", "value": "<video>\nQ?"}, {"from": "gpt", "value": "A."}]
    records = [{"id": "v", "video": "a.mp4", "conversations": convo}]
    out = str(tmp_path / "data")
    wdsvlm.write_dataset(write_jsonl(str(tmp_path / "in.jsonl"), records), out, progress=False)
    with_videos = wdsvlm.Loader(out, processor=processor, max_length=1024, batch_size=1)
    with pytest.raises(ValueError, match="vision_config.tokens_per_second is 4.*step 2 per"):
        wdsvlm.hf.Trainer(model=model, args=arguments(tmp_path), loader=with_videos)
    model.config.vision_config.tokens_per_second = 2  # as published
    wdsvlm.hf.Trainer(model=model, args=arguments(tmp_path), loader=with_videos)
    with_videos.close()


def test_a_checkpoint_restores_the_weights_under_their_current_names(qwen, tmp_path):
    """transformers saves Qwen2.5-VL's text weights under their old names and its Trainer
    loads them back unconverted, leaving them as they were: wdsvlm.hf maps them back."""
    processor, loader = qwen
    model = tiny_model("qwen2_5_vl", processor, seed=1)
    args = arguments(tmp_path, save_strategy="steps", save_steps=2, learning_rate=1e-2)
    wdsvlm.hf.Trainer(model=model, args=args, loader=loader).train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert (checkpoint / "loader_states" / "rank-00000-of-00001.json").is_file()
    fresh = tiny_model("qwen2_5_vl", processor, seed=2)
    trainer = wdsvlm.hf.Trainer(model=fresh, args=arguments(tmp_path), loader=loader)
    trainer._load_from_checkpoint(str(checkpoint))
    trained = model.state_dict()
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, trained[name]), name


def test_a_checkpoint_without_loader_states_is_refused_naming_it(qwen, tmp_path):
    processor, loader = qwen
    model = tiny_model("qwen2_5_vl", processor)
    folder = tmp_path / "checkpoint-5"
    folder.mkdir()
    trainer = wdsvlm.hf.Trainer(model=model, args=arguments(tmp_path), loader=loader)
    with pytest.raises(WdsvlmError, match="checkpoint-5 holds no Loader state"):
        trainer.train(resume_from_checkpoint=str(folder))


class TilingModel(torch.nn.Module):
    """A model of the default tiling: it takes the batch's fields by name."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 16)
        self.pixels = torch.nn.Linear(3, 16)
        self.head = torch.nn.Linear(16, vocab)

    def forward(self, input_ids, labels=None, position_ids=None, pixel_values=None):
        hidden = self.embed(input_ids)
        if pixel_values is not None and len(pixel_values):
            hidden = hidden + self.pixels(pixel_values.float().mean((2, 3))).mean(0)
        return transformers.modeling_outputs.CausalLMOutput(logits=self.head(hidden))


def test_a_default_tiling_loader_feeds_its_own_model_by_field_name(tmp_path):
    loader = wdsvlm.Loader(
        DATA,
        os.path.join(DATA, "tokenizer"),
        max_length=512,
        batch_size=2,
        tile_size=64,
        max_image_side=128,
        tokens_per_tile=4,
    )
    model = TilingModel(len(loader.tokenizer))
    trainer = wdsvlm.hf.Trainer(
        model=model, args=arguments(tmp_path, logging_steps=1), loader=loader
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert loader.batches_done == 2 and len(trainer.get_train_dataloader()) == len(loader)


def test_a_loader_not_where_the_trainer_starts_is_refused_naming_both(qwen, tmp_path):
    """The Trainer counts where it resumes from its steps: with another gradient accumulation
    it would start elsewhere than the Loader's state stands, so nothing is trained."""
    processor, loader = qwen
    args = arguments(tmp_path, save_strategy="steps", save_steps=2)
    wdsvlm.hf.Trainer(model=tiny_model("qwen2_5_vl", processor), args=args, loader=loader).train()
    other = arguments(tmp_path, max_steps=3, gradient_accumulation_steps=2)
    trainer = wdsvlm.hf.Trainer(
        model=tiny_model("qwen2_5_vl", processor), args=other, loader=loader
    )
    with pytest.raises(WdsvlmError, match="resumes at batch 4 of epoch 0, but the Loader's state"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))


def test_a_sharded_checkpoint_is_loaded_one_shard_at_a_time(qwen, tmp_path, monkeypatch):
    """Each rank loads the checkpoint's weights: holding every shard at once would take the
    model's size times the ranks of a node in host memory."""
    import safetensors.torch

    processor, loader = qwen
    saved = tiny_model("qwen2_5_vl", processor, seed=1)
    checkpoint = tmp_path / "checkpoint-1"
    saved.save_pretrained(checkpoint, max_shard_size="300KB")
    shards = sorted(checkpoint.glob("model-*.safetensors"))
    assert len(shards) >= 3
    fresh = tiny_model("qwen2_5_vl", processor, seed=2)
    trainer = wdsvlm.hf.Trainer(model=fresh, args=arguments(tmp_path), loader=loader)
    load_file = safetensors.torch.load_file
    loaded: list[list[weakref.ref]] = []  # the tensors of each shard loaded so far
    held = []  # at each load: the shards still held, this one included

    def counting_load_file(*args, **kwargs):
        held.append(1 + sum(any(t() is not None for t in refs) for refs in loaded))
        tensors = load_file(*args, **kwargs)
        loaded.append([weakref.ref(t) for t in tensors.values()])
        return tensors

    monkeypatch.setattr(safetensors.torch, "load_file", counting_load_file)
    trainer._load_from_checkpoint(str(checkpoint))
    assert len(held) == len(shards) and max(held) == 1, held
    trained = saved.state_dict()
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, trained[name]), name


def test_a_checkpoint_missing_a_weight_is_refused_before_the_model_is_touched(qwen, tmp_path):
    processor, loader = qwen
    checkpoint = tmp_path / "checkpoint-1"
    tiny_model("qwen2_5_vl", processor, seed=1).save_pretrained(checkpoint, max_shard_size="300KB")
    index = json.load(open(checkpoint / "model.safetensors.index.json"))
    gone = sorted(checkpoint.glob("model-*.safetensors"))[-1]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != gone.name}
    json.dump(index, open(checkpoint / "model.safetensors.index.json", "w"))
    fresh = tiny_model("qwen2_5_vl", processor, seed=2)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    trainer = wdsvlm.hf.Trainer(model=fresh, args=arguments(tmp_path), loader=loader)
    with pytest.raises(WdsvlmError, match=r"checkpoint-1 does not hold this model's weights: \d"):
        trainer._load_from_checkpoint(str(checkpoint))
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_a_loader_built_for_other_ranks_than_the_trainers_is_refused_naming_both(
    qwen_processor, tmp_path
):
    """A Loader built before init_process_group (or given other ranks) splits the data for
    ranks the Trainer does not run as: every rank would take another's samples."""
    loader = wdsvlm.Loader(
        DATA, processor=qwen_processor, max_length=1024, batch_size=2, rank=1, world_size=2
    )
    try:
        model = tiny_model("qwen2_5_vl", qwen_processor)
        trainer = wdsvlm.hf.Trainer(model=model, args=arguments(tmp_path), loader=loader)
        message = (
            r"Loader was built for rank 1 of world size 2, but this Trainer runs as rank 0 of "
            r"world size 1: build the Loader after torch.distributed.init_process_group .*"
            r"wdsvlm.Loader\(rank=..., world_size=...\)"
        )
        with pytest.raises(WdsvlmError, match=message):
            trainer.train()
        assert loader.batches_done == 0
    finally:
        loader.close()


def test_the_epoch_is_found_when_the_trainer_passes_it_by_position(qwen, tmp_path):
    """A Trainer (or subclass) calling ``_run_epoch`` with positional arguments resumes as
    one passing them by name: wdsvlm.hf finds the epoch either way."""
    processor, loader = qwen

    class PositionalTrainer(wdsvlm.hf.Trainer):
        def _run_epoch(self, *args, **kwargs):
            signature = inspect.signature(transformers.Trainer._run_epoch)
            bound = signature.bind(self, *args, **kwargs)
            assert not bound.kwargs  # every argument goes by position
            return super()._run_epoch(*bound.args[1:])

    args = arguments(tmp_path, save_strategy="steps", save_steps=2)
    model = tiny_model("qwen2_5_vl", processor)
    PositionalTrainer(model=model, args=args, loader=loader).train()
    other = arguments(tmp_path, max_steps=3)
    trainer = PositionalTrainer(
        model=tiny_model("qwen2_5_vl", processor), args=other, loader=loader
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))
    assert trainer.state.global_step == 3 and loader.batches_done == 3
