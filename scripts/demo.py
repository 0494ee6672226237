"""The demo job (`make demo`): check a dataset, read it back two ways, and size its samples.

    python scripts/demo.py [SOURCE]     (default: shards_example)

1. Every shard's size and sha256 against index.json.
2. Every sample streamed with plain `webdataset`, as any WebDataset reader would.
3. A few samples read straight from their byte offsets in the index (what the loader's range
   reads and exact resume rely on), compared with the streamed ones.
4. The main job: one epoch of wdsvlm.Loader, packed [4, 2048] batches,
   with the padding against naive pad-to-longest batching and the throughput.
"""

from __future__ import annotations

import io
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


def stream_with_loader(source: str, tokenizer: str, max_length: int, batch_size: int) -> None:
    """Step 4: the Loader's packed batches against naive pad-to-longest batches of the same
    tokenized samples (token counts include image tokens)."""
    import webdataset as wds

    from wdsvlm import Loader, Plan, ReadSamples, Tokenize, WorkerConfig

    tokenize = Tokenize(tokenizer)
    plan = Plan(source, worker_config=WorkerConfig(), seed=0)
    lengths = [s["num_tokens"] for s in wds.DataPipeline(plan, ReadSamples(), tokenize)]
    lengths = [n for n in lengths if n <= max_length]
    random.Random(0).shuffle(lengths)
    naive_rows = [lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size)]
    naive = 1 - sum(lengths) / sum(max(r) * len(r) for r in naive_rows)

    loader = Loader(source, tokenizer, max_length=max_length, batch_size=batch_size)
    started = time.perf_counter()
    batches = real = 0
    passes: dict[int, set] = {}
    for batch in loader:
        batches += 1
        real += int(batch["attention_mask"].sum())
        for keys, of_pass in zip(batch["sample_keys"], batch["sample_passes"], strict=True):
            for key, p in zip(keys, of_pass, strict=True):
                passes.setdefault(p, set()).add(key)
    seconds = time.perf_counter() - started
    stats = loader.stats()
    samples = sum(len(keys) for keys in passes.values())
    carried = samples - len(passes[0])
    padding = 1 - real / (batches * batch_size * max_length)
    print(
        f"[4] wdsvlm.Loader: one epoch is {batches} batches of [{batch_size}, {max_length}] "
        f"(len(loader), the same on every rank): {len(passes[0])} of the {len(lengths)} "
        f"samples of pass 0 and {carried} of pass 1, {stats['samples_per_pack']:.1f} samples "
        "per row"
    )
    print(
        f"    padding: {padding:.1%} vs {naive:.1%} naive pad-to-longest (batches of {batch_size})"
    )
    print(
        f"    {samples / seconds:.0f} samples/s, {real / seconds:.0f} tokens/s in one process "
        f"(decode, tokenize, pack, collate); skipped {stats['skipped'] or 'none'}, "
        f"dropped {stats['dropped'] or 'none'}"
    )


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
        stream_with_loader(source, tokenizer_dir, max_length=2048, batch_size=4)
    print(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
