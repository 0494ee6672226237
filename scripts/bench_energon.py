"""Benchmark: wdsvlm.Loader against Megatron-Energon at equal work, side by side in one run.

    pip install 'wdsvlm[bench]'          # Megatron-Energon, psutil
    python scripts/bench_energon.py [--mix coco] [--samples 2000] [--max-length 2048]
        [--batch-size 2] [--workers 0 2] [--rounds 1] [--fork] [--no-check] [--json]
    python scripts/bench_energon.py --profile      # where the time goes, 0 workers, both sides

Both loaders read the same WebDataset shards (wdsvlm's writer makes them under --workdir, as
scripts/bench_pipeline.py does) and yield the same batches: ``[batch_size, max_length]`` rows
of packed samples (``input_ids``, ``labels``, ``attention_mask``, ``position_ids``,
``cu_seqlens``, ``sample_keys``) and one uint8 tensor of all the batch's tiles.

  wdsvlm:  ``wdsvlm.Loader`` with its defaults (shuffle buffer 1000, packing window 500),
           iterated until every sample of the first pass has come (an epoch of the Loader is
           ``len(loader)`` batches, an estimate; what it delivers beyond the pass counts too).
  Energon: ``get_train_dataset(..., repeat=False)`` (one pass) and ``get_savable_loader``
           (the resumable loader, as wdsvlm's is), over a view of the shards (symbolic links
           and the ``.nv-meta`` index that ``energon prepare`` writes, made in a temporary
           folder: nothing is written beside the shards) as a ``CrudeWebdataset``, with a
           task encoder doing the Loader's work with wdsvlm's own functions:
           ``preencode_sample`` renders the chat template and tokenizes with the label mask
           (``wdsvlm.pipeline.Tokenize``, one sample at a time, as the hook gets them; image
           sizes from the JPEG headers, nothing decoded); ``select_samples_to_pack`` packs
           each buffer (``--pack-buffer``, default 500 like the Loader's window) by
           best-fit-decreasing (``wdsvlm.pipeline.packer.best_fit_decreasing``);
           ``postencode_sample`` decodes the images of the chosen samples only into tiles
           (``wdsvlm.families.tiling``: the same draft-mode decode and OpenCV resize, so the
           pixels are equal); ``pack_selected_samples`` concatenates a pack's tokens into one
           row; ``batch`` pads the rows to ``[batch_size, max_length]`` and concatenates the
           tiles. Shuffle buffer as the Loader's (``--shuffle-buffer``).

First (unless --no-check) each side runs once with 0 workers and the script checks that both
gave the same samples: the same set of keys, every one of the dataset's, and per key the same
token ids, labels (the supervised tokens) and tiles (pixels bit for bit). Then each side runs
in a fresh process per measurement (a training job starts its loader in a fresh process),
for each worker count, wdsvlm and Energon alternating (and with --fork, the Loader with its
workers forked from this process, as Energon's are, in place of its fork server): samples/s,
also after the first batch, and the time to the first batch, both from before the loader is
made (its set-up counts); samples per CPU-second, the
CPU time of the process and every process it started, DataLoader workers and a fork server's
workers included (``getrusage(RUSAGE_CHILDREN)`` once every one has ended and been waited
for: a fork server waits for its workers, and the fork server is stopped and waited for
before the count; a snapshot of all live descendants by psutil at the last batch is the
cross-check); and padding (the share of the ``[B, L]`` cells that are not real tokens).
Torch runs one thread per process (as in DataLoader workers), so 0 workers means one core.

``--profile`` runs each side with 0 workers in a fresh process under a sampling profiler (the
main thread's stack every 5 ms, each sample put under the innermost frame that names a part of
the work) and prints the shares side by side, and each side's busiest functions.
"""

from __future__ import annotations

import argparse
import collections
import gc
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "shards_example", "tokenizer")
MISSING = "scripts/bench_energon.py needs {} (the bench extra): pip install 'wdsvlm[bench]'"


