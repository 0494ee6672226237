"""The training process's side of telemetry: each step's wait for its batch against injected
truth (a map= of known cost, a model step of known length), metrics() and its reset, the
advice (diagnose on staged figures, and one line in a run that waits), and a hang named with
its worker and stage."""

from __future__ import annotations

import gc
import logging
import os
import re
import tempfile
import threading
import time
import types

import pytest

import wdsvlm
from wdsvlm.loader.advice import diagnose
from wdsvlm.loader.telemetry import DataMeter
from wdsvlm.pipeline.timing import STAGES

from .conftest import EXAMPLE

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = dict(
    max_length=1024,
    batch_size=2,
    tile_size=64,
    max_image_side=128,
    tokens_per_tile=4,
    shuffle_buffer=8,
    pack_window=16,
)
MAP_SLEEP, STEP = 0.020, 0.030

CONSUMER = {
    "data/steps",
    "data/wait_fraction",
    "data/wait_s",
    "data/wait_mean_s",
    "data/wait_p50_s",
    "data/wait_p95_s",
    "data/wait_max_s",
    "data/loader_s",
    "data/step_s",
    "data/samples_per_s",
    "data/tokens_per_s",
    "data/supervised_tokens_per_s",
    "data/padding",
    "data/batches_ready",
}
WORKERS = {f"data/{stage}_s" for stage in STAGES} | {
    "data/requests",
    "data/bytes_read",
    "data/store_s",
    "data/throttled",
    "data/retries",
    "data/cache_hits",
    "data/skipped",
}


def loader(**extra) -> wdsvlm.Loader:
    return wdsvlm.Loader(EXAMPLE, TOKENIZER, **{**SMALL, **extra})


def sleepy(sample, rng):
    """A map= of known cost."""
    time.sleep(MAP_SLEEP)
    return sample


_SLEPT = []


def stuck_once(sample, rng):
    """A map= that holds its process's first sample for 3 s."""
    if not _SLEPT:
        _SLEPT.append(True)
        time.sleep(3.0)
    return sample


def train(data_loader, step: float = STEP) -> tuple[int, float, float]:
    """One epoch with a 'model step' of ``step`` seconds after each batch: the steps, the wall
    time of the loop (from asking for the first batch to the end of the epoch) and the time
    the steps took as the loop times them (a sleep on a busy machine takes what it takes)."""
    start = time.perf_counter()
    steps, stepped = 0, 0.0
    for _ in data_loader:
        began = time.perf_counter()
        time.sleep(step)
        stepped += time.perf_counter() - began
        steps += 1
    return steps, time.perf_counter() - start, stepped


@pytest.mark.parametrize(
    "workers", [0, pytest.param(2, marks=[pytest.mark.processes, pytest.mark.timeout(180)])]
)
def test_the_wait_and_the_step_are_measured_where_they_happen(workers):
    data_loader = loader(map=sleepy, num_workers=workers, batches_per_epoch=8)
    try:
        steps, wall, truth = train(data_loader)
        m = data_loader.metrics()
    finally:
        data_loader.close()
    assert steps == m["data/steps"] == 8
    # the model's steps: at least the sleeps as the loop timed them, within 10%
    assert steps * STEP <= truth <= m["data/step_s"] < 1.1 * truth
    # every second of the loop is a wait, the Loader's own work or a step
    timed = m["data/wait_s"] + m["data/loader_s"] + m["data/step_s"]
    assert 0.98 * wall < timed <= wall
    # the wait: the loop's time that was not the model's step (nor the Loader's own work)
    true_wait = (wall - truth - m["data/loader_s"]) / wall
    assert m["data/wait_fraction"] == pytest.approx(true_wait, rel=0.1)
    assert m["data/loader_s"] < 0.05 * wall
    waits = m["data/wait_p50_s"], m["data/wait_p95_s"], m["data/wait_max_s"]
    assert 0 < waits[0] <= waits[1] <= waits[2] <= m["data/wait_s"]
    assert m["data/wait_mean_s"] == pytest.approx(m["data/wait_s"] / steps)
    # the user's map= seconds, from the workers' reports: at least its sleeps
    assert m["data/map_s"] >= MAP_SLEEP * m["data/samples_per_s"] * wall * 0.99
    assert m["data/requests"] > 0 and m["data/bytes_read"] > 0
    assert not [t for t in threading.enumerate() if t.name == "wdsvlm-watchdog"]


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_batches_ready_counts_what_the_workers_made_ahead_of_a_slow_step():
    # 2 workers, 2 batches each in flight: behind a slow step the DataLoader holds up to 4
    data_loader = loader(num_workers=2, batches_per_epoch=8, prefetch_factor=2)
    try:
        train(data_loader, step=0.5)
        m = data_loader.metrics()
    finally:
        data_loader.close()
    assert 1.5 <= m["data/batches_ready"] <= 4, m["data/batches_ready"]
    assert m["data/wait_p50_s"] < 0.05  # the steps found their batches made


