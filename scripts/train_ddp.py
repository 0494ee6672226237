"""The main job: a tiny vision-language model trained with torchrun on wdsvlm's packed batches.

    torchrun --standalone --nproc_per_node=2 scripts/train_ddp.py [--data shards_example]
        [--model tiny|qwen2_vl-tiny|qwen2_5_vl-tiny|qwen3_vl-tiny|smolvlm-tiny|llava_onevision-tiny]
        [--epochs 2] [--max-steps N] [--out runs/train] [--resume] [--print-keys]

The model: a patch-embedding vision tower (one strided convolution per tile, one feature per
image token) and a projector feed a tiny randomly initialised transformers Llama; the image
tokens' embeddings are replaced by the vision features, in order. Packed samples are kept
apart with the block-diagonal mask (`wdsvlm.block_causal_mask`) and per-sample positions; the
loss is summed and divided by the global `num_loss_tokens` (all-reduced). Rank 0 logs loss,
tokens/s, the fill of the batches and the share of step time spent waiting for data. Each rank
saves the model, the optimizer and its loader state every `--save-every` steps and at the end;
`--resume` goes on from there.

`--model qwen2_5_vl-tiny` (or another family's) trains transformers' own architecture instead,
tiny and randomly initialised (`wdsvlm.testing.tiny`, built offline), on batches of the Loader made
with that family's processor: `model(**wdsvlm.model_inputs(batch))`, packed rows isolated by
their position ids alone.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import wdsvlm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TinyVLM(nn.Module):
    def __init__(self, vocab: int, image_token_id: int, tile: int, tokens_per_tile: int):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        side = math.isqrt(tokens_per_tile)
        if side * side != tokens_per_tile or tile % side:
            raise ValueError("tokens_per_tile must be a square whose root divides tile_size")
        patch = tile // side
        hidden = 64
        self.image_token_id = image_token_id
        self.patches = nn.Conv2d(3, 48, kernel_size=patch, stride=patch)
        self.project = nn.Sequential(nn.GELU(), nn.Linear(48, hidden))
        self.llm = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=vocab,
                hidden_size=hidden,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=4,
                max_position_embeddings=4096,
                attn_implementation="eager",
            )
        )

    def forward(self, batch: dict) -> torch.Tensor:
        ids = batch["input_ids"]
        embeds = self.llm.get_input_embeddings()(ids)
        if batch["pixel_values"].shape[0]:
            pixels = batch["pixel_values"].float() / 127.5 - 1  # uint8 -> [-1, 1], here
            features = self.project(self.patches(pixels).flatten(2).transpose(1, 2))
            is_image = ids == self.image_token_id
            embeds = embeds.masked_scatter(is_image[..., None], features.reshape(-1, 1, 1))
        mask = wdsvlm.block_causal_mask(batch["position_ids"], embeds.dtype)
        out = self.llm(
            inputs_embeds=embeds, attention_mask=mask, position_ids=batch["position_ids"]
        )
        return out.logits


FAMILY_MODELS = {
    f"{family}-tiny": family
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "smolvlm", "llava_onevision")
}


class FamilyModel(nn.Module):
    """A transformers VLM fed through ``wdsvlm.model_inputs``; returns the logits."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: dict) -> torch.Tensor:
        inputs = wdsvlm.model_inputs(batch)
        inputs.pop("labels")  # the loss is over the global batch's tokens, below
        return self.model(**inputs).logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(REPO, "shards_example"))
    parser.add_argument("--tokenizer", default=None, help="default: DATA/tokenizer")
    parser.add_argument(
        "--model",
        default="tiny",
        choices=["tiny", *FAMILY_MODELS],
        help="tiny: the patch-embedding model above; FAMILY-tiny: transformers' own",
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this step")
    parser.add_argument("--out", default="runs/train")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--tile-size", type=int, default=128)
    parser.add_argument("--max-image-side", type=int, default=256)
    parser.add_argument("--tokens-per-tile", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument(
        "--print-keys", action="store_true", help="print each step's first sample keys"
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")  # "nccl", and the model on the GPU, on GPU machines
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights on every rank
    sizes = {"max_length": args.max_length, "batch_size": args.batch_size}
    if args.model == "tiny":
        loader = wdsvlm.Loader(
            args.data,
            args.tokenizer or os.path.join(args.data, "tokenizer"),
            **sizes,
            num_workers=args.workers,
            tile_size=args.tile_size,
            max_image_side=args.max_image_side,
            tokens_per_tile=args.tokens_per_tile,
        )
        image_token = loader.tokenize.image_token_id
        model = nn.parallel.DistributedDataParallel(
            TinyVLM(len(loader.tokenizer), image_token, args.tile_size, args.tokens_per_tile)
        )
    else:
        from wdsvlm.testing.tiny import tiny_model, tiny_processor

        family = FAMILY_MODELS[args.model]
        processor = tiny_processor(family)
        loader = wdsvlm.Loader(args.data, processor=processor, **sizes, num_workers=args.workers)
        # a batch without images leaves the vision tower out of the graph
        model = nn.parallel.DistributedDataParallel(
            FamilyModel(tiny_model(family, processor)), find_unused_parameters=True
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    os.makedirs(args.out, exist_ok=True)
    checkpoint = os.path.join(args.out, f"checkpoint-rank{rank}.pt")
    step, first_epoch = 0, 0
    if args.resume:
        saved = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])
        step, first_epoch = saved["step"], saved["loader"]["epoch"]
        if rank == 0:
            print(f"resumed at step {step} (epoch {first_epoch})", flush=True)

    def save() -> None:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save({**state, "loader": loader.state_dict(), "step": step}, checkpoint)

    if rank == 0:
        print(
            f"{world} ranks, {len(loader)} batches of {list((args.batch_size, args.max_length))}"
            " an epoch",
            flush=True,
        )
    done, losses, run_started = False, [], time.perf_counter()
    for epoch in range(first_epoch, args.epochs):
        loader.set_epoch(epoch)
        batches = iter(loader)
        waited = computed = tokens = room = 0.0
        started = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            batch = next(batches, None)
            t1 = time.perf_counter()
            if batch is None:
                break
            logits = model(batch)
            loss_sum = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(),
                batch["labels"][:, 1:].flatten(),
                reduction="sum",
            )
            # one all-reduce: the loss tokens of every rank, and the summed loss for the log
            both = torch.stack([loss_sum.detach(), batch["num_loss_tokens"].to(loss_sum.dtype)])
            dist.all_reduce(both)
            global_tokens = both[1].clamp(min=1)
            loss = loss_sum * world / global_tokens  # DDP averages gradients over ranks
            mean_loss = (both[0] / global_tokens).item()  # over every rank's tokens
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            waited += t1 - t0
            computed += time.perf_counter() - t1
            tokens += int(batch["attention_mask"].sum())
            room += batch["attention_mask"].numel()
            losses.append(mean_loss)
            if rank == 0 and args.print_keys:
                keys = batch["sample_keys"][0][:2]
                print(f"step {step} keys {' '.join(keys)}", flush=True)
            if rank == 0 and step % args.log_every == 0:
                elapsed = time.perf_counter() - started
                print(
                    f"epoch {epoch} step {step}: loss {mean_loss:.3f}, "
                    f"{tokens * world / elapsed:.0f} tokens/s, fill {tokens / room:.1%}, "
                    f"waiting for data {waited / (waited + computed):.0%} of the time",
                    flush=True,
                )
            if step % args.save_every == 0:
                save()
            if args.max_steps and step >= args.max_steps:
                done = True
                break
        if done:
            break
    save()
    if rank == 0:
        if losses:
            print(
                f"trained {len(losses)} steps in {time.perf_counter() - run_started:.1f} s: "
                f"loss {losses[0]:.3f} -> {losses[-1]:.3f}",
                flush=True,
            )
        print(f"saved {checkpoint} at step {step}", flush=True)
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
