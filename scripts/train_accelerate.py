"""A training loop on Accelerate with a wdsvlm Loader: the model and optimizer are prepared, the
Loader is not (each rank iterates its own Loader, which already splits the data across ranks).

    accelerate launch --num_processes 2 scripts/train_accelerate.py [--steps 20]
    torchrun --standalone --nproc_per_node=2 scripts/train_accelerate.py

A tiny random Qwen2.5-VL (wdsvlm.testing.tiny) trains on shards_example through its processor;
the loss of each step is the mean over the supervised tokens of every rank.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator

import wdsvlm
from wdsvlm.testing.tiny import tiny_model, tiny_processor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(data: str, steps: int, loader_class: type = wdsvlm.Loader) -> dict:
    accelerator = Accelerator(cpu=True)
    processor = tiny_processor("qwen2_5_vl")
    # not prepared: accelerator.prepare would re-shard the Loader's batches
    loader = loader_class(data, processor=processor, max_length=1024, batch_size=2)
    model = tiny_model("qwen2_5_vl", processor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses, step, epoch = [], 0, 0
    while step < steps:
        loader.set_epoch(epoch)
        for batch in loader:
            inputs = wdsvlm.model_inputs(batch, device=accelerator.device)
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            loss_sum = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(),
                labels[:, 1:].flatten(),
                ignore_index=-100,
                reduction="sum",
            )
            # the supervised tokens of every rank; DDP averages the gradients over the ranks
            both = torch.stack([loss_sum.detach(), (labels[:, 1:] != -100).sum().float()])
            both = accelerator.reduce(both, reduction="sum")
            loss = loss_sum * accelerator.num_processes / both[1].clamp(min=1)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            losses.append(float(both[0] / both[1].clamp(min=1)))
            accelerator.print(f"step {step}: loss {losses[-1]:.4f}")
            if step == steps:
                break
        epoch += 1
    loader.close()
    return {
        "losses": losses,
        "keys": getattr(loader, "taken", None),
        "model": accelerator.unwrap_model(model),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(REPO, "shards_example"))
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    train(args.data, args.steps)


if __name__ == "__main__":
    main()