def test_metrics_are_per_interval_and_named_under_data():
    data_loader = loader(num_workers=0, batches_per_epoch=6)
    batches = iter(data_loader)
    for _ in range(3):
        next(batches)
    first = data_loader.metrics(reset=False)
    assert set(first) == CONSUMER | WORKERS  # no reason skipped: no data/skipped/<reason>
    assert all(isinstance(v, float) for v in first.values())
    assert first["data/steps"] == 3
    assert data_loader.metrics(reset=False)["data/steps"] == 3  # not reset: the same interval
    assert data_loader.metrics()["data/steps"] == 3
    empty = data_loader.metrics()
    assert empty["data/steps"] == 0 and empty["data/wait_s"] == 0
    assert empty["data/samples_per_s"] == 0 and empty["data/wait_fraction"] == 0
    rest = list(batches)
    later = data_loader.metrics()
    assert later["data/steps"] == len(rest) == 3
    assert later["data/samples_per_s"] > 0 and later["data/tokens_per_s"] > 0
    assert 0 < later["data/supervised_tokens_per_s"] < later["data/tokens_per_s"]
    assert 0 <= later["data/padding"] < 1

    off = loader(num_workers=0, batches_per_epoch=2, telemetry=False)
    list(off)
    figures = off.metrics()
    assert set(figures) == CONSUMER and figures["data/steps"] == 2
    assert figures["data/wait_s"] > 0 and figures["data/samples_per_s"] > 0


def test_the_loaders_work_outside_its_iteration_is_not_the_models_step():
    data_loader = loader(num_workers=0, batches_per_epoch=3)
    for _ in data_loader:
        with data_loader._meter.work():  # as the Trainer's model_inputs
            time.sleep(0.05)
        time.sleep(0.02)
    m = data_loader.metrics()
    assert 3 * 0.05 <= m["data/loader_s"] < 3 * 0.05 + 0.05
    assert 3 * 0.02 <= m["data/step_s"] < 3 * 0.02 * 1.5


def test_time_that_is_neither_the_loaders_nor_the_steps_is_left_out():
    data_loader = loader(num_workers=0, batches_per_epoch=3)
    for _ in data_loader:
        with data_loader._meter.work(loader=False):  # as the Trainer's evaluation
            time.sleep(0.1)
        time.sleep(0.02)
    m = data_loader.metrics()
    assert m["data/loader_s"] < 0.05
    assert 3 * 0.02 <= m["data/step_s"] < 3 * 0.02 * 1.5
    assert m["data/wait_fraction"] == pytest.approx(
        m["data/wait_s"] / (m["data/wait_s"] + m["data/loader_s"] + m["data/step_s"])
    )


def report(slot: int, requests: int, seconds: float, skipped: int, **stages: float) -> dict:
    """A worker's report as it rides on a batch: counts cumulative this epoch, stage seconds
    since the slot's last batch."""
    counts = {"requests": requests, "bytes": 10 * requests, "seconds": seconds}
    return {
        "slot": slot,
        "skips": {"skipped": {"bad_image": skipped}, "requests": {"data": counts}},
        "timing": {"pid": 1, "slot": slot, "seconds": stages},
    }


def test_the_workers_figures_add_increments_and_count_cumulative_figures_once():
    meter = DataMeter(wdsvlm.Telemetry(hang_after_s=0), 2)
    list(meter.timed(iter(()), 0))  # an iteration starts: the workers count afresh
    meter.arrived(report(0, 3, 0.3, 1, map=1.0))
    meter.arrived(report(1, 2, 0.2, 0, map=2.0))
    meter.arrived(report(0, 5, 0.5, 1, map=1.0, read=0.5))  # slot 0: 2 requests more
    first = meter.metrics()
    assert first["data/map_s"] == 4.0 and first["data/read_s"] == 0.5
    assert first["data/requests"] == 7 and first["data/bytes_read"] == 70
    assert first["data/store_s"] == pytest.approx(0.7)
    assert first["data/skipped"] == 1 and first["data/skipped/bad_image"] == 1
    # a restarted Ray actor's figures that went down count from zero
    meter.arrived(report(1, 1, 0.1, 0))
    # the next epoch: each slot's counts start again, lower or not
    list(meter.timed(iter(()), 0))
    meter.arrived(report(0, 6, 0.6, 2))
    second = meter.metrics()
    assert second["data/requests"] == 7 and second["data/store_s"] == pytest.approx(0.7)
    assert second["data/skipped/bad_image"] == 2 and second["data/map_s"] == 0


