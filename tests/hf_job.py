"""The rank side of tests/test_hf.py, under torchrun with 2 ranks (gloo, CPU, float32).

    torchrun --standalone --nproc_per_node=2 tests/hf_job.py OUT PHASE

PHASE "whole": for each case (a trainer class and a model family) a tiny random model trains 6
optimizer steps (8 in the first case, into epoch 1) on shards_example with wdsvlm.hf, saving a
checkpoint every 3 steps; the loss of step 1 is also computed by hand over both ranks' first
batches. PHASE "resumed": each case resumes from its checkpoint-3 (the first also from
checkpoint-6, at the end of epoch 0) and trains the remaining steps. Each rank writes
OUT/CASE/{whole,from-STEP}-RANK.json: the loss of every step and the samples (key and pass) of
every batch it took. PHASE
"accelerate": the documented Accelerate loop (scripts/train_accelerate.py's), each rank's
batches and its final weights' digest.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
import transformers

import wdsvlm
import wdsvlm.hf
from wdsvlm.testing.tiny import tiny_model, tiny_processor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "shards_example")
CASES = {
    # name: (trainer, family, gradient accumulation, DataLoader workers, steps, resumed from)
    # (the first: 8 steps of 2 batches cross the end of epoch 0, 12 batches, at step 6)
    "trainer-qwen2_5_vl": ("trainer", "qwen2_5_vl", 2, 1, 8, (3, 6)),
    "trainer-smolvlm": ("trainer", "smolvlm", 1, 0, 6, (3,)),
    "sft-qwen2_5_vl": ("sft", "qwen2_5_vl", 2, 0, 6, (3,)),
    "sft-smolvlm": ("sft", "smolvlm", 1, 0, 6, (3,)),
}


class RecordingLoader(wdsvlm.Loader):
    """A Loader that notes each batch's samples as it yields it: rows of ``"KEY@PASS"``."""

    def __iter__(self):
        self.taken = getattr(self, "taken", [])
        for batch in super().__iter__():
            rows = zip(batch["sample_keys"], batch["sample_passes"], strict=True)
            self.taken.append([[f"{k}@{p}" for k, p in zip(*row, strict=True)] for row in rows])
            yield batch


def make_loader(family: str, workers: int, cls=RecordingLoader):
    processor = tiny_processor(family)
    loader = cls(DATA, processor=processor, max_length=1024, batch_size=2, num_workers=workers)
    return processor, loader


# the case evaluated every 2 steps during training, on a mixture of two shards (tests item:
# evaluation leaves the training Loader, its checkpoints and the resume as they were)
EVALUATED = "trainer-smolvlm"
VALIDATION = [
    wdsvlm.Source(os.path.join(DATA, "shapes-000003.tar"), name="c"),
    wdsvlm.Source(os.path.join(DATA, "shapes-000004.tar"), name="d"),
]


class LoaderUntouched(transformers.TrainerCallback):
    """Notes, at each evaluation, whether the training Loader's state is the one it had at
    the end of the step before."""

    def __init__(self, loader):
        self.loader, self.before, self.same = loader, None, []

    def state(self) -> str:
        return json.dumps(self.loader.state_dict(), sort_keys=True)

    def on_step_end(self, args, state, control, **kwargs):
        self.before = self.state()

    def on_evaluate(self, args, state, control, **kwargs):
        self.same.append(self.state() == self.before)


def eval_by_hand(model, processor) -> dict:
    """The mean cross-entropy over every supervised token of the validation set, in all and
    per source, from one Loader of this rank alone (rank 0 of 1: other packs than the
    Trainer's two ranks make), summed here; and the mean of its per-batch means."""
    loader = wdsvlm.Loader(
        VALIDATION, processor=processor, max_length=2048, batch_size=3, evaluation=True,
        rank=0, world_size=1,
    )  # fmt: skip
    sums, means = {}, []
    with torch.no_grad():
        for batch in loader:
            inputs = wdsvlm.model_inputs(batch)
            labels = inputs.pop("labels")[:, 1:]
            losses = torch.nn.functional.cross_entropy(
                model(**inputs).logits[:, :-1].float().transpose(1, 2), labels,
                ignore_index=-100, reduction="none",
            )  # fmt: skip
            means.append(float(losses.sum() / (labels != -100).sum()))
            positions = batch["position_ids"]
            positions = positions[0] if positions.dim() == 3 else positions
            for r, row in enumerate(batch["sample_sources"]):  # samples: positions restart
                starts = (positions[r] == 0).nonzero().flatten().tolist()
                ends = starts[1:] + [labels.shape[1] + 1]
                for source, a, b in zip(row, starts, ends, strict=False):  # padding: not a row's
                    part = labels[r, max(0, a - 1) : b - 1] != -100
                    total = sums.setdefault(source, [0.0, 0])
                    total[0] += float(losses[r, max(0, a - 1) : b - 1][part].sum())
                    total[1] += int(part.sum())
    loader.close()
    everything = sum(v[0] for v in sums.values()) / sum(v[1] for v in sums.values())
    return {
        "loss": everything,
        **{f"loss_{k}": v[0] / v[1] for k, v in sums.items()},
        "mean_of_batch_means": sum(means) / len(means),
    }


