"""The rank side of tests/test_hf.py, under torchrun with 2 ranks (gloo, CPU, float32).

    torchrun --standalone --nproc_per_node=2 tests/hf_job.py OUT PHASE

PHASE "whole": for each case (a trainer class and a model family) a tiny random model trains 6
optimizer steps on shards_example with wdsvlm.hf, saving a checkpoint at step 3; the loss of
step 1 is also computed by hand over both ranks' first batches. PHASE "resumed": each case
resumes from its checkpoint-3 and trains steps 4-6. Each rank writes OUT/CASE/PHASE-RANK.json:
the loss of every step and the samples (key and pass) of every batch it took. PHASE
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
    # name: (trainer, family, gradient accumulation, DataLoader workers)
    "trainer-qwen2_5_vl": ("trainer", "qwen2_5_vl", 2, 1),
    "trainer-smolvlm": ("trainer", "smolvlm", 1, 0),
    "sft-qwen2_5_vl": ("sft", "qwen2_5_vl", 2, 0),
    "sft-smolvlm": ("sft", "smolvlm", 1, 0),
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


def make_trainer(kind: str, model, loader, out: str, accumulation: int):
    settings = dict(
        output_dir=out,
        max_steps=6,
        save_steps=3,
        logging_steps=1,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
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


def run_case(name: str, phase: str, out: str) -> dict:
    kind, family, accumulation, workers = CASES[name]
    folder = os.path.join(out, name)
    processor, loader = make_loader(family, workers)
    torch.manual_seed(0)
    model = tiny_model(family, processor)
    report = {}
    if phase == "whole":
        report["by_hand"] = loss_by_hand(model, family, workers, accumulation)
    trainer = make_trainer(kind, model, loader, folder, accumulation)
    resume = os.path.join(folder, "checkpoint-3") if phase == "resumed" else None
    trainer.train(resume_from_checkpoint=resume)
    report["losses"] = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    report["keys"] = loader.taken
    report["accumulation"] = accumulation
    loader.close()
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
    for name in CASES:
        report = run_case(name, phase, out)
        with open(os.path.join(out, name, f"{phase}-{rank}.json"), "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
