"""Benchmark: what the Loader's telemetry costs, whether its figures are true, and whether its
advice names the right stage.

    python scripts/bench_telemetry.py [--part cost|overhead|truth|advice|all] [--samples N]
        [--rounds R] [--ray] [--workdir DIR] [--json]

- cost: what the telemetry adds, measured apart, since a 1% difference is below this
  machine's noise between two runs of the same epoch: the stretches a worker times per sample
  (counted in a trace of a whole epoch, 0 workers), what one timed stretch costs (a
  ``StageClock`` over a million items, writing a real status board, against the bare loop),
  and the pipeline's seconds per sample (the same epoch without telemetry).
- overhead: samples/s of one epoch of ``wdsvlm.Loader`` (2 workers, the coco-sized mix of
  scripts/bench_pipeline.py, batches of 8 rows of 2048 tokens) with ``telemetry=True`` and
  ``telemetry=False``, alternating A B A B, best of ``--rounds`` each.
- truth: figures against costs injected with known durations, at 0 and 2 workers (and on Ray
  with ``--ray``): a ``map=`` that sleeps 20 ms a sample (``data/map_s``), a store 50 ms late
  a request (the project's range server: ``data/requests`` against the server's own count,
  ``data/store_s`` against 50 ms a request), and a training step of 30 ms (``data/step_s``,
  ``data/wait_fraction`` against the wall time the steps did not take).
- advice: the one line of advice on three staged cases: a slow store, slow decoding (large
  images, one worker) and a fast pipeline behind a slow step (no advice).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_pipeline  # noqa: E402  (its image mixes)

import wdsvlm  # noqa: E402
from wdsvlm.testing.stores import range_server  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "shards_example", "tokenizer")
MAP_SLEEP, STORE_DELAY, STEP = 0.020, 0.050, 0.030


def sleepy_map(calls: str, sample, rng):
    """A map= of a known cost: 20 ms a sample; each call leaves one byte in the file
    ``calls`` (given with functools.partial: Ray's workers do not see this process's
    environment)."""
    time.sleep(MAP_SLEEP)
    with open(calls, "ab") as f:
        f.write(b".")
    return sample


def loader(source, **settings):
    options = dict(max_length=2048, batch_size=8, num_workers=2, seed=0)
    options.update(settings)
    return wdsvlm.Loader(source, TOKENIZER, **options)


def epoch(batches, step: float = 0.0, limit: int | None = None) -> tuple[int, float, float]:
    """Take the batches (sleeping ``step`` a batch, as a model step would): samples, the
    seconds after the first batch, and the samples after it."""
    samples = first = 0
    began = None
    for i, batch in enumerate(batches):
        n = sum(len(keys) for keys in batch["sample_keys"])
        samples += n
        if began is None:
            began, first = time.perf_counter(), n
        if step:
            time.sleep(step)
        if limit is not None and i + 1 >= limit:
            break
    return samples, time.perf_counter() - (began or time.perf_counter()), samples - first


def overhead(folder: str, rounds: int) -> dict:
    rates: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            with_it = loader(folder, telemetry=on)
            try:
                _, seconds, after_first = epoch(with_it)
            finally:
                with_it.close()
            rates[on].append(after_first / seconds)
            print(f"  round {r + 1} telemetry={on}: {rates[on][-1]:.1f} samples/s", flush=True)
    best_on, best_off = max(rates[True]), max(rates[False])
    return {
        "on": rates[True],
        "off": rates[False],
        "best_on": best_on,
        "best_off": best_off,
        "ratio": best_on / best_off,
    }


def cost(folder: str) -> dict:
    from wdsvlm.loader.watchdog import StatusBoard
    from wdsvlm.pipeline.timing import StageClock

    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        telemetry = wdsvlm.Telemetry(trace=trace, trace_steps=10**6)
        it = loader(folder, num_workers=0, telemetry=telemetry)
        samples = epoch(it)[0]
        it.close()
        with open(trace) as f:
            events = json.load(f)["traceEvents"]
        stretches = sum(1 for e in events if e["ph"] == "X" and e.get("tid", 0) != 0)
        board = StatusBoard.create(tmp, 1)
        n = 10**6
        start = time.perf_counter()
        for _ in range(n):
            pass
        bare = time.perf_counter() - start
        clock = StageClock(board, 0)
        start = time.perf_counter()
        for _ in clock.timed("read", range(n)):
            pass
        per_stretch = (time.perf_counter() - start - bare) / n
        board.remove()
    it = loader(folder, num_workers=0, telemetry=False)
    began = time.perf_counter()
    plain = epoch(it)[0]
    per_sample = (time.perf_counter() - began) / plain
    it.close()
    added = stretches / samples * per_stretch
    return {
        "stretches_per_sample": stretches / samples,
        "us_per_stretch": per_stretch * 1e6,
        "ms_per_sample": per_sample * 1e3,
        "share": added / per_sample,
    }


def truth(folder: str, workers: int, ray: bool = False) -> dict:
    extra = {"workers": wdsvlm.RayWorkers()} if ray else {}
    out = {}
    with tempfile.TemporaryDirectory() as calls:
        calls = os.path.join(calls, "calls")
        it = loader(folder, num_workers=workers, map=functools.partial(sleepy_map, calls), **extra)
        try:
            it.metrics()  # the interval starts with the iteration
            epoch(it, limit=12)
            figures = it.metrics()
        finally:
            it.close()
        mapped = os.path.getsize(calls)
    out["map"] = {"reported_s": figures["data/map_s"], "truth_s": mapped * MAP_SLEEP}
    # the store's own time a request, measured with no delay, is added to the injected 50 ms
    store = {delay: read_from_store(folder, delay, workers, extra) for delay in (0.0, STORE_DELAY)}
    fast, slow = store[0.0], store[STORE_DELAY]
    out["store"] = {
        "requests_reported": slow["reported"],
        "requests_served": slow["served"],
        "reported_s": slow["seconds"],
        "truth_s": slow["served"] * (STORE_DELAY + fast["seconds"] / max(1, fast["reported"])),
    }
    it = loader(folder, num_workers=workers, **extra)
    try:
        it.metrics()
        began = time.perf_counter()
        stepped = 0.0  # each step as the loop itself times it: a sleep takes what it takes
        for batch in it:
            start = time.perf_counter()
            time.sleep(STEP)
            del batch  # a step lets its batch go (freeing its pixels takes ~10 ms here)
            last = time.perf_counter()
            stepped += last - start
        wall = last - began  # to the last step's end: the epoch's end is no step's wait
        figures = it.metrics()
    finally:
        it.close()
    out["step"] = {
        "reported_s": figures["data/step_s"],
        "truth_s": stepped,
        "wait_fraction": figures["data/wait_fraction"],
        # the Loader's own work in this process (the batch's first touch of its shared
        # memory, counting its tokens) is apart from the wait in the figures
        "loader_share": figures["data/loader_s"] / wall,
        "wait_truth": 1 - stepped / wall,
    }
    return out


def read_from_store(folder: str, delay: float, workers: int, extra: dict) -> dict:
    """12 batches read one span at a time (no reader thread competes with the decoding for
    the interpreter) from the range server ``delay`` s late a request: requests reported
    and served, and the store seconds reported."""
    parent, name = os.path.split(folder.rstrip("/"))
    with range_server(parent, delay=delay) as server:
        it = loader(f"{server.url}/{name}", num_workers=workers, read_ahead=0, **extra)
        try:
            it.metrics()
            before = server.requests
            epoch(it, limit=12)
            figures = it.metrics()
        finally:
            it.close()
        served = server.requests - before
    return {
        "reported": figures["data/requests"],
        "served": served,
        "seconds": figures["data/store_s"],
    }


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def advised(source: str, step: float, steps: int, **settings) -> list[str]:
    lines = Lines()
    logging.getLogger("wdsvlm").addHandler(lines)
    telemetry = wdsvlm.Telemetry(window=10)
    try:
        it = loader(source, telemetry=telemetry, **settings)
        try:
            epoch(it, step=step, limit=steps)
        finally:
            it.close()
    finally:
        logging.getLogger("wdsvlm").removeHandler(lines)
    return [line for line in lines.lines if "waited" in line]


def advice(coco: str, web: str) -> dict:
    """Batches of 2 rows, advice weighed every 10 steps: a store 0.3 s late a request read
    one span at a time by one worker; large images decoded by one worker; the coco mix on 2
    workers behind a 0.5 s step."""
    parent, name = os.path.split(coco.rstrip("/"))
    with range_server(parent, delay=0.3) as server:
        url = f"{server.url}/{name}"
        store = advised(url, 0.01, 30, num_workers=1, read_ahead=1, batch_size=2)
    decode = advised(web, 0.01, 30, num_workers=1, batch_size=2)
    fast = advised(coco, 0.5, 30, num_workers=2, batch_size=2)
    return {"slow store": store, "slow decoding": decode, "fast pipeline": fast}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--part", choices=("cost", "overhead", "truth", "advice", "all"), default="all"
    )
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--ray", action="store_true", help="truth on Ray workers too")
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "wdsvlm-bench"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    coco = bench_pipeline.make_mix("coco", args.samples, args.workdir)
    result: dict = {}
    if args.part in ("cost", "all"):
        c = result["cost"] = cost(coco)
        print(
            f"cost: {c['stretches_per_sample']:.1f} timed stretches a sample x "
            f"{c['us_per_stretch']:.2f} us against {c['ms_per_sample']:.2f} ms a sample: "
            f"{c['share']:.3%} of the pipeline's time"
        )
    if args.part in ("overhead", "all"):
        print("overhead: samples/s with telemetry on and off, 2 workers", flush=True)
        result["overhead"] = overhead(coco, args.rounds)
        o = result["overhead"]
        print(f"  best on {o['best_on']:.1f}, off {o['best_off']:.1f}: {o['ratio']:.4f}x")
    if args.part in ("truth", "all"):
        result["truth"] = {}
        cases = [("0 workers", 0, False), ("2 workers", 2, False)]
        if args.ray:
            import ray

            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            cases.append(("2 Ray workers", 2, True))
        for label, workers, on_ray in cases:
            found = result["truth"][label] = truth(coco, workers, on_ray)
            print(f"truth, {label}:")
            for what, figures in found.items():
                print("  " + what + ": " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    if args.part in ("advice", "all"):
        web = bench_pipeline.make_mix("web", 200, args.workdir)
        result["advice"] = advice(coco, web)
        for case, lines in result["advice"].items():
            print(f"advice, {case}: {lines or 'none'}")
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