# ---- advice ------------------------------------------------------------------------------


def staged(waiting: float, **stages: float) -> dict[str, float]:
    """Figures of 200 steps of 0.1 s each that waited ``waiting`` of the time."""
    wall = 20.0
    figures = {
        "data/steps": 200.0,
        "data/wait_s": waiting * wall,
        "data/loader_s": 0.01 * wall,
        "data/step_s": (0.99 - waiting) * wall,
        "data/wait_fraction": waiting,
    }
    figures.update({f"data/{stage}_s": 0.0 for stage in STAGES})
    figures.update({f"data/{stage}_s": s for stage, s in stages.items()})
    return figures


def test_a_slow_store_is_named_with_read_ahead_and_the_cache():
    figures = staged(0.4, read_wait=50.0, read=5.0, tokenize=5.0, decode_image=10.0)
    text = diagnose(figures, 4, figures["data/wait_fraction"])
    assert text.startswith("waited 40% of the last 200 steps; the workers spent 71% waiting")
    assert "store" in text and "read_ahead" in text and "cache_dir" in text


def test_slow_decoding_asks_for_workers_or_fewer_frames():
    figures = staged(0.38, decode_video=71.0, read=9.0, tokenize=10.0, collate=10.0)
    text = diagnose(figures, 4, figures["data/wait_fraction"])
    assert text == (
        "waited 38% of the last 200 steps; the workers spent 71% decoding video: "
        "num_workers 4 -> 8, or decode fewer frames (fps, max_frames) or smaller ones"
    )


def test_a_fast_pipeline_gets_no_advice():
    figures = staged(0.02, decode_image=70.0, read=30.0)
    assert diagnose(figures, 4, figures["data/wait_fraction"]) is None


def test_other_cases_of_advice():
    figures = staged(0.5, map=80.0, read=20.0)
    no_workers = diagnose(figures, 0, 0.5)
    assert "pipeline runs in the training process (num_workers=0)" in no_workers
    assert "80% in your map= function" in no_workers
    # bench: no model step, judged by the stages' shares alone
    assert diagnose(figures, 2, None) == (
        "the workers spent 80% in your map= function: make map= cheaper, or num_workers 2 -> 4"
    )
    own = dict(figures, **{"data/loader_s": 8.0, "data/wait_s": 1.0, "data/step_s": 11.0})
    assert "the Loader's own work in the training process took 40%" in diagnose(own, 2, 0.05)
    assert "telemetry off" in diagnose(staged(0.5), 2, 0.5)


def test_a_run_that_waits_logs_one_line_of_advice(caplog):
    setting = wdsvlm.Telemetry(window=3, advice_wait=0.2)
    data_loader = loader(map=sleepy, num_workers=0, batches_per_epoch=6, telemetry=setting)
    with caplog.at_level(logging.WARNING, logger="wdsvlm.loader"):
        train(data_loader, step=0.0)
    advice = [r.getMessage() for r in caplog.records if "waited" in r.getMessage()]
    assert len(advice) == 1, advice  # two windows, the same advice: said once
    assert re.match(
        r"waited \d+% of the last 3 steps; the pipeline runs in the training", advice[0]
    )
    assert "in your map= function" in advice[0]


def test_the_workers_start_is_counted_but_not_weighed_by_the_advice(caplog):
    import torch

    def batches():
        time.sleep(0.3)  # the workers start
        for _ in range(8):
            yield {"labels": torch.zeros(1, 4), "attention_mask": torch.ones(1, 4)}

    meter = DataMeter(wdsvlm.Telemetry(window=4, hang_after_s=0), 2)
    meter.prepare(types.SimpleNamespace())
    with caplog.at_level(logging.WARNING, logger="wdsvlm.loader"):
        for batch in meter.timed(batches(), 0):
            meter.handed(batch, 1, 4)
            time.sleep(0.02)  # the model's step
    assert not caplog.records  # steady, the steps did not wait
    m = meter.metrics()
    assert m["data/wait_max_s"] >= 0.3 and m["data/wait_fraction"] > 0.5


