"""The trace of the first steps (loader/trace.py): a file Chrome and Perfetto open (the trace
event format's keys for each phase, microseconds, lanes named), bounded by its steps; written
by a Loader with workers and by `wdsvlm bench --trace`; drawn by `wdsvlm trace`."""

from __future__ import annotations

import json
import os
import time

import pytest
from PIL import Image

import wdsvlm
from wdsvlm.loader.trace import TraceWriter
from wdsvlm.pipeline.timing import STAGES, StageClock
from wdsvlm.tools.trace_picture import LANE, WIDTH, trace_picture

from .conftest import EXAMPLE, run_cli

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = ["--tile-size", "128", "--max-image-side", "256", "--tokens-per-tile", "16"]
NEEDED = {  # the keys the trace event format asks of each phase used
    "X": {"name", "ph", "ts", "dur", "pid", "tid"},
    "M": {"name", "ph", "pid", "tid", "args"},
}


def valid_trace(path: str) -> dict:
    """The trace at ``path``, checked as Chrome's and Perfetto's JSON importers read it."""
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    assert set(trace) >= {"traceEvents", "displayTimeUnit"}
    assert trace["displayTimeUnit"] == "ms"
    lanes: dict[tuple, list[dict]] = {}
    for event in trace["traceEvents"]:
        assert event["ph"] in NEEDED, event
        assert NEEDED[event["ph"]] <= set(event), event
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "M":
            assert event["name"] in {"process_name", "thread_name", "process_sort_index"}
            continue
        for key in ("ts", "dur"):
            assert isinstance(event[key], int | float) and event[key] >= 0, event
        lanes.setdefault((event["pid"], event["tid"]), []).append(event)
    # complete events of one thread nest or follow each other, as the viewers stack them
    for events in lanes.values():
        holding: list[float] = []
        for event in events:
            # (to the viewers' nanosecond: ts + dur in float microseconds is not exact)
            while holding and holding[-1] <= event["ts"] + 1e-3:
                holding.pop()
            end = event["ts"] + event["dur"]
            assert not holding or end <= holding[-1] + 1e-3, ("overlaps its parent", event)
            holding.append(end)
        starts = [e["ts"] for e in events]
        assert starts == sorted(starts)
    return trace


