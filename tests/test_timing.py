"""Each stage's seconds, timed in the workers and carried with the batches
(``pipeline.timing.StageClock``, the ``"timing"`` of each batch's report), and the store's
requests with their seconds: the clock's own rules on a clock of the test's, then the figures
of real Loaders against costs injected with known durations (a ``map=`` that sleeps 20 ms a
sample; a store that answers 50 ms late), with no worker, two DataLoader workers and Ray
workers. The Ray side runs as ``python -m tests.test_timing ray WORKDIR LIMIT``."""

from __future__ import annotations

import copy
import functools
import os
import pickle
import struct
import time

import pytest

import wdsvlm
from wdsvlm.loader.ray_workers import carried_over
from wdsvlm.pipeline import timing
from wdsvlm.pipeline.timing import STAGES, StageClock, stretch
from wdsvlm.storage.fs import RequestCounts
from wdsvlm.testing.stores import range_server

from .conftest import EXAMPLE

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SETTINGS = {
    "max_length": 256,
    "batch_size": 2,
    "tile_size": 32,
    "max_image_side": 64,
    "tokens_per_tile": 4,
    "shuffle_buffer": 12,
    "pack_window": 10,
    "seed": 3,
    "read_ahead": 0,  # no read runs past the epoch's last batch: the request counts are exact
}
MAP_SLEEP, STORE_DELAY = 0.020, 0.050


class FakeTime:
    """A clock that moves only when the test's work says so."""

    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def work(self, seconds: float) -> None:
        self.t += seconds


class Board:
    def __init__(self):
        self.entered: list[tuple[int, str]] = []

    def enter(self, slot: int, stage: str) -> None:
        self.entered.append((slot, stage))


@pytest.fixture
def fake(monkeypatch):
    now = FakeTime()
    monkeypatch.setattr(timing, "_now", now)
    return now


def chain(clock: StageClock, now: FakeTime, items: int):
    """read (3 s an item) -> tokenize (2 s, of which 1 s in map) -> a consumer that decodes
    (4 s) inside collate (0.5 s) each item."""

    def read():
        for i in range(items):
            now.work(3)
            yield i

    def tokenize(samples):
        for sample in samples:
            now.work(1)
            with clock.stage("map"):
                now.work(1)
            yield sample

    def batches(samples):
        for sample in samples:
            now.work(0.5)
            with clock.stage("decode_image"):
                now.work(4)
            yield sample

    return clock.timed(
        "collate", batches(clock.timed("tokenize", tokenize(clock.timed("read", read()))))
    )


def test_each_stage_is_charged_its_own_seconds_and_every_second_once(fake):
    clock = StageClock()
    start = fake.t
    assert list(chain(clock, fake, 3)) == [0, 1, 2]
    seconds = clock.take()["seconds"]
    assert seconds == {"read": 9, "tokenize": 3, "map": 3, "decode_image": 12, "collate": 1.5}
    assert sum(seconds.values()) == fake.t - start == clock.charged


def test_take_gives_the_seconds_since_the_last_take(fake):
    clock = StageClock()
    items = chain(clock, fake, 3)
    next(items)
    first = clock.take()
    next(items)
    next(items)
    second = clock.take()
    assert first == {
        "seconds": {"read": 3, "tokenize": 1, "map": 1, "decode_image": 4, "collate": 0.5}
    }
    assert second["seconds"]["read"] == 6 and second["seconds"]["decode_image"] == 8
    assert clock.take() == {"seconds": {}}  # nothing since
    with clock.stage("read_wait"):
        fake.work(2)
    assert clock.take() == {"seconds": {"read_wait": 2}}


def test_spans_are_kept_for_the_batches_of_a_trace_only(fake):
    assert "spans" not in StageClock().take()
    clock = StageClock(trace=2)
    items = chain(clock, fake, 3)
    takes = []
    for _ in items:
        takes.append(clock.take())
    assert [("spans" in t) for t in takes] == [True, True, False]
    spans = takes[0]["spans"]
    # innermost first, as each stretch ends; each within its caller's
    assert [name for name, _, _ in spans] == ["read", "map", "tokenize", "decode_image", "collate"]
    assert spans[0] == ("read", 100.0, 103.0) and spans[-1] == ("collate", 100.0, 109.5)
    assert [s[0] for s in takes[1]["spans"]][0] == "read"
    with pytest.raises(ValueError):
        StageClock(trace=-1)


