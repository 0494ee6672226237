"""The rank side of tests/test_multinode.py: ranks of several nodes reading a dataset on S3.

    torchrun --nnodes=2 --node_rank=R --nproc_per_node=2 --rdzv-endpoint=127.0.0.1:PORT \
        tests/multinode_job.py OUT train
    torchrun --standalone --nproc_per_node=3 tests/multinode_job.py OUT resume

The node's object store endpoint, bucket URL and shard cache come in ``WDSVLM_TEST_STORE``
(JSON: ``url``, ``endpoint``, ``cache_dir``). PHASE "train": 2 epochs with 2 workers a rank;
each rank writes OUT/train-RANK.json: each batch's samples as ``[pass, key]`` and the state
after each batch. PHASE "resume": every rank loads the states of all 4 ranks after batch
``STEP`` (from the train files) and takes the rest of epoch 0 and epoch 1; OUT/resume-RANK.json.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys

import torch.distributed as dist

import wdsvlm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "shards_example", "tokenizer")
SETTINGS = {
    "max_length": 1024,
    "batch_size": 2,
    "num_workers": 2,
    "batches_per_epoch": 8,  # no length estimate: every byte read from the store is a shard's
    "tile_size": 128,
    "max_image_side": 256,
    "tokens_per_tile": 16,
}
EPOCHS, STEP = 2, 3


def loader() -> wdsvlm.Loader:
    store = json.loads(os.environ["WDSVLM_TEST_STORE"])
    options = {"client_kwargs": {"endpoint_url": store["endpoint"]}}
    return wdsvlm.Loader(
        store["url"],
        TOKENIZER,
        storage_options=options,
        cache_dir=store["cache_dir"],
        **SETTINGS,
    )


def take(run: wdsvlm.Loader, first_epoch: int) -> dict:
    batches, states = [], []
    for epoch in range(first_epoch, EPOCHS):
        run.set_epoch(epoch)
        for batch in run:
            rows = zip(batch["sample_passes"], batch["sample_keys"], strict=True)
            pairs = [zip(passes, keys, strict=True) for passes, keys in rows]
            batches.append([[p, k] for row in pairs for p, k in row])
            states.append(run.state_dict())
    return {"batches": batches, "states": states, "len": len(run)}


def main() -> None:
    faulthandler.dump_traceback_later(400, exit=True)  # a hang prints every thread's stack
    out, phase = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run = loader()
    if phase == "train":
        report = take(run, 0)
    else:
        saved = [json.load(open(os.path.join(out, f"train-{r}.json"))) for r in range(4)]
        run.load_state_dict([s["states"][STEP - 1] for s in saved])
        report = take(run, 0)
        del report["states"]
    run.close()
    with open(os.path.join(out, f"{phase}-{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
