"""The ``wdsvlm`` command line's arguments: one parser, its subcommands and their options."""

from __future__ import annotations

import argparse

from ..version import __version__
from .values import byte_size, json_object, positive


def index_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--index-version",
        type=int,
        choices=(2, 3),
        default=3,
        help="3 (default): the shards in a binary table; 2: in index.json, for readers of a "
        "wdsvlm before version 3",
    )


def max_video_pixels(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-video-pixels",
        type=int,
        metavar="N",
        help="refuse a video of more frames x width x height (default 100000000000: an hour "
        "of 720p at 30 fps; a 30 s 4K clip at 60 fps is 1.5e10)",
    )


def common_options(parser: argparse.ArgumentParser) -> None:
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument("-v", "--verbose", action="store_true", help="log more, show tracebacks")
    loudness.add_argument(
        "-q", "--quiet", action="store_true", help="no progress bars, warnings only"
    )
    parser.add_argument(
        "--storage-options",
        type=json_object,
        default=None,
        metavar="JSON",
        help="fsspec options for bucket URLs, e.g. "
        '\'{"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}\'',
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wdsvlm",
        description="wdsvlm: image/prompt/response data as WebDataset shards, for VLM training.",
        epilog="Exit codes: 0 ok, 1 runtime error, 2 usage error.",
    )
    parser.add_argument("--version", action="version", version=f"wdsvlm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    write = commands.add_parser(
        "write",
        help="write conversations, documents or captions as WebDataset shards with an index",
        description="Write LLaVA-, Cauldron- or messages-style conversations, OBELICS or MMC4 "
        "documents, or LLaVA-Pretrain captions (JSON, JSONL or Parquet) and their images as "
        "WebDataset tar shards plus index.json, to a folder or a bucket URL.",
    )
    write.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="FILE",
        help="JSON/JSONL records, or Parquet as the Hugging Face Hub publishes it (images "
        "embedded); globs such as 'data/train-*.parquet' and fsspec URLs; repeat for several",
    )
    write.add_argument(
        "--image-root",
        metavar="DIR",
        help="where relative image paths start (default: the input file's folder)",
    )
    write.add_argument(
        "--output",
        required=True,
        metavar="DIR_OR_URL",
        help="dataset folder, or s3://, gs://, memory://, file:// URL",
    )
    write.add_argument(
        "--format",
        choices=("auto", "llava", "cauldron", "messages", "obelics", "mmc4", "llava-pretrain"),
        default="auto",
        help="records' layout: conversations (LLaVA 'conversations', Cauldron 'texts', or "
        "'messages' with roles), documents (OBELICS 'texts'/'images', MMC4 'text_list'/"
        "'image_info') or captions (llava-pretrain: LLaVA-Pretrain's JSON, named only); auto "
        "tells them apart by the first record's fields and says which",
    )
    write.add_argument(
        "--image-folder",
        metavar="DIR_OR_URL",
        help="documents and captions: a folder img2dataset wrote; images given as URLs are "
        "taken from it (an image it did not download is dropped and counted)",
    )
    write.add_argument(
        "--min-sim",
        type=float,
        default=0.24,
        metavar="X",
        help="mmc4: leave out an image whose matched_sim is under X (default 0.24, "
        "OpenFlamingo's; counted as below_min_sim)",
    )
    write.add_argument("--samples-per-shard", type=int, default=5000, metavar="N")
    write.add_argument(
        "--max-shard-bytes",
        type=byte_size,
        default="256MiB",
        metavar="B",
        help="close a shard before it grows past this (default 256MiB)",
    )
    write.add_argument("--prefix", default="data", help="shard names: PREFIX-000000.tar, ...")
    write.add_argument(
        "--prefixes",
        type=int,
        metavar="N",
        help="spread the shards over N prefix folders (1 to 4096; N=4: 0/, 4/, 8/, c/; shard n "
        "in folder n mod N) so that S3 serves N times the request rate of one prefix "
        "(about 5,500 GET/s each); default: every shard beside the index",
    )
    write.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="processes reading and writing (same output for any N)",
    )
    write.add_argument(
        "--skip-bad",
        action="store_true",
        help="skip bad records (counted, listed in skipped.jsonl) instead of stopping",
    )
    write.add_argument("--overwrite", action="store_true", help="replace a dataset at the output")
    max_video_pixels(write)
    index_version(write)
    write.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="local: processes on this machine; ray: Ray tasks (pip install 'wdsvlm[ray]'), "
        "the same output",
    )
    write.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="--engine ray: join this Ray cluster (e.g. auto, ray://head:10001) and use its "
        "CPUs; without it --workers N starts a local Ray of N CPUs",
    )
    common_options(write)

    verify = commands.add_parser(
        "verify", help="check every shard of a dataset against its index (size and sha256)"
    )
    verify.add_argument("source", metavar="SOURCE", help="dataset folder or URL")
    verify.add_argument(
        "--sample",
        type=int,
        metavar="N",
        help="check N shards drawn at random (and the root index whole) instead of every one",
    )
    common_options(verify)

    index = commands.add_parser(
        "index",
        help="index existing WebDataset tars where they are, without rewriting them",
        description="Read each tar once and write the index the Loader needs (each sample's "
        "byte range, image sizes from the image headers, characters per turn) beside the "
        "tars or into --output: per-shard sidecars, index-skipped.jsonl for bad samples, and "
        "index.json last. Layouts: wdsvlm (its own), captions (KEY.jpg + KEY.txt: user gets "
        "the image and a prompt, the caption is the answer), conversations (KEY.json with "
        "LLaVA 'conversations', Cauldron 'texts' or 'messages', beside the images), mint1t "
        "(MINT-1T's tars: KEY.json with parallel 'texts' and 'images', KEY.tiff with the "
        "images as frames; each sample a document). "
        "--upgrade turns a wdsvlm index of version 1 or 2 into version 3 instead (the shards "
        "in a binary table that the processes of a node map and share).",
    )
    index.add_argument(
        "source",
        metavar="SOURCE",
        help="folder or URL prefix of the tars (the folders under it too: shards written with "
        "--prefixes), or a brace pattern of tar URLs ('s3://b/ds/shard-{000000..000099}.tar')",
    )
    index.add_argument(
        "--format",
        choices=("auto", "wdsvlm", "captions", "conversations", "mint1t"),
        default="auto",
        help="the samples' layout; auto looks at the first samples and says what it found",
    )
    index.add_argument(
        "--kind",
        choices=("conversation", "caption"),
        help="captions: what each sample becomes: a conversation (default: the image and a "
        "prompt, the caption the answer) or a caption for pretraining (the image, then the "
        "caption; no prompt)",
    )
    index.add_argument(
        "--output",
        metavar="DIR_OR_URL",
        help="where the index goes when the tars' place is read-only (default: beside them)",
    )
    index.add_argument(
        "--prompts",
        metavar="FILE",
        help="captions: the user prompts, one per line (default: wdsvlm's five; docs/format.md)",
    )
    index.add_argument(
        "--prompt-seed", type=int, default=0, metavar="N", help="captions: seed of the pick"
    )
    index.add_argument("--workers", type=int, default=1, metavar="N", help="tars read at once")
    index.add_argument(
        "--skip-bad",
        action="store_true",
        help="index the good samples, count and list the bad in index-skipped.jsonl",
    )
    index.add_argument("--overwrite", action="store_true", help="replace an index at the output")
    max_video_pixels(index)
    index_version(index)
    index.add_argument(
        "--merge",
        nargs="+",
        metavar="PART",
        help="merge the indexes of these datasets (folders inside SOURCE, written apart, e.g. "
        "by several writers) into one index at SOURCE; their shards stay where they are",
    )
    index.add_argument(
        "--upgrade",
        action="store_true",
        help="turn a wdsvlm index of version 1 or 2 into version 3 (nothing else is read)",
    )
    common_options(index)

    inspect = commands.add_parser(
        "inspect",
        help="print a few samples and draw them on a contact sheet",
        description="Print samples as stored (key, images with sizes and tiles, videos with "
        "their frames and rate, each turn, token counts with --tokenizer or --processor; a "
        "document's or caption's texts with each image in its place, and with --max-length "
        "where the Loader cuts it into pieces) and write a contact sheet PNG: each sample's "
        "images and video frames beside its turns or text.",
    )
    inspect.add_argument(
        "source", metavar="SOURCE", help="dataset folder or URL, or a mixture file (.yaml, .json)"
    )
    inspect.add_argument("-n", type=positive, default=5, metavar="N", help="samples (default 5)")
    inspect.add_argument(
        "--key", action="append", default=[], metavar="K", help="this sample (repeat for more)"
    )
    inspect.add_argument("--out", metavar="PNG", help="write the contact sheet here")
    inspect.add_argument("--tokenizer", metavar="T", help="count tokens with this tokenizer")
    inspect.add_argument(
        "--processor",
        metavar="P",
        help="count tokens as this Hugging Face processor's family does (name or folder, or "
        "tiny:FAMILY), and show the frames it samples of each video",
    )
    inspect.add_argument(
        "--max-length",
        type=positive,
        metavar="L",
        help="with --tokenizer or --processor: show where a document or caption is cut into "
        "pieces of at most L tokens, as the Loader's max_length cuts it",
    )
    inspect.add_argument(
        "--max-tiles-per-pack",
        type=positive,
        metavar="N",
        help="with --tokenizer or --processor: the vision budget of a piece, as the Loader's "
        "max_tiles_per_pack (default: no limit)",
    )
    pipeline_options(inspect)
    common_options(inspect)

    stats = commands.add_parser(
        "stats",
        help="sizes in tokens and tiles, drops, and the padding that packing saves",
        description="Read the dataset (or its first --limit samples), tokenize it as the "
        "loader does and print samples, images, tiles, tokens per sample, drops at "
        "--max-length, and the padding of naive, fixed-length and packed batches; with --out, "
        "write histograms and the batch picture as PNGs.",
    )
    stats.add_argument(
        "source", metavar="SOURCE", help="dataset folder or URL, or a mixture file (.yaml, .json)"
    )
    stats.add_argument("--tokenizer", metavar="T", help="tokenizer name or folder (the tiling)")
    stats.add_argument(
        "--processor",
        metavar="P",
        help="tokenize as this Hugging Face processor's family does, videos included (name or "
        "folder, or tiny:FAMILY); instead of --tokenizer",
    )
    stats.add_argument("--max-length", type=positive, required=True, metavar="L")
    stats.add_argument(
        "--naive-batch-size",
        type=positive,
        metavar="B",
        help="samples per naive pad-to-longest batch, the comparison (default 8; not the "
        "Loader's batch_size, which counts packed rows)",
    )
    stats.add_argument(
        "--batch-size",
        dest="old_batch_size",
        type=positive,
        metavar="B",
        help="the old name of --naive-batch-size (deprecated: it logs a warning)",
    )
    stats.add_argument("--limit", type=positive, metavar="N", help="read only N samples")
    stats.add_argument(
        "--out", metavar="DIR", help="write tokens.png, tiles.png and batches.png here"
    )
    stats.add_argument(
        "--max-tiles-per-pack",
        type=positive,
        metavar="N",
        help="as the Loader's max_tiles_per_pack (default: no limit)",
    )
    stats.add_argument("--json", action="store_true", help="print the numbers as JSON")
    pipeline_options(stats)
    common_options(stats)

    bench = commands.add_parser(
        "bench",
        help="Loader throughput beside a naive webdataset pipeline, in one run",
        description="Time wdsvlm.Loader and a naive webdataset pipeline doing the same work "
        "(full decode, tokenize per sample, pad to the longest), one after the other, with "
        "the same DataLoader workers; print rates and their ratios, the share of the "
        "Loader's worker time each stage took and advice when its steps waited. With "
        "--processor, both feed that model family: the naive side calls the Hugging Face "
        "processor per sample and pads its output (float32 pixels), the Loader packs uint8 "
        "units that wdsvlm.model_inputs normalises (counted in its time).",
    )
    bench.add_argument("source", metavar="SOURCE", help="dataset folder or URL")
    bench.add_argument(
        "--tokenizer", metavar="T", help="tokenizer name or folder (the default tiling)"
    )
    bench.add_argument(
        "--processor",
        metavar="P",
        help="a model family's processor (name or folder for AutoProcessor), or tiny:FAMILY "
        "(qwen2_vl, qwen2_5_vl, qwen3_vl, smolvlm, idefics3, llava_onevision): the family's "
        "processor with its "
        "published image sizes over the tiny tokenizer of shards_example, offline; "
        "--tile-size, --max-image-side and --tokens-per-tile do not apply",
    )
    bench.add_argument("--max-length", type=positive, default=2048, metavar="L")
    bench.add_argument("--batch-size", type=positive, default=8, metavar="B")
    bench.add_argument(
        "--workers", type=int, default=2, metavar="N", help="DataLoader workers (default 2)"
    )
    bench.add_argument("--limit", type=positive, metavar="N", help="stop after N samples")
    bench.add_argument(
        "--batches-only",
        action="store_true",
        help="with --processor: time wdsvlm's batches without model_inputs (on a GPU the "
        "normalisation is the device's; here it would take the CPU from the workers)",
    )
    bench.add_argument(
        "--trace",
        metavar="FILE",
        help="write the Loader's first --trace-steps steps as a Chrome/Perfetto trace here: "
        "each worker's stages and the training process's waits (open it in ui.perfetto.dev "
        "or chrome://tracing, or draw it with wdsvlm trace)",
    )
    bench.add_argument(
        "--trace-steps",
        type=positive,
        default=200,
        metavar="N",
        help="steps the trace holds (default 200)",
    )
    bench.add_argument("--json", action="store_true", help="print the result as JSON")
    pipeline_options(bench)
    common_options(bench)
    return parser


def pipeline_options(parser: argparse.ArgumentParser) -> None:
    """How images become tiles and tokens, as the Loader's arguments of the same names."""
    parser.add_argument("--tile-size", type=positive, default=512, metavar="PX")
    parser.add_argument("--max-image-side", type=positive, default=1024, metavar="PX")
    parser.add_argument("--tokens-per-tile", type=positive, default=64, metavar="N")