def require_bench_extra() -> None:
    """Exit with one line naming the install when the bench extra is not there."""
    import importlib.util

    missing = [m for m in ("megatron.energon", "psutil") if not _findable(importlib.util, m)]
    if missing:
        sys.exit(MISSING.format(" and ".join(missing)))


def _findable(util, name: str) -> bool:
    try:
        return util.find_spec(name) is not None
    except ModuleNotFoundError:  # megatron itself is missing
        return False


# --- the work both sides do, from wdsvlm's own functions --------------------------------------


def make_tokenize(args):
    from wdsvlm.families.tiling import ImageConfig
    from wdsvlm.pipeline.tokenize import Tokenize

    config = ImageConfig(args.tile_size, args.max_image_side)
    return Tokenize(args.tokenizer, tokens_per_tile=args.tokens_per_tile, image_config=config)


def energon_encoder(args):
    """The task encoder (a class made here: Energon is imported only when it runs)."""
    import torch
    from megatron.energon import Cooker, DefaultTaskEncoder, SkipSample, stateless

    from wdsvlm.format.images import image_members
    from wdsvlm.loader.build import pad_of  # the Loader's padding token
    from wdsvlm.pipeline.collate import collate_rows
    from wdsvlm.pipeline.packer import best_fit_decreasing

    @stateless
    def raw(sample: dict) -> dict:
        return sample  # a crude sample: the tar members' bytes, as the Loader reads them

    class SameWork(DefaultTaskEncoder):
        decoder = None  # no Energon decode: the images are decoded by wdsvlm's tiling
        cookers = [Cooker(raw)]

        def __init__(self):
            super().__init__()
            self.tokenize = make_tokenize(args)
            self.family = self.tokenize.family
            self.pad = pad_of(self.tokenize.tokenizer)
            self.max_length, self.batch_size = args.max_length, args.batch_size

        @stateless
        def preencode_sample(self, sample: dict) -> dict:
            encoded = self.tokenize.encode([sample])  # one sample: the hook gets one
            if not encoded:
                raise SkipSample()
            return encoded[0]

        def select_samples_to_pack(self, samples: list[dict]) -> list[list[dict]]:
            fits = [s for s in samples if s["num_tokens"] <= self.max_length]
            packs = best_fit_decreasing(
                [s["num_tokens"] for s in fits],
                [sum(s["image_tiles"]) for s in fits],
                self.max_length,
                1 << 62,
            )
            return [[fits[i] for i in pack] for pack in packs]

        @stateless
        def postencode_sample(self, sample: dict) -> dict:
            pixels = torch.empty(
                (sum(sample["image_tiles"]), 3, self.family.unit_size, self.family.unit_size),
                dtype=torch.uint8,
            )
            self.family.decode(sample, pixels)
            for name in image_members(sample):
                del sample[name]
            sample["pixel_values"] = pixels
            return sample

        @stateless
        def pack_selected_samples(self, samples: list[dict]) -> dict:
            return {"__restore_key__": (), "samples": samples}

        @stateless
        def batch(self, packs: list[dict]) -> dict:
            """The rows padded to ``[batch_size, max_length]`` by the Loader's own
            ``collate_rows``, the tiles concatenated in row order."""
            rows = [pack["samples"] for pack in packs]
            rows += [[] for _ in range(self.batch_size - len(rows))]
            pixels = [s["pixel_values"] for row in rows for s in row]
            side = self.family.unit_size
            empty = torch.empty((0, 3, side, side), dtype=torch.uint8)
            return collate_rows(rows, self.max_length, self.pad, torch.cat([empty, *pixels]))

    return SameWork()


# --- the two loaders ------------------------------------------------------------------------


def wdsvlm_loader(folder: str, args, workers: int, context: str | None = None):
    from wdsvlm import Loader

    return Loader(
        folder,
        args.tokenizer,
        max_length=args.max_length,
        batch_size=args.batch_size,
        num_workers=workers,
        multiprocessing_context=context,
        shuffle_buffer=args.shuffle_buffer,
        pack_window=args.pack_buffer,
        tile_size=args.tile_size,
        max_image_side=args.max_image_side,
        tokens_per_tile=args.tokens_per_tile,
    )