def test_the_board_is_told_each_stage_entered_and_idle_after(fake):
    board = Board()
    clock = StageClock(board, slot=3)
    list(clock.timed("read", iter([1])))
    with clock.stage("decode_image"):
        with clock.stage("image_map"):
            pass
    assert board.entered == [
        (3, "read"),  # the item
        (3, "idle"),
        (3, "read"),  # the end of the items
        (3, "idle"),
        (3, "decode_image"),
        (3, "image_map"),
        (3, "decode_image"),  # back in the stage it was called from
        (3, "idle"),
    ]


def test_an_exception_in_a_stage_still_charges_it(fake):
    clock = StageClock()

    def failing():
        fake.work(2)
        raise KeyError("x")
        yield

    with pytest.raises(KeyError):
        with clock.stage("collate"):
            fake.work(1)
            next(clock.timed("read", failing()))
    assert clock.take()["seconds"] == {"read": 2, "collate": 1}
    assert clock._stack == [] and clock._open == []


def test_stage_names_are_the_stages_and_a_clock_sent_elsewhere_starts_afresh():
    clock = StageClock(Board(), slot=1, trace=3)
    with pytest.raises(ValueError):
        clock.stage("decode")
    with pytest.raises(ValueError):
        next(clock.timed("nope", iter([1])))
    with clock.stage("read"):
        pass
    copied = pickle.loads(pickle.dumps(clock))
    assert copied.board is None and copied.spans is None and not any(copied.seconds.values())
    with stretch(None, "read"):  # a stage used alone has no clock: nothing happens
        pass
    assert stretch(clock, "read") is clock.stage("read")


def test_request_counts_carry_seconds_and_cache_hits_and_pickle_whole():
    counts = RequestCounts(requests=2, bytes=10)
    counts.add(seconds=0.25, cache_hits=3)
    assert counts.as_dict() == {"requests": 2, "bytes": 10, "throttled": 0, "retries": 0}
    assert counts.figures() == {**counts.as_dict(), "cache_hits": 3, "seconds": 0.25}
    assert pickle.loads(pickle.dumps(counts)).figures() == counts.figures()
    with pytest.raises(ValueError):
        counts.add(waits=1)


def test_a_restarted_ray_workers_timing_is_its_own_and_its_request_seconds_add_up():
    """The report of a restarted actor's stream counts its requests from its start (added to
    its predecessor's), but its timing is already the increment since its last batch."""
    before = {
        "slot": 1,
        "skips": {"requests": {"coco": {"requests": 3, "seconds": 0.5, "cache_hits": 1}}},
        "timing": {"pid": 10, "slot": 1, "seconds": {"read": 2.0, "map": 1.0}},
    }
    after = {
        "slot": 1,
        "skips": {"requests": {"coco": {"requests": 2, "seconds": 0.25, "cache_hits": 0}}},
        "timing": {"pid": 11, "slot": 1, "seconds": {"read": 0.5}},
    }
    out = carried_over(before, after)
    assert out["timing"] == after["timing"]
    assert out["skips"]["requests"]["coco"] == {"requests": 5, "seconds": 0.75, "cache_hits": 1}
    del after["timing"]
    assert "timing" not in carried_over(before, after)


def sleepy(calls: str, sample: dict, rng) -> dict:
    """A map= of a known cost: 20 ms a sample; each call adds how long it slept to ``calls``
    (a busy machine wakes a sleeper late: what it took is the truth)."""
    start = time.perf_counter()
    time.sleep(MAP_SLEEP)
    with open(calls, "ab") as f:
        f.write(struct.pack("d", time.perf_counter() - start))
    return sample


def calls_in(path: str) -> list[float]:
    """The seconds of each call of ``sleepy`` that wrote to ``path``."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        data = f.read()
    return list(struct.unpack(f"{len(data) // 8}d", data))


def recording(loader: wdsvlm.Loader) -> list[dict]:
    """The workers' report of each batch, as the Loader gets it."""
    reports: list[dict] = []
    arrived = loader._meter.arrived

    def record(report):
        reports.append(copy.deepcopy(report))
        return arrived(report)

    loader._meter.arrived = record
    return reports


