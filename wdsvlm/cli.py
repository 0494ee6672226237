"""The ``wdsvlm`` command line. Exit codes: 0 ok, 1 runtime error, 2 usage error."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys

from .errors import WdsvlmError

_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def byte_size(text: str) -> int:
    """``"256MB"``, ``"1GiB"``, ``"500k"`` or a plain number of bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(
            f"not a byte size: {text!r} (examples: 500000, 64MB, 1GiB)"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2)])


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, like '{\"anon\": true}'")
    return value


def _common(parser: argparse.ArgumentParser) -> None:
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
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    write = commands.add_parser(
        "write",
        help="write LLaVA/Cauldron records as WebDataset shards with an index",
        description="Write LLaVA- or Cauldron-style JSON/JSONL records and their images as "
        "WebDataset tar shards plus index.json, to a folder or a bucket URL.",
    )
    write.add_argument(
        "--input",
        action="append",
        required=True,
        metavar="FILE",
        help="LLaVA JSON/JSONL or Cauldron JSONL file (repeat for several)",
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
    write.add_argument("--format", choices=("auto", "llava", "cauldron"), default="auto")
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
    _common(write)

    verify = commands.add_parser(
        "verify", help="check every shard of a dataset against its index (size and sha256)"
    )
    verify.add_argument("source", metavar="SOURCE", help="dataset folder or URL")
    _common(verify)
    return parser


def _write(args: argparse.Namespace) -> None:
    from .write import write_dataset

    summary = write_dataset(
        args.input,
        args.output,
        image_root=args.image_root,
        storage_options=args.storage_options,
        format=args.format,
        samples_per_shard=args.samples_per_shard,
        max_shard_bytes=args.max_shard_bytes,
        prefix=args.prefix,
        workers=args.workers,
        skip_bad=args.skip_bad,
        overwrite=args.overwrite,
        progress=not args.quiet,
    )
    print(summary)


def _verify(args: argparse.Namespace) -> None:
    from .index import verify_dataset

    index = verify_dataset(args.source, args.storage_options)
    totals = index["totals"]
    print(
        f"{args.source}: every shard matches the index "
        f"(shards={totals['shards']} samples={totals['samples']} bytes={totals['bytes']})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    run = {"write": _write, "verify": _verify}[args.command]
    try:
        run(args)
    except (ValueError, FileNotFoundError) as e:
        if args.verbose:
            raise
        print(f"wdsvlm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (WdsvlmError, OSError) as e:
        if args.verbose:
            raise
        print(f"wdsvlm {args.command}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