def energon_loader(view: str, args, workers: int):
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    config = WorkerConfig(rank=0, world_size=1, num_workers=workers)
    dataset = get_train_dataset(
        view,
        worker_config=config,
        batch_size=args.batch_size,
        packing_buffer_size=args.pack_buffer,
        shuffle_buffer_size=args.shuffle_buffer,
        max_samples_per_sequence=None,
        task_encoder=energon_encoder(args),
        repeat=False,
    )
    return get_savable_loader(dataset)


def energon_view(folder: str) -> str:
    """A temporary folder that Energon reads as the dataset: a symbolic link to each shard
    and the index ``energon prepare`` writes (``.nv-meta``, ``*.tar.idx``), so nothing is
    written beside the shards. The caller removes it."""
    import contextlib
    import io

    import yaml
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    view = tempfile.mkdtemp(prefix="wdsvlm-energon-")
    tars = sorted(name for name in os.listdir(folder) if name.endswith(".tar"))
    for name in tars:
        os.symlink(os.path.join(os.path.abspath(folder), name), os.path.join(view, name))
    with contextlib.redirect_stdout(io.StringIO()):  # its progress lines
        WebdatasetPreparator.prepare_dataset(
            EPath(view), tars, split_parts_ratio=[("train", 1.0)], shuffle_seed=None, workers=1
        )
    with open(os.path.join(view, ".nv-meta", "dataset.yaml"), "w") as f:
        yaml.dump({"__module__": "megatron.energon", "__class__": "CrudeWebdataset"}, f)
    return view


class Run:
    """One side's batches, from before its loader is made, and how to end its processes."""

    def __init__(self, side: str, source: str, args, workers: int):
        self.side = side
        if side == "energon":
            self.loader = energon_loader(source, args, workers)
        else:  # wdsvlm, or wdsvlm-fork: its workers forked from this process
            context = "fork" if side == "wdsvlm-fork" else None
            self.loader = wdsvlm_loader(source, args, workers, context)
        self.batches = iter(self.loader)

    def close(self) -> None:
        """Stop every process the loader started and wait for them, so that their CPU time
        is in this process's RUSAGE_CHILDREN (a fork server's workers through the server)."""
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()
        if self.side != "energon":
            self.loader.close()
        self.batches = self.loader = None
        gc.collect()
        from multiprocessing import forkserver, resource_tracker

        # private, both: stop the fork server and the resource tracker, and wait for them
        if forkserver._forkserver._forkserver_pid is not None:
            forkserver._forkserver._stop()
        if resource_tracker._resource_tracker._pid is not None:
            resource_tracker._resource_tracker._stop()


def samples_of(batch: dict, image_token_id: int, tokens_per_tile: int):
    """``(key, pass, ids, labels, tiles)`` of every sample of a batch, in order."""
    ids = batch["input_ids"].numpy()
    labels = batch["labels"].numpy()
    length = ids.shape[1]
    segments = iter(np.diff(batch["cu_seqlens"].numpy()).tolist())
    passes = batch.get("sample_passes")
    tile_at = 0
    for r, keys in enumerate(batch["sample_keys"]):
        at = 0
        for k, key in enumerate(keys):
            n = next(segments)
            x, y = ids[r, at : at + n], labels[r, at : at + n]
            tiles = int((x == image_token_id).sum()) // tokens_per_tile
            yield (
                key,
                passes[r][k] if passes is not None else 0,
                x,
                y,
                batch["pixel_values"][tile_at : tile_at + tiles],
            )
            tile_at += tiles
            at += n
        if at < length:
            next(segments)  # the row's padding
    if tile_at != len(batch["pixel_values"]):
        raise AssertionError(f"{len(batch['pixel_values'])} tiles, the samples hold {tile_at}")


# --- one measurement, in a fresh process ------------------------------------------------------


