"""``wdsvlm plan-cloud``: the arguments of the cloud planner (``cloud_plan.py``) and its
report, as text or JSON."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from typing import Any

from ..pipeline.order import SPAN_BYTES, SPAN_SAMPLES
from ..storage.fs import ReadPolicy
from ..storage.node import LOCAL_BYTES
from .arguments import byte_size, common_options, positive
from .cloud_dataset import SIDECAR_BYTES_PER_SAMPLE, SIDECAR_HEADERS, described, from_index
from .cloud_plan import (
    EGRESS_PRICES,
    PREFIX_LIMIT,
    S3_GET_PRICE,
    DatasetShape,
    JobShape,
    Prices,
    plan_cloud,
)


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add ``plan-cloud`` to the ``wdsvlm`` command's sub-parsers."""
    plan = commands.add_parser(
        "plan-cloud",
        help="requests, bytes, cost and per-prefix load a training job asks of a store",
        description="From a dataset's index (SOURCE) or a description of one (--samples, "
        "--bytes, --shards; with SOURCE too: its sample and sidecar sizes scaled to them) and "
        "a job's shape, print the GET requests and bytes of a pass and a second, in all and "
        "per prefix, the cost of a pass at the given prices, the bytes a node reads before "
        "its first batch, and whether the store's per-prefix limit holds, with the "
        "--prefixes or span_bytes that would make it hold.",
    )
    plan.add_argument("source", nargs="?", metavar="SOURCE", help="dataset folder or URL")
    plan.add_argument("--samples", type=positive, metavar="N", help="samples of the dataset")
    plan.add_argument("--bytes", type=byte_size, metavar="SIZE", help="its bytes (100TB)")
    plan.add_argument("--shards", type=positive, metavar="N", help="its shards")
    plan.add_argument(
        "--prefixes",
        type=positive,
        metavar="N",
        help="spread the shards evenly over N prefixes (as `wdsvlm write --prefixes N`; "
        "default: the index's folders, 1 for a description)",
    )
    plan.add_argument("--nodes", type=positive, default=1, metavar="N")
    plan.add_argument("--gpus-per-node", type=positive, default=8, metavar="N")
    plan.add_argument(
        "--workers", type=int, default=8, metavar="N", help="DataLoader workers per GPU"
    )
    plan.add_argument(
        "--samples-per-second",
        type=float,
        default=100.0,
        metavar="R",
        help="samples a second each GPU trains on (default 100)",
    )
    plan.add_argument("--span-bytes", type=byte_size, default=SPAN_BYTES, metavar="SIZE")
    plan.add_argument("--span-samples", type=positive, default=SPAN_SAMPLES, metavar="N")
    plan.add_argument(
        "--block-bytes", type=byte_size, default=ReadPolicy.block_bytes, metavar="SIZE"
    )
    plan.add_argument(
        "--no-sizing",
        action="store_true",
        help="the Loader is given batches_per_epoch: no sizing reads at start-up",
    )
    plan.add_argument(
        "--local-bytes",
        type=byte_size,
        default=LOCAL_BYTES,
        metavar="SIZE",
        help="bytes the node's copies of sidecars may take, the Loader's local_bytes "
        "(default 4GiB; 0: none, each process reads them from the store)",
    )
    plan.add_argument(
        "--sidecar-bytes-per-sample",
        type=float,
        default=SIDECAR_BYTES_PER_SAMPLE,
        metavar="B",
        help=f"for a description (default {SIDECAR_BYTES_PER_SAMPLE})",
    )
    plan.add_argument(
        "--get-price",
        type=float,
        default=S3_GET_PRICE,
        metavar="USD",
        help=f"$ per 1,000 GETs (default {S3_GET_PRICE}: S3 Standard)",
    )
    plan.add_argument(
        "--egress-price",
        type=float,
        nargs="+",
        default=list(EGRESS_PRICES),
        metavar="USD",
        help="$ per GB sent out, one or more (default 0 0.02 0.09: same region, another "
        "region, the internet)",
    )
    plan.add_argument(
        "--prefix-limit",
        type=float,
        default=PREFIX_LIMIT,
        metavar="R",
        help=f"GET/s a prefix takes (default {PREFIX_LIMIT}: S3's figure)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    common_options(plan)
    return plan


def shape_of(args: argparse.Namespace) -> DatasetShape:
    """The dataset the arguments name: an index, a description, or an index scaled."""
    described_by = (args.samples, args.bytes, args.shards)
    if args.source is None:
        if None in (args.samples, args.bytes, args.shards):
            raise ValueError("give a dataset's SOURCE, or --samples, --bytes and --shards")
        return described(*described_by, args.prefixes or 1, args.sidecar_bytes_per_sample)
    shape = from_index(args.source, args.storage_options)
    if described_by == (None, None, None):
        return shape
    samples = args.samples or shape.size
    shards = args.shards or max(1, round(samples / (shape.size / shape.shards)))
    headers = SIDECAR_HEADERS * int(shape.sidecar_bytes.astype(bool).sum())
    sidecar = max(0.0, float(shape.sidecar_bytes.sum()) - headers) / shape.size
    scaled = described(
        samples,
        args.bytes or int(shape.mean_sample * samples + shape.trailer * shards),
        shards,
        args.prefixes or 1,
        sidecar,
        name=f"{args.source}, scaled",
        sample_cv=shape.sample_cv,
    )
    return replace(scaled, trailer=shape.trailer)


def run(args: argparse.Namespace) -> None:
    job = JobShape(
        args.nodes,
        args.gpus_per_node,
        args.workers,
        args.samples_per_second,
        args.span_bytes,
        args.span_samples,
        args.block_bytes,
        sizing=not args.no_sizing,
        local_bytes=args.local_bytes,
    )
    prices = Prices(args.get_price, tuple(args.egress_price))
    plan = plan_cloud(shape_of(args), job, prices, args.prefix_limit, args.prefixes)
    print(json.dumps(plan, indent=2) if args.json else render(plan))


def size(n: float) -> str:
    """Bytes in binary units: ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} PiB"


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:,.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds / 3600:,.1f} h"


def render(plan: dict[str, Any]) -> str:
    """The plan as a few lines of text."""
    d, j, p, r = plan["dataset"], plan["job"], plan["pass"], plan["rates"]
    c, s, lim = plan["cost_per_pass"], plan["startup_per_node"], plan["prefix_limit"]
    sample = d["bytes"] / d["samples"]
    egress = ", ".join(
        f"${cost:,.0f} at ${price}/GB"
        for cost, price in zip(c["egress"], c["prices"]["egress_per_gb"], strict=True)
    )
    lines = [
        f"dataset    {d['name']}: {d['samples']:,} samples in {d['shards']:,} shards, "
        f"{size(d['bytes'])} ({size(sample)} a sample), {d['prefixes']:,} prefix(es)",
        f"job        {j['nodes']:,} nodes x {j['gpus_per_node']} GPUs x {j['workers']} workers "
        f"= {j['readers']:,} readers; {j['samples_per_second']:g} samples/s a GPU: a pass "
        f"takes {duration(p['seconds'])}",
        f"reads      chunks of {p['chunk_samples']} samples ({size(p['chunk_bytes'])}), "
        f"span_bytes {size(j['span_bytes'])}, block_bytes {size(j['block_bytes'])}",
        f"a pass     {p['requests']:,} GETs ({p['span_requests']:,} for {p['spans']:,} spans, "
        f"{p['sidecar_requests']:,} for sidecars), {size(p['bytes'])} "
        f"({size(p['sidecar_bytes'])} of sidecars)",
        f"rates      {r['requests_per_second']:,.0f} GET/s, "
        f"{size(r['bytes_per_second'])}/s; the busiest prefix "
        f"{r['busiest_prefix_requests_per_second']:,.0f} GET/s",
        f"cost       ${c['gets']:,.2f} of GETs a pass (${c['prices']['get_per_1000']} per "
        f"1,000); egress {egress} (prices are inputs: --get-price, --egress-price)",
        f"start-up   {size(s['bytes'])} in {s['requests']:,} GETs a node: index.json "
        f"{size(s['index_bytes'])}, shard table {size(s['table_bytes'])} and sizing's "
        f"sidecars {size(s['sidecar_bytes'])} (one copy a node), sizing "
        f"{size(s['sizing_bytes_per_rank'])} in {s['sizing_requests_per_rank']} GETs a rank",
    ]
    verdict = "EXCEEDED" if lim["exceeded"] else "holds"
    line = f"limit      {lim['limit']:,.0f} GET/s a prefix: {verdict}"
    if lim["exceeded"]:
        line += f"; fits with --prefixes {lim['prefixes_needed']}"
        fit = lim.get("span_fit")
        if fit:
            line += (
                f", or span_bytes {size(fit['span_bytes'])} (span_samples "
                f"{fit['span_samples']}, block_bytes {size(fit['block_bytes'])}): "
                f"{fit['busiest_prefix_requests_per_second']:,.0f} GET/s"
            )
    return "\n".join([*lines, line])