def names(trace: dict) -> dict[tuple[int, int], str]:
    """Each thread's name, by (pid, tid)."""
    return {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def spans(trace: dict, lane: tuple[int, int] | None = None) -> list[dict]:
    return [
        e
        for e in trace["traceEvents"]
        if e["ph"] == "X" and (lane is None or (e["pid"], e["tid"]) == lane)
    ]


def worker_spans(clock: StageClock, samples: int) -> list[tuple[str, float, float]]:
    """Spans of a real StageClock over nested stages (read inside tokenize inside collate)."""

    def read():
        for i in range(samples):
            time.sleep(0.001)
            yield i

    def decoded(items):
        for item in items:
            with clock.stage("decode_image"):
                time.sleep(0.001)
            yield item

    clock.spans = []
    chain = clock.timed("collate", decoded(clock.timed("tokenize", clock.timed("read", read()))))
    list(chain)
    return clock.take()["spans"]


def test_the_file_is_a_chrome_trace_with_named_lanes_and_nested_spans(tmp_path):
    path = str(tmp_path / "trace.json")
    writer = TraceWriter(path, steps=4)
    clocks = [StageClock(slot=slot) for slot in range(2)]
    for step in range(4):
        slot = step % 2
        started = time.perf_counter()
        writer.worker(slot, 1000 + slot, worker_spans(clocks[slot], 3))
        got = time.perf_counter()
        writer.consumer("wait", started, got)
        handed = time.perf_counter()
        writer.consumer("loader", got, handed)
        writer.consumer("step", handed, time.perf_counter())
        assert writer.step() == (step < 3)  # False: the steps are recorded, the file written
        if step < 3:
            assert not os.path.exists(path)
    writer.close()  # the file is written by a thread: close waits for it
    assert os.listdir(tmp_path) == ["trace.json"]  # the temporary file renamed, none left
    trace = valid_trace(path)
    lanes = names(trace)
    assert lanes[1000, 1] == "worker 0 (pid 1000)" and lanes[1001, 2] == "worker 1 (pid 1001)"
    assert lanes[os.getpid(), 0] == f"training (pid {os.getpid()})"
    processes = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert processes == {
        1000: lanes[1000, 1],
        1001: lanes[1001, 2],
        os.getpid(): lanes[os.getpid(), 0],
    }
    worker = spans(trace, (1000, 1))
    assert {e["name"] for e in worker} == {"read", "tokenize", "decode_image", "collate"}
    # 2 batches of 3 samples through 4 stages, and the 3 generators' last next (the end)
    assert len(worker) == 2 * (3 * 4 + 3)
    # a collate span holds the tokenize span it pulled, which holds a read span
    collate = worker[0]
    assert collate["name"] == "collate" and worker[1]["name"] == "tokenize"
    assert collate["ts"] <= worker[1]["ts"] and worker[1]["ts"] + worker[1]["dur"] <= (
        collate["ts"] + collate["dur"]
    )
    assert [e["name"] for e in spans(trace, (os.getpid(), 0))] == ["wait", "loader", "step"] * 4
    assert min(e["ts"] for e in spans(trace)) == 0  # from the first event
    # a 1 ms sleep read in microseconds (a read's last next, the end, sleeps not)
    assert all(e["dur"] >= 1000 for e in worker if e["name"] == "decode_image")
    assert sum(e["dur"] >= 1000 for e in worker if e["name"] == "read") == 2 * 3
    assert trace["otherData"]["steps"] == 4


def test_nothing_is_kept_after_the_steps_and_close_writes_a_short_run(tmp_path):
    path = str(tmp_path / "trace.json")
    writer = TraceWriter(path, steps=2)
    now = time.perf_counter()
    writer.consumer("wait", now, now + 0.01)
    assert writer.step()
    writer.consumer("wait", now + 0.01, now + 0.02)
    assert not writer.step()
    writer.close()
    written = open(path).read()
    for later in range(1000):  # a long run goes on after the trace's steps
        writer.worker(0, 7, [("read", now + later, now + later + 1)])
        writer.consumer("wait", now + later, now + later + 1)
        assert not writer.step()
    writer.close()
    assert open(path).read() == written
    assert len(spans(valid_trace(path))) == 2

    short = str(tmp_path / "short.json")
    writer = TraceWriter(short, steps=200)
    writer.worker(0, os.getpid(), [("read", now, now + 0.002), ("collate", now, now + 0.003)])
    writer.consumer("wait", now, now + 0.003)
    assert writer.step() and not os.path.exists(short)
    writer.close()  # fewer steps than asked: what there is
    trace = valid_trace(short)
    assert trace["otherData"]["steps"] == 1
    # no worker processes: the workers' lanes are threads of the training process
    assert names(trace) == {
        (os.getpid(), 0): f"training (pid {os.getpid()})",
        (os.getpid(), 1): f"worker 0 (pid {os.getpid()})",
    }
    with pytest.raises(ValueError, match="at least 1 step"):
        TraceWriter(short, steps=0)


def test_the_training_process_stretches_follow_each_other(tmp_path):
    # read from clocks taken apart, a stretch may begin before the last one ended: a viewer
    # would draw it inside that one
    path = str(tmp_path / "trace.json")
    writer = TraceWriter(path, steps=1)
    writer.consumer("wait", 10.0, 10.5)
    writer.consumer("loader", 10.4999, 10.6)
    writer.consumer("step", 10.6, 10.59)  # an end read before the start
    assert not writer.step()
    writer.close()  # written by a thread: close waits for it
    got = [(e["name"], e["ts"], e["dur"]) for e in spans(valid_trace(path))]
    assert got == [("wait", 0, 500_000), ("loader", 500_000, 100_000), ("step", 600_000, 0)]


def test_a_trace_that_cannot_be_written_is_a_warning_not_an_error(tmp_path, caplog):
    # the file is written from the training loop's step: a full disk must not stop training
    taken = tmp_path / "taken.json"
    taken.mkdir()  # a folder where the file should go
    writer = TraceWriter(str(taken), steps=1)
    now = time.perf_counter()
    writer.consumer("wait", now, now + 0.01)
    assert not writer.step()
    writer.close()
    assert "could not write the trace" in caplog.text and str(taken) in caplog.text
    assert os.listdir(tmp_path) == ["taken.json"]  # no temporary file left


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_a_loader_with_two_workers_traces_their_stages_and_the_waits(tmp_path):
    path = str(tmp_path / "loader.json")
    loader = wdsvlm.Loader(
        EXAMPLE,
        TOKENIZER,
        max_length=1024,
        batch_size=2,
        num_workers=2,
        tile_size=128,
        max_image_side=256,
        tokens_per_tile=16,
        telemetry=wdsvlm.Telemetry(trace=path, trace_steps=6),
    )
    try:
        for step, _ in enumerate(loader):
            time.sleep(0.005)  # a model step
            if step == 9:
                break
    finally:
        loader.close()
    trace = valid_trace(path)
    lanes = names(trace)
    workers = {lane: name for lane, name in lanes.items() if name.startswith("worker ")}
    assert sorted(name.split(" (")[0] for name in workers.values()) == ["worker 0", "worker 1"]
    for lane, name in workers.items():
        assert name == f"worker {lane[1] - 1} (pid {lane[0]})" and lane[0] != os.getpid()
        stages = {e["name"] for e in spans(trace, lane)}
        assert stages <= set(STAGES) and {"read", "tokenize", "collate"} <= stages, stages
    training = spans(trace, (os.getpid(), 0))
    assert {e["name"] for e in training} >= {"wait", "step"}
    assert 1 <= sum(e["name"] == "wait" for e in training) <= 6 + 1  # the trace's 6 steps
    assert trace["otherData"]["steps"] == 6


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_bench_trace_writes_a_trace_and_prints_the_diagnosis(tmp_path):
    path = str(tmp_path / "bench.json")
    run = run_cli(
        "bench", EXAMPLE, "--tokenizer", TOKENIZER, "--workers", "2", "--limit", "40",
        "--max-length", "1024", "--batch-size", "2", "--trace", path, "--trace-steps", "2",
        "-q", *SMALL,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout, run.stderr)
    trace = valid_trace(path)
    assert trace["otherData"]["steps"] == 2
    assert any(name.startswith("worker 1 (pid") for name in names(trace).values())
    assert f"trace of the Loader's first 2 steps: {path}" in run.stdout
    assert "ui.perfetto.dev" in run.stdout and "chrome://tracing" in run.stdout
    assert (
        "the Loader's pipeline, " in run.stdout
        and " s in 2 workers: " in run.stdout
        and "advice: " in run.stdout
    )

    run = run_cli(
        "bench", EXAMPLE, "--tokenizer", TOKENIZER, "--workers", "1", "--limit", "20",
        "--max-length", "1024", "--json", "-q", *SMALL,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout, run.stderr)
    telemetry = json.loads(run.stdout)["telemetry"]
    shares = telemetry["stage_shares"]
    assert set(shares) <= set(STAGES) and sum(shares.values()) == pytest.approx(1.0)
    assert telemetry["worker_seconds"] == pytest.approx(
        sum(telemetry["metrics"][f"data/{stage}_s"] for stage in STAGES)
    )
    assert telemetry["advice"] and 0 <= telemetry["wait_fraction"] <= 1


def test_trace_draws_a_lane_per_worker_and_one_for_training(tmp_path):
    path = str(tmp_path / "trace.json")
    writer = TraceWriter(path, steps=3)
    for step in range(3):
        started = time.perf_counter()
        writer.worker(step % 2, 2000 + step % 2, worker_spans(StageClock(slot=step % 2), 2))
        writer.consumer("wait", started, time.perf_counter())
        writer.step()
    writer.close()
    out = str(tmp_path / "trace.png")
    run = run_cli("trace", path, "--out", out)
    assert run.returncode == 0, (run.stdout, run.stderr)
    assert run.stdout.startswith(f"{out}: 3 lanes, ")
    assert "worker 1 (pid 2001): " in run.stdout and "wait 100%" in run.stdout
    with Image.open(out) as picture:
        assert picture.size == (WIDTH, 150 + 3 * LANE)
    # steps 1 and 2 of the training process only: its first step's wait left out
    run = run_cli("trace", path, "--out", out, "--skip", "1", "--steps", "2")
    assert run.returncode == 0, (run.stdout, run.stderr)
    waits = [e for e in spans(valid_trace(path)) if e["name"] == "wait"]
    drawn = (waits[2]["ts"] + waits[2]["dur"] - waits[1]["ts"]) / 1000
    assert f"spans over {drawn:.0f} ms" in run.stdout
    run = run_cli("trace", path, "--out", out, "--skip", "3")
    assert run.returncode == 2 and "no step 3 (it has 3)" in run.stderr

    empty = tmp_path / "empty.json"
    empty.write_text('{"traceEvents": []}')
    run = run_cli("trace", str(empty), "--out", out)
    assert run.returncode == 2 and "no spans" in run.stderr
    empty.write_text('{"events": []}')
    run = run_cli("trace", str(empty), "--out", out)
    assert run.returncode == 2 and "is not a Chrome trace" in run.stderr


def test_stretches_that_meet_are_drawn_side_by_side(tmp_path):
    # ts + dur of one stretch, in float microseconds, can land a hair past the next one's ts:
    # the picture took the next for a stretch inside it (wait 107%, step -7%)
    path = str(tmp_path / "trace.json")
    writer = TraceWriter(path, steps=2)
    # microseconds from a real trace: 5435164.024 + 241.44 > 5435405.464 in floats
    writer.consumer("wait", 0.0, 5.435164024)
    writer.consumer("loader", 5.435164024, 5.435405464)
    writer.consumer("step", 5.435405464, 5.435905518)
    writer.step()
    writer.close()
    drawn = trace_picture(path, str(tmp_path / "trace.png"))
    (training,) = drawn["ms_per_lane"].values()
    assert training == pytest.approx(
        {"wait": 5435.164024, "loader": 0.24144, "step": 0.500054}, abs=1e-6
    )