def descendants_cpu() -> tuple[float, float]:
    """CPU seconds of every live descendant of this process (psutil), and of the fork
    server's own (not its children's), if one runs."""
    from multiprocessing import forkserver

    import psutil

    server = getattr(forkserver._forkserver, "_forkserver_pid", None)
    total = own = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
        own += t.user + t.system if p.pid == server else 0.0
    return total, own


def cpu(usage) -> float:
    return usage.ru_utime + usage.ru_stime


def measure(side: str, source: str, workers: int, args, expected: int, what: str) -> dict:
    """Run one loader over one pass; the figures, and per-key digests (``what="check"``) or
    the sampling profile of this process (``what="profile"``)."""
    import contextlib

    import psutil

    check = what == "check"
    image_token_id = make_tokenize(args).image_token_id  # for the check: outside the timing
    usage0 = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    sampler = Sampler() if what == "profile" else contextlib.nullcontext()
    sampler.__enter__()
    start = time.perf_counter()
    run = Run(side, source, args, workers)
    first = None
    samples = batches = tokens = cells = supervised = in_first = 0
    first_pass: set[str] = set()
    digests: dict[str, list] = {}
    for batch in run.batches:
        if first is None:
            first = time.perf_counter() - start
        batches += 1
        tokens += int(batch["attention_mask"].sum())
        cells += batch["input_ids"].numel()
        supervised += int(batch["num_loss_tokens"])
        passes = batch.get("sample_passes") or [[0] * len(k) for k in batch["sample_keys"]]
        for keys, ps in zip(batch["sample_keys"], passes, strict=True):
            samples += len(keys)
            first_pass.update(k for k, p in zip(keys, ps, strict=True) if p == 0)
        if batches == 1:
            in_first = samples
        if check:
            for key, p, ids, labels, tiles in samples_of(
                batch, image_token_id, args.tokens_per_tile
            ):
                digest = [
                    hashlib.sha1(ids.tobytes()).hexdigest(),
                    hashlib.sha1(labels.tobytes()).hexdigest(),
                    len(tiles),
                    hashlib.sha1(tiles.numpy().tobytes()).hexdigest(),
                ]
                if key in digests and digests[key] != digest:
                    raise AssertionError(f"{side}: {key} came twice, different (pass {p})")
                digests[key] = digest
        if side != "energon" and len(first_pass) == expected:
            break  # every sample of the pass has come
    seconds = time.perf_counter() - start
    sampler.__exit__(None, None, None)
    # every process still running, the fork server's workers included
    live, fork_server = descendants_cpu()
    run.close()
    left = psutil.Process().children(recursive=True)
    _, alive = psutil.wait_procs(left, timeout=30)
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    own, kids = (cpu(after) - cpu(before) for after, before in zip(usage, usage0, strict=True))
    faults = sum(a.ru_minflt - b.ru_minflt for a, b in zip(usage, usage0, strict=True))
    return {
        "side": side,
        "workers": workers,
        "samples": samples,
        "first_pass_samples": len(first_pass),
        "first_pass_sha1": hashlib.sha1("\n".join(sorted(first_pass)).encode()).hexdigest(),
        "batches": batches,
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "first_batch_s": first,
        # the steady rate, which the set-up and the first batch (workers, buffers) do not weigh on
        "samples_per_s_after_first": (samples - in_first) / (seconds - first),
        "cpu_main_s": own,
        "cpu_children_s": kids,
        "cpu_children_live_at_end_s": live,
        "cpu_fork_server_s": fork_server,
        "processes_not_waited_for": len(alive),
        "cpu_s": own + kids,
        "samples_per_cpu_s": samples / (own + kids),
        "padding": 1 - tokens / cells,
        "page_faults_per_sample": faults / samples,
        "supervised_tokens": supervised,
        "digests": digests if check else None,
        "profile": sampler.counts() if what == "profile" else None,
    }