def stage_seconds(reports: list[dict]) -> dict[str, float]:
    total = dict.fromkeys(STAGES, 0.0)
    for report in reports:
        for stage, seconds in report["timing"]["seconds"].items():
            total[stage] += seconds
    return total


def mapped_epoch(data: str, calls: str, **options) -> tuple[list[dict], list[float], float]:
    """One epoch with the sleepy map: the reports, the map's calls while it ran, the wall
    time of its iteration."""
    loader = wdsvlm.Loader(
        data, TOKENIZER, map=functools.partial(sleepy, calls), **{**SETTINGS, **options}
    )
    reports = recording(loader)
    len(loader)  # sized before the calls are counted
    before, start = len(calls_in(calls)), time.perf_counter()
    batches = sum(1 for _ in loader)
    elapsed = time.perf_counter() - start
    assert batches == len(reports) > 0
    return reports, calls_in(calls)[before:], elapsed


def check_map_seconds(reports: list[dict], calls: list[float]) -> dict[str, float]:
    """The map's seconds over the reports: at least 20 ms a call, and within 10% of what the
    calls took by their own clock."""
    seconds = stage_seconds(reports)
    assert len(calls) > 10 and min(calls) >= MAP_SLEEP
    truth = sum(calls)
    assert truth <= seconds["map"] <= 1.1 * truth, (seconds["map"], truth, MAP_SLEEP * len(calls))
    assert all(set(r["timing"]["seconds"]) <= set(STAGES) for r in reports)
    return seconds


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A folder of datasets: ``coco`` (24 samples in 4 shards)."""
    from .test_request_stats import write

    tmp = str(tmp_path_factory.mktemp("timing"))
    write(tmp, "coco", 24, 6)
    return os.path.join(tmp, "store")


def mirrored(pixels, rng):
    return pixels[:, ::-1]


def test_the_map_seconds_without_workers_are_the_maps_sleeps(store, tmp_path):
    """No worker: each batch's report carries this process's stage seconds since the batch
    before; the map's add up to what its calls took (and no more than 10% above), and all
    stages together to no more than the iteration's wall time, most of it; an image_map's
    seconds are its own, apart from the decoding that calls it."""
    reports, calls, elapsed = mapped_epoch(
        f"{store}/coco", str(tmp_path / "calls"), image_map=mirrored
    )
    seconds = check_map_seconds(reports, calls)
    assert {r["timing"]["pid"] for r in reports} == {os.getpid()}
    assert {r["timing"]["slot"] for r in reports} == {0}
    assert 0.8 * elapsed <= sum(seconds.values()) <= elapsed
    assert all(seconds[s] > 0 for s in ("read", "tokenize", "decode_image", "image_map", "collate"))


@pytest.mark.processes
def test_the_map_seconds_of_two_workers_are_the_maps_sleeps(store, tmp_path):
    """Two DataLoader workers: each batch's report names its worker's process and slot; over
    the epoch the map's seconds add up to 20 ms a call in either worker."""
    reports, calls, _ = mapped_epoch(f"{store}/coco", str(tmp_path / "calls"), num_workers=2)
    check_map_seconds(reports, calls)
    pids = {r["timing"]["slot"]: r["timing"]["pid"] for r in reports}
    assert (
        sorted(pids) == [0, 1] and len(set(pids.values())) == 2 and os.getpid() not in pids.values()
    )


def test_telemetry_off_ships_no_timing(store):
    loader = wdsvlm.Loader(f"{store}/coco", TOKENIZER, telemetry=False, **SETTINGS)
    reports = recording(loader)
    assert sum(1 for _ in loader) == len(reports) > 0
    assert not any("timing" in r for r in reports)
    assert loader.stream.collate.clock is None and loader.stream.read.clock is None


