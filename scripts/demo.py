"""The demo job (`make demo`): check a dataset, read it back two ways, and size its samples.

    python scripts/demo.py [SOURCE]     (default: shards_example)

1. Every shard's size and sha256 against index.json.
2. Every sample streamed with plain `webdataset`, as any WebDataset reader would.
3. A few samples read straight from their byte offsets in the index (what the loader's range
   reads and exact resume rely on), compared with the streamed ones.
4. Token counts per sample with the dataset's tokenizer and chat template (text only: image
   tokens are added by the tokenize stage, not yet built), and what naive pad-to-longest
   batching of those would waste.
"""

from __future__ import annotations

import io
import json
import os
import random
import sys
import tarfile
import time

import webdataset as wds

from wdsvlm import verify_dataset
from wdsvlm.storage import filesystem, join


def read_sample_at(source: str, shard: str, entry: dict) -> dict[str, bytes]:
    """One sample's members, read from its byte range only."""
    fs, path = filesystem(join(source, shard))
    with fs.open(path, "rb") as f:
        f.seek(entry["offset"])
        chunk = f.read(entry["size"])
    with tarfile.open(fileobj=io.BytesIO(chunk)) as tar:
        return {m.name.split(".", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers()}


def main() -> None:
    source = sys.argv[1] if len(sys.argv) > 1 else "shards_example"
    started = time.perf_counter()
    index = verify_dataset(source)
    totals = index["totals"]
    print(
        f"[1] {source}: {totals['shards']} shards, {totals['bytes'] / 1e6:.1f} MB, match index.json"
    )

    urls = [join(source, s["name"]) for s in index["shards"]]
    streamed = {}
    for sample in wds.WebDataset(urls, shardshuffle=False):
        streamed[sample["__key__"]] = sample
    images = sum(1 for s in streamed.values() for k in s if k[0].isdigit())
    assert len(streamed) == totals["samples"], (len(streamed), totals["samples"])
    print(f"[2] streamed {len(streamed)} samples, {images} images with plain webdataset")

    rng = random.Random(0)
    picks = rng.sample([(s["name"], e) for s in index["shards"] for e in s["entries"]], 10)
    for shard, entry in picks:
        members = read_sample_at(source, shard, entry)
        same = all(streamed[entry["key"]][name] == data for name, data in members.items())
        assert same, f"{shard}/{entry['key']}: range read differs from the stream"
    print(f"[3] {len(picks)} samples read by index offset match the stream byte for byte")

    tokenizer_dir = os.path.join(source, "tokenizer")
    if os.path.isdir(tokenizer_dir):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        docs = [json.loads(s["json"]) for s in streamed.values()]
        texts = tokenizer.apply_chat_template([d["messages"] for d in docs], tokenize=False)
        lengths = sorted(len(ids) for ids in tokenizer(texts)["input_ids"])
        pct = [lengths[int(q * (len(lengths) - 1))] for q in (0.5, 0.95)]
        print(
            f"[4] text tokens per sample: mean {sum(lengths) / len(lengths):.0f}, "
            f"p50 {pct[0]}, p95 {pct[1]}, max {lengths[-1]}"
        )
        rng.shuffle(lengths)
        batch = 8
        padded = sum(
            max(lengths[i : i + batch]) * len(lengths[i : i + batch])
            for i in range(0, len(lengths), batch)
        )
        print(
            f"    naive pad-to-longest batches of {batch} would be "
            f"{1 - sum(lengths) / padded:.0%} padding (text only; packing comes with the loader)"
        )
    print(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