def measure_apart(side: str, source: str, workers: int, args, expected: int, what="time"):
    """``measure`` in a fresh interpreter; its result."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
        command += ["--measure", what, side, source, str(workers), str(expected), out.name]
        run = subprocess.run(command, capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"{side} with {workers} workers failed:\n{run.stderr[-4000:]}")
        with open(out.name) as f:
            return json.load(f)


# --- checking -------------------------------------------------------------------------------


def compare(ours: dict, theirs: dict, keys: list[str]) -> str:
    """Both sides gave every sample of the dataset, each the same: a line saying so."""
    a, b = ours["digests"], theirs["digests"]
    expected = set(keys)
    for name, got in (("wdsvlm", set(a)), ("Energon", set(b))):
        if got != expected:
            missing, extra = sorted(expected - got), sorted(got - expected)
            raise AssertionError(
                f"{name} gave other samples: missing {missing[:5]}, extra {extra[:5]}"
            )
    what = ("token ids", "labels", "tile count", "pixels")
    for key in keys:
        for i, name in enumerate(what):
            if a[key][i] != b[key][i]:
                raise AssertionError(f"{key}: the {name} differ between wdsvlm and Energon")
    return (
        f"checked: both gave the same {len(keys)} samples (every key of the dataset), "
        "each with the same token ids, labels and tiles (pixels equal bit for bit)"
    )


def dataset_keys(folder: str) -> list[str]:
    """``SHARD/KEY`` of every sample in the folder's tars, read off the tars themselves."""
    import tarfile

    keys = []
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".tar")):
        with tarfile.open(os.path.join(folder, name)) as tar:
            found = dict.fromkeys(m.name.split(".", 1)[0] for m in tar.getmembers())
        keys += [f"{name}/{key}" for key in found]
    return keys


# --- profile --------------------------------------------------------------------------------

# (what, test on a frame's file and function): the innermost frame that passes a test names
# where a sample of the main thread's time goes.
PARTS = [
    ("JPEG decode (PIL, draft)", lambda f, n: "/PIL/" in f or f.endswith("format/images.py")),
    ("resize (OpenCV)", lambda f, n: f.endswith("tiling.py") and n == "resize"),
    ("tiles: copy into the tensor", lambda f, n: f.endswith("tiling.py")),
    ("chat template (jinja2)", lambda f, n: "/jinja2/" in f or "chat_template" in f),
    ("tokenizer call", lambda f, n: "tokenization_utils" in f or "/tokenizers/" in f),
    ("labels (answer ranges)", lambda f, n: f.endswith("pipeline/labels.py")),
    ("json", lambda f, n: "/json/" in f),
    ("tokenize: the rest", lambda f, n: f.endswith("pipeline/tokenize.py")),
    ("packing", lambda f, n: f.endswith(("pipeline/packer.py", "pipeline/pack.py"))),
    ("collate", lambda f, n: f.endswith("pipeline/collate.py")),
    ("task encoder: pack, batch", lambda f, n: n in ("pack_selected_samples", "batch")),
    (
        "read (tar, index)",
        lambda f, n: "/tarfile" in f or "wdsvlm/storage/" in f or "/fsspec/" in f,
    ),
    ("read (tar, index)", lambda f, n: f.endswith(("pipeline/read.py", "format/sidecar.py"))),
    ("shuffle", lambda f, n: f.endswith("pipeline/shuffle.py")),
    ("plan", lambda f, n: f.endswith(("pipeline/plan.py", "pipeline/order.py"))),
    ("Loader: stream, state", lambda f, n: "wdsvlm/loader/" in f or "pipeline/places" in f),
    ("Energon: itar, sqlite", lambda f, n: "energon/flavors/webdataset" in f),
    ("Energon: wrappers, state", lambda f, n: "megatron/energon/" in f),
    ("torch DataLoader", lambda f, n: "torch/utils/data" in f),
    ("torch", lambda f, n: "/torch/" in f),
    ("numpy", lambda f, n: "/numpy/" in f),
]


