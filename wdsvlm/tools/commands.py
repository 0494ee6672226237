"""What each ``wdsvlm`` subcommand does with its parsed arguments (the library does the work;
these print its results)."""

from __future__ import annotations

import argparse
import json
import logging

log = logging.getLogger("wdsvlm.tools")


def image_config(args: argparse.Namespace):
    from ..families.tiling import ImageConfig

    return ImageConfig(args.tile_size, args.max_image_side)


def reading_options(args: argparse.Namespace) -> dict:
    """The arguments ``stats`` and ``bench`` read and tokenize the data with."""
    return {
        "image_config": image_config(args),
        "tokens_per_tile": args.tokens_per_tile,
        "storage_options": args.storage_options,
        "show_progress": not args.quiet,
    }


def write(args: argparse.Namespace) -> None:
    from ..write.writer import write_dataset

    summary = write_dataset(
        args.input,
        args.output,
        image_root=args.image_root,
        storage_options=args.storage_options,
        format=args.format,
        image_folder=args.image_folder,
        min_sim=args.min_sim,
        samples_per_shard=args.samples_per_shard,
        max_shard_bytes=args.max_shard_bytes,
        prefix=args.prefix,
        prefixes=args.prefixes,
        workers=args.workers,
        skip_bad=args.skip_bad,
        overwrite=args.overwrite,
        progress=not args.quiet,
        index_version=args.index_version,
        **({"max_video_pixels": args.max_video_pixels} if args.max_video_pixels else {}),
        engine=args.engine,
        ray_address=args.ray_address,
    )
    print(summary)


def verify(args: argparse.Namespace) -> None:
    from ..format.index import verify_dataset

    index = verify_dataset(args.source, args.storage_options, sample=args.sample)
    totals = index["totals"]
    which = (
        "every shard matches"
        if index["checked"] == totals["shards"]
        else f"{index['checked']} shards drawn at random match"
    )
    print(
        f"{args.source}: {which} the index "
        f"(shards={totals['shards']} samples={totals['samples']} bytes={totals['bytes']})"
    )


def index(args: argparse.Namespace) -> None:
    if args.merge:
        from ..format.merge import merge_indexes

        index = merge_indexes(
            args.source,
            args.merge,
            args.storage_options,
            index_version=args.index_version,
            overwrite=args.overwrite,
        )
        totals = index["totals"]
        print(
            f"{args.source}: {len(args.merge)} datasets merged into one index "
            f"(shards={totals['shards']} samples={totals['samples']} bytes={totals['bytes']})"
        )
        return
    if not args.upgrade:
        from ..write.tarindex import index_tars

        prompts = None
        if args.prompts:
            with open(args.prompts, encoding="utf-8") as f:
                prompts = [line.strip() for line in f if line.strip()]
        summary = index_tars(
            args.source,
            output=args.output,
            format=args.format,
            prompts=prompts,
            prompt_seed=args.prompt_seed,
            kind=args.kind or "",
            workers=args.workers,
            skip_bad=args.skip_bad,
            overwrite=args.overwrite,
            storage_options=args.storage_options,
            show_progress=not args.quiet,
            index_version=args.index_version,
            **({"max_video_pixels": args.max_video_pixels} if args.max_video_pixels else {}),
        )
        print(summary)
        return
    from ..format.builder import upgrade_dataset

    before, index = upgrade_dataset(args.source, args.storage_options)
    if before == index["version"]:
        print(f"{args.source}: the index is version {before} already; nothing to do")
    else:
        sidecars = f"{len(index['shards'])} sidecars and " if before == 1 else ""
        print(
            f"{args.source}: index version {before} -> {index['version']}: "
            f"{sidecars}the shard table written, index.json replaced"
        )


def inspect(args: argparse.Namespace) -> None:
    from .bench_processor import bench_processor
    from .samples import inspect_samples

    if args.tokenizer is not None and args.processor is not None:
        raise ValueError("give --tokenizer T or --processor P, not both")
    if args.tokenizer is None and args.processor is None:
        cut = [o for o, v in [("--max-length", args.max_length),
                              ("--max-tiles-per-pack", args.max_tiles_per_pack)] if v]  # fmt: skip
        if cut:  # pieces are counted in tokens: without a tokenizer there are none to show
            verb = "go" if len(cut) > 1 else "goes"
            raise ValueError(f"{' and '.join(cut)} {verb} with --tokenizer T or --processor P")
    views = inspect_samples(
        args.source,
        n=args.n,
        keys=args.key,
        tokenizer=args.tokenizer,
        image_config=image_config(args),
        tokens_per_tile=args.tokens_per_tile,
        storage_options=args.storage_options,
        processor=None if args.processor is None else bench_processor(args.processor),
        max_length=args.max_length,
        max_units=args.max_tiles_per_pack,
    )
    print("\n\n".join(view.describe() for view in views))
    if args.tokenizer is None and args.processor is None:
        print("(token counts: pass --tokenizer T or --processor P)")
    if args.out:
        from .pictures import contact_sheet

        width, height = contact_sheet(views, args.out)
        print(f"contact sheet of {len(views)} samples: {args.out} ({width}x{height})")