def store_epoch(store: str, delay: float, **options) -> tuple[list[dict], dict, int]:
    """One epoch from the range server answering ``delay`` late: the reports, what the server
    counted of the dataset's files, and its ranged requests (those it delays)."""
    from .test_request_stats import served, snapshot

    with range_server(store, delay=delay) as server:
        loader = wdsvlm.Loader(f"{server.url}/coco", TOKENIZER, **{**SETTINGS, **options})
        reports = recording(loader)
        before, ranged = snapshot(server), server.requests
        assert sum(1 for _ in loader) == len(reports) > 0
        return reports, served(server, before, "coco"), server.requests - ranged


def test_a_late_stores_requests_are_counted_as_it_counts_them_with_their_seconds(store):
    """A store that answers each ranged request 50 ms late: the requests the reports count
    are the store's own, and their seconds add up to 50 ms each, within 10% (beyond what the
    same requests take from a store that answers at once: the client's and server's own
    time, which a busy machine stretches); the worker waited on the store that long."""
    reports, expected, ranged = store_epoch(store, STORE_DELAY)
    requests = reports[-1]["skips"]["requests"]["coco"]  # counted since the epoch began
    assert {k: requests[k] for k in RequestCounts.COUNTS} == expected
    assert ranged > 5 and requests["cache_hits"] == 0
    at_once = store_epoch(store, 0.0)[0][-1]["skips"]["requests"]["coco"]
    assert at_once["requests"] == requests["requests"]
    truth = STORE_DELAY * ranged
    assert truth <= requests["seconds"] <= 1.1 * truth + at_once["seconds"], (
        requests["seconds"],
        truth,
        at_once["seconds"],
    )
    assert stage_seconds(reports)["read_wait"] >= requests["seconds"]  # read inline (read_ahead 0)


def test_with_reads_ahead_the_wait_for_the_store_is_read_wait_not_read(store):
    """Four reads at once ahead of the worker: what it still waits for the late store is
    ``read_wait``; cutting the samples out of the bytes (``read``) is a small part of it."""
    reports = store_epoch(store, STORE_DELAY, read_ahead=4)[0]
    seconds = stage_seconds(reports)
    assert seconds["read_wait"] >= STORE_DELAY and seconds["read"] < seconds["read_wait"]


def test_video_decoding_is_charged_as_decode_video(tmp_path):
    from wdsvlm.testing.qwen import qwen_processor
    from wdsvlm.testing.videos import SPECS, make_video

    from .conftest import write_jsonl

    (tmp_path / "v.mp4").write_bytes(make_video(SPECS[0]))
    turn = [{"from": "human", "value": "<video> moves?"}, {"from": "gpt", "value": "A bar."}]
    records = [{"id": f"v{i}", "video": "v.mp4", "conversations": turn} for i in range(4)]
    data = str(tmp_path / "out")
    wdsvlm.write_dataset(write_jsonl(str(tmp_path / "in.jsonl"), records), data, progress=False)
    settings = {"max_length": 1024, "batch_size": 2, "shuffle_buffer": 4, "pack_window": 8}
    loader = wdsvlm.Loader(data, processor=qwen_processor("qwen2_5_vl"), **settings)
    reports = recording(loader)
    assert sum(1 for _ in loader) == len(reports) > 0
    seconds = stage_seconds(reports)
    assert seconds["decode_video"] > 0 and seconds["decode_image"] == 0


# Ray: a local Ray of 2 CPUs in a network namespace of its own (tests/test_ray.py's run_job)


@pytest.mark.processes
@pytest.mark.timeout(400)
def test_the_map_seconds_of_ray_workers_are_the_maps_sleeps(tmp_path):
    from .test_ray import run_job

    found = run_job(tmp_path, "ray", limit=300, module="tests.test_timing")
    reports = found["reports"]
    check_map_seconds(reports, found["calls"])
    assert sorted({r["timing"]["slot"] for r in reports}) == [0, 1]
    assert os.getpid() not in {r["timing"]["pid"] for r in reports}


def ray_case(work: str) -> dict:
    from .ray_job import ray_session
    from .test_request_stats import write

    data = write(work, "coco", 24, 6)
    calls = os.path.join(work, "calls")
    with ray_session(2):
        reports, n, _ = mapped_epoch(data, calls, num_workers=2, workers=wdsvlm.RayWorkers())
    return {"reports": reports, "calls": n}


if __name__ == "__main__":
    from .ray_job import run_case

    run_case({"ray": ray_case})