class Sampler:
    """Samples the main thread's stack every ``interval`` s: counts per part and per
    innermost function."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.parts: collections.Counter = collections.Counter()
        self.functions: collections.Counter = collections.Counter()
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def counts(self) -> dict:
        return {"parts": dict(self.parts), "functions": dict(self.functions.most_common(15))}

    def _run(self):
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self._main)
            if frame is None:
                continue
            code = frame.f_code
            self.functions[f"{os.path.basename(code.co_filename)}:{code.co_name}"] += 1
            self.parts[self._part(frame)] += 1

    @staticmethod
    def _part(frame) -> str:
        while frame is not None:
            f, n = frame.f_code.co_filename, frame.f_code.co_name
            for what, test in PARTS:
                if test(f, n):
                    return what
            frame = frame.f_back
        return "other"


def profile_table(result: dict) -> str:
    sides = ("wdsvlm", "energon")
    result = {s: {**result[s], **result[s]["profile"]} for s in sides}
    totals = {s: sum(result[s]["parts"].values()) for s in sides}
    per_sample = {s: result[s]["seconds"] * 1000 / result[s]["samples"] for s in sides}
    parts = sorted(
        set(result["wdsvlm"]["parts"]) | set(result["energon"]["parts"]),
        key=lambda p: -result["wdsvlm"]["parts"].get(p, 0),
    )
    lines = [
        "where the main thread's time goes, 0 workers (share of samples; ms per sample):",
        f"{'':30} {'wdsvlm':>16} {'Energon':>16}",
    ]
    for part in parts:
        cells = []
        for s in sides:
            share = result[s]["parts"].get(part, 0) / totals[s]
            cells.append(f"{share:6.1%} {share * per_sample[s]:6.2f} ms")
        lines.append(f"{part:30} {cells[0]:>16} {cells[1]:>16}")
    lines.append(
        f"{'total':30} {per_sample['wdsvlm']:13.2f} ms {per_sample['energon']:13.2f} ms"
        " (profiled, so a little slower)"
    )
    for s in sides:
        lines.append(f"\n{s}: busiest innermost functions (share of samples)")
        for name, count in sorted(result[s]["functions"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {count / totals[s]:6.1%}  {name}")
    return "\n".join(lines)


# --- the run --------------------------------------------------------------------------------


def table(results: list[dict]) -> str:
    lines = [
        f"{'workers':>7} {'loader':11} {'samples':>7} {'samples/s':>10} {'after 1st':>10}"
        f" {'per CPU-s':>10} {'CPU s':>7} {'fork server CPU s':>17} {'padding':>8}"
        f" {'1st batch':>10}"
    ]
    for r in results:
        lines.append(
            f"{r['workers']:7d} {r['side']:11} {r['samples']:7d} {r['samples_per_s']:10.1f} "
            f"{r['samples_per_s_after_first']:10.1f} {r['samples_per_cpu_s']:10.2f} "
            f"{r['cpu_s']:7.1f} {r['cpu_fork_server_s']:17.1f} {r['padding']:8.2%} "
            f"{r['first_batch_s']:9.2f}s"
        )
    return "\n".join(lines)


def ratios(results: list[dict], workers: list[int]) -> dict:
    """Each side's best round per worker count (a noisy shared machine slows runs down, never
    speeds them up), and wdsvlm's (and wdsvlm-fork's, if run) over Energon's."""
    out = {}
    for w in workers:
        best = {}
        for side in ("wdsvlm", "wdsvlm-fork", "energon"):
            mine = [r for r in results if r["side"] == side and r["workers"] == w]
            if not mine:
                continue
            best[side] = {
                "samples_per_s": max(r["samples_per_s"] for r in mine),
                "samples_per_s_after_first": max(r["samples_per_s_after_first"] for r in mine),
                "samples_per_cpu_s": max(r["samples_per_cpu_s"] for r in mine),
                "first_batch_s": min(r["first_batch_s"] for r in mine),
                "padding": min(r["padding"] for r in mine),
            }
        out[w] = {"best": best}
        for side in ("wdsvlm", "wdsvlm-fork"):
            if side in best:
                out[w][side] = {
                    name: best[side][name] / best["energon"][name]
                    for name in ("samples_per_s", "samples_per_s_after_first", "samples_per_cpu_s")
                }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", choices=("coco", "web", "photos"), default="coco")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--workdir", default="/tmp/wdsvlm-bench")
    parser.add_argument("--tokenizer", default=TOKENIZER)
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--shuffle-buffer", type=int, default=1000)
    parser.add_argument(
        "--pack-buffer", type=int, default=500, help="the Loader's window, Energon's buffer"
    )
    parser.add_argument("--tile-size", type=int, default=512)
    parser.add_argument("--max-image-side", type=int, default=1024)
    parser.add_argument("--tokens-per-tile", type=int, default=64)
    parser.add_argument(
        "--fork",
        action="store_true",
        help="also wdsvlm with workers forked from the training process (as Energon's are)",
    )
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--measure", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    require_bench_extra()
    warnings.filterwarnings("ignore", message=".*pin_memory.*")
    import torch

    torch.set_num_threads(1)  # one core per process, as in DataLoader workers
    if args.measure:
        what, side, source, workers, expected, out = args.measure
        result = measure(side, source, int(workers), args, int(expected), what)
        with open(out, "w") as f:
            json.dump(result, f)
        return

    import bench_pipeline

    folder = bench_pipeline.make_mix(
        args.mix, args.samples, os.path.join(args.workdir, f"n{args.samples}")
    )
    keys = dataset_keys(folder)
    for name in os.listdir(folder):  # warm the page cache: time the work, not the disk
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(1 << 24):
                pass
    view = energon_view(folder)
    try:
        if args.profile:
            result = {
                side: measure_apart(side, source, 0, args, len(keys), "profile")
                for side, source in (("wdsvlm", folder), ("energon", view))
            }
            print(json.dumps(result, indent=2) if args.json else profile_table(result))
            return
        checked = None
        if not args.no_check:
            ours = measure_apart("wdsvlm", folder, 0, args, len(keys), "check")
            theirs = measure_apart("energon", view, 0, args, len(keys), "check")
            checked = compare(ours, theirs, keys)
        results = []
        for _ in range(args.rounds):
            for w in args.workers:
                results.append(measure_apart("wdsvlm", folder, w, args, len(keys)))
                results.append(measure_apart("energon", view, w, args, len(keys)))
                if args.fork and w:
                    results.append(measure_apart("wdsvlm-fork", folder, w, args, len(keys)))
    finally:
        shutil.rmtree(view)
    expected = hashlib.sha1("\n".join(sorted(keys)).encode()).hexdigest()
    for r in results:  # every run gave every sample of the pass
        if r["first_pass_samples"] != len(keys) or r["first_pass_sha1"] != expected:
            raise AssertionError(f"{r['side']}, {r['workers']} workers: not every sample came")
    summary = ratios(results, args.workers)
    if args.json:
        print(json.dumps({"check": checked, "runs": results, "ratios": summary}, indent=2))
        return
    print(
        f"{folder}: {len(keys)} samples, batches [{args.batch_size}, {args.max_length}], "
        f"shuffle buffer {args.shuffle_buffer}, packing window/buffer {args.pack_buffer}"
    )
    print(table(results))
    for w, r in summary.items():
        best = r["best"]
        for side in ("wdsvlm", "wdsvlm-fork"):
            if side not in r:
                continue
            print(
                f"{w} workers, {side}/Energon: samples/s {r[side]['samples_per_s']:.2f}x "
                f"({r[side]['samples_per_s_after_first']:.2f}x after the first batch), per "
                f"CPU-second {r[side]['samples_per_cpu_s']:.2f}x; padding "
                f"{best[side]['padding']:.2%} against {best['energon']['padding']:.2%}; first "
                f"batch {best[side]['first_batch_s']:.2f} s against "
                f"{best['energon']['first_batch_s']:.2f} s (best of each)"
            )
    for r in results:
        if (
            r["processes_not_waited_for"]
            or r["cpu_children_s"] < 0.9 * r["cpu_children_live_at_end_s"]
        ):
            print(f"warning: {r['side']}, {r['workers']} workers: child CPU time may be missing")
    if checked:
        print(checked)


if __name__ == "__main__":
    main()