# ---- hangs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "workers", [0, pytest.param(2, marks=[pytest.mark.processes, pytest.mark.timeout(120)])]
)
def test_a_step_held_up_names_the_worker_and_its_stage(workers, caplog):
    _SLEPT.clear()
    setting = wdsvlm.Telemetry(hang_after_s=0.5)
    data_loader = loader(
        map=stuck_once, num_workers=workers, batches_per_epoch=2, telemetry=setting
    )
    with caplog.at_level(logging.WARNING, logger="wdsvlm.loader"):
        next(iter(data_loader))
    board = data_loader._meter.board.path
    data_loader.close()
    told = [r.getMessage() for r in caplog.records if "has been waited for" in r.getMessage()]
    assert told, caplog.text
    # told again every hang_after_s while it waits
    assert len(told) >= 3
    holder = "the training process (num_workers=0)" if not workers else "worker slot 0"
    waited = [
        float(re.match(r"batch 0 of the epoch has been waited for (\d+\.\d) s", t)[1]) for t in told
    ]
    assert 0.5 <= waited[0] and all(
        b - a >= 0.45 for a, b in zip(waited, waited[1:], strict=False)
    ), told
    assert all(
        re.search(f"it comes from {re.escape(holder)}\\. {re.escape(holder)}[ :]", t) for t in told
    )
    # the stage it is in, with how long (workers: once started, which takes a while)
    stuck = [re.search(r"\(pid \d+\): in map for (\d+\.\d) s", t) for t in told]
    seconds = [float(m.group(1)) for m in stuck if m]
    assert seconds and 0 < seconds[0] <= 3.5 and seconds == sorted(seconds), told
    assert not os.path.exists(board)  # the board goes with the loader's close
    assert not [t for t in threading.enumerate() if t.name == "wdsvlm-watchdog"]


def test_the_board_goes_with_the_loader_and_telemetry_off_has_none():
    data_loader = loader(num_workers=0, batches_per_epoch=2)
    list(data_loader)
    board = data_loader._meter.board.path
    assert os.path.exists(board)
    del data_loader
    gc.collect()
    assert not os.path.exists(board)
    off = loader(num_workers=0, batches_per_epoch=2, telemetry=False)
    list(off)
    assert off._meter.board is None and off.stream.board is None and not off.stream.telemetry


def test_a_node_folder_that_cannot_hold_the_board_falls_back_to_the_temporary_folder(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    meter = DataMeter(wdsvlm.Telemetry(), 2, folder=str(blocked / "node"))
    stream = types.SimpleNamespace()
    meter.prepare(stream)
    assert stream.board is meter.board and stream.telemetry and stream.trace_batches == 0
    assert os.path.dirname(meter.board.path) == tempfile.gettempdir()
    meter.board.enter(1, "decode_video")
    (_, never, pid0), (stage, seconds, pid) = meter.board.read()
    assert stage == "decode_video" and 0 <= seconds < 1 and pid == os.getpid() and pid0 == 0
    path = meter.board.path
    meter.close()
    assert not os.path.exists(path)


def test_a_board_left_by_a_killed_training_process_is_removed_by_the_next(tmp_path):
    from wdsvlm.loader.watchdog import StatusBoard

    gone = 2**22 + 1  # over the largest pid_max Linux allows: no such process
    left = tmp_path / f"status-{gone}-abc.board"
    left.write_bytes(b"")
    recent = tmp_path / f"status-{gone}-def.board"  # another pid namespace's, in use
    recent.write_bytes(b"")
    os.utime(left, (time.time() - 7200, time.time() - 7200))
    alive = tmp_path / f"status-{os.getpid()}-abc.board"
    alive.write_bytes(b"")
    board = StatusBoard.create(str(tmp_path), 1)
    assert not left.exists() and recent.exists() and alive.exists()
    assert os.path.exists(board.path)
    board.remove()


def test_the_wait_percentiles_are_nearest_rank():
    from wdsvlm.loader.figures import quantile

    assert quantile([0.3, 0.1], 0.95) == 0.3  # the 95th of two waits is the longer one
    assert quantile([0.3, 0.1], 0.50) == 0.1
    waits = [float(n) for n in range(20, 0, -1)]
    assert (quantile(waits, 0.50), quantile(waits, 0.95)) == (10.0, 19.0)
    assert quantile([], 0.5) == 0.0