def naive_batch_size(args: argparse.Namespace) -> int:
    """``stats``'s samples per naive batch: ``--naive-batch-size``, or its old name
    ``--batch-size`` (with a warning: the Loader's ``batch_size`` counts packed rows), or 8."""
    new, old = args.naive_batch_size, args.old_batch_size
    if old is None:
        return 8 if new is None else new
    if new is not None and new != old:
        raise ValueError(f"--batch-size {old} and --naive-batch-size {new} disagree: give one")
    log.warning(
        "wdsvlm stats: --batch-size is deprecated, use --naive-batch-size (samples per naive "
        "batch; the Loader's batch_size counts packed rows)"
    )
    return old


def stats(args: argparse.Namespace) -> None:
    from .bench_processor import bench_processor
    from .dataset_stats import dataset_stats

    if (args.tokenizer is None) == (args.processor is None):
        raise ValueError("give --tokenizer T or --processor P (one of them)")
    naive = naive_batch_size(args)
    if args.out:
        from .pictures import pyplot

        pyplot()  # no matplotlib: say so before reading the whole dataset
    found = dataset_stats(
        args.source,
        args.tokenizer,
        processor=None if args.processor is None else bench_processor(args.processor),
        max_length=args.max_length,
        batch_size=naive,
        limit=args.limit,
        max_tiles_per_pack=args.max_tiles_per_pack,
        **reading_options(args),
    )
    paths = []
    if args.out:
        import os

        from .pictures import batch_picture, histograms

        os.makedirs(args.out, exist_ok=True)
        paths = histograms(found.tokens, found.tiles, args.max_length, args.out)
        paths.append(os.path.join(args.out, "batches.png"))
        batch_picture(found.picture, args.max_length, naive, paths[-1])
        if found.documents:
            from .pictures import document_histograms

            paths.append(document_histograms(found.documents, args.out))
    if args.json:
        print(json.dumps({**found.as_dict(), "pictures": paths}, indent=2))
        return
    print(f"{args.source} at max_length {args.max_length}:")
    print(found.table())
    if paths:
        print(f"pictures: {', '.join(paths)}")


def bench(args: argparse.Namespace) -> None:
    from .bench import bench_table, run_bench

    if args.workers < 0:
        raise ValueError(f"--workers must be 0 or more, not {args.workers}")
    if (args.tokenizer is None) == (args.processor is None):
        raise ValueError("give --tokenizer T or --processor P (one of them)")
    if args.batches_only and args.processor is None:
        raise ValueError("--batches-only goes with --processor")
    sizes = {
        "max_length": args.max_length,
        "batch_size": args.batch_size,
        "workers": args.workers,
        "limit": args.limit,
        "telemetry": telemetry(args),
    }
    if args.processor is not None:
        from .bench_processor import processor_bench_table, run_processor_bench

        result = run_processor_bench(
            args.source,
            args.processor,
            **sizes,
            storage_options=args.storage_options,
            show_progress=not args.quiet,
            model_inputs=not args.batches_only,
        )
        table = processor_bench_table
    else:
        result = run_bench(args.source, args.tokenizer, **sizes, **reading_options(args))
        table = bench_table
    if args.trace:
        result["telemetry"]["trace"] = args.trace
    print(json.dumps(result, indent=2) if args.json else table(result))
    if args.trace and not args.json:
        print(
            f"trace of the Loader's first {min(args.trace_steps, result['wdsvlm']['batches'])} "
            f"steps: {args.trace} (open it in "
            f"ui.perfetto.dev or chrome://tracing; a picture: wdsvlm trace {args.trace} --out "
            "trace.png)"
        )


def telemetry(args: argparse.Namespace):
    """``bench``'s Loader telemetry: the defaults, with the trace ``--trace`` asks for."""
    if not args.trace:
        return True
    from ..loader.telemetry import Telemetry

    return Telemetry(trace=args.trace, trace_steps=args.trace_steps)


def trace(args: argparse.Namespace) -> None:
    from .trace_picture import trace_picture

    if args.skip < 0:
        raise ValueError(f"--skip must be 0 or more, not {args.skip}")
    drawn = trace_picture(args.file, args.out, args.steps, args.skip)
    print(f"{args.out}: {drawn['lanes']} lanes, {drawn['spans']} spans over {drawn['ms']:.0f} ms")
    for lane, stages in drawn["ms_per_lane"].items():
        total = sum(stages.values()) or 1.0
        shares = sorted(stages.items(), key=lambda kv: -kv[1])
        shown = [f"{name} {ms / total:.0%}" for name, ms in shares if ms / total >= 0.005]
        print(f"  {lane}: " + ", ".join(shown))