def make_trainer(kind: str, model, loader, out: str, accumulation: int, steps: int, evaluate=None):
    settings = dict(
        output_dir=out,
        max_steps=steps,
        save_steps=3,
        logging_steps=1,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    if kind == "trainer" and evaluate is not None:
        settings.update(eval_strategy="steps", eval_steps=2)
        args = transformers.TrainingArguments(**settings)
        return wdsvlm.hf.Trainer(model=model, args=args, loader=loader, eval_dataset=evaluate)
    if kind == "trainer":
        args = transformers.TrainingArguments(**settings)
        return wdsvlm.hf.Trainer(model=model, args=args, loader=loader)
    import trl

    args = trl.SFTConfig(**settings)
    return wdsvlm.hf.with_loader(trl.SFTTrainer)(model=model, args=args, loader=loader)


def loss_by_hand(model, family: str, workers: int, accumulation: int) -> float:
    """The mean cross-entropy over every supervised token of step 1's batches on both ranks,
    with the initial weights: summed here, the sums and counts all-reduced."""
    _, loader = make_loader(family, workers, cls=wdsvlm.Loader)
    total = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for _, batch in zip(range(accumulation), loader, strict=False):
            inputs = wdsvlm.model_inputs(batch)
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            total[0] += torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, -2).float(),
                labels[:, 1:].flatten(),
                ignore_index=-100,
                reduction="sum",
            ).double()
            total[1] += int((labels[:, 1:] != -100).sum())
    loader.close()
    dist.all_reduce(total)
    return float(total[0] / total[1])


def run_case(name: str, out: str, resume_at: int | None = None) -> dict:
    """One run of the case: from the start into OUT/CASE/whole, or resumed from that run's
    checkpoint at step ``resume_at`` into OUT/CASE/from-STEP."""
    kind, family, accumulation, workers, steps, _ = CASES[name]
    folder = os.path.join(out, name)
    processor, loader = make_loader(family, workers)
    torch.manual_seed(0)
    model = tiny_model(family, processor)
    report = {"accumulation": accumulation, "steps": steps}
    evaluate = None
    if name == EVALUATED:
        evaluate = wdsvlm.Loader(
            VALIDATION, processor=processor, max_length=1024, batch_size=2, evaluation=True
        )
    run = (kind, model, loader)
    if resume_at is None:
        report["by_hand"] = loss_by_hand(model, family, workers, accumulation)
        trainer = make_trainer(*run, f"{folder}/whole", accumulation, steps, evaluate)
        untouched = LoaderUntouched(loader)
        trainer.add_callback(untouched)
        trainer.train()
        if evaluate is not None:
            report["untouched"] = untouched.same
            report["final_eval"] = trainer.evaluate()
            report["eval_by_hand"] = eval_by_hand(model, processor)
    else:
        at = f"{folder}/from-{resume_at}"
        trainer = make_trainer(*run, at, accumulation, steps, evaluate)
        trainer.train(resume_from_checkpoint=f"{folder}/whole/checkpoint-{resume_at}")
    history = trainer.state.log_history
    report["losses"] = {h["step"]: h["loss"] for h in history if "loss" in h}
    report["evals"] = {h["step"]: h for h in history if "eval_loss" in h}
    report["keys"] = loader.taken
    report["epochs"] = trainer.state.epoch
    loader.close()
    if evaluate is not None:
        evaluate.close()
    return report


def main() -> None:
    faulthandler.dump_traceback_later(400, exit=True)  # a hang prints every thread's stack
    out, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if phase == "accelerate":
        sys.path.insert(0, os.path.join(REPO, "scripts"))
        import train_accelerate

        report = train_accelerate.train(DATA, steps=4, loader_class=RecordingLoader)
        weights = hashlib.sha256()
        for value in report.pop("model").state_dict().values():
            weights.update(value.detach().cpu().numpy().tobytes())
        report["weights"] = weights.hexdigest()
        with open(os.path.join(out, f"accelerate-{rank}.json"), "w") as f:
            json.dump(report, f)
        return
    for name, case in CASES.items():
        for resume_at in (None,) if phase == "whole" else case[-1]:
            report = run_case(name, out, resume_at)
            label = "whole" if resume_at is None else f"from-{resume_at}"
            with open(os.path.join(out, name, f"{label}-{rank}.json"), "w") as f:
                json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
