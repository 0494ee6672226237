"""The request governor (storage/governor.py, storage/retry.py): throttling answers of real
servers on 127.0.0.1 (the range server's throttling modes, a throttling proxy in front of
moto) are told from faults, waited out as the store asks, and lower the node's request rate,
which the node's processes share with its cap."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

import fsspec
import pytest

from wdsvlm.errors import StorageError
from wdsvlm.storage import governor
from wdsvlm.storage.fs import ReadPolicy, RequestCounts, read_range
from wdsvlm.storage.retry import is_throttling, is_transient, retry_after
from wdsvlm.testing.stores import RangeServer, Throttle, ThrottlingProxy, range_server, serving

from .conftest import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import bench_throttle  # noqa: E402  (one pass of several rank processes over a store)


@pytest.fixture
def blob(tmp_path):
    data = os.urandom(256 * 1024)
    (tmp_path / "blob").write_bytes(data)
    return str(tmp_path), data


def answer_of(url: str) -> Exception:
    fs = fsspec.filesystem("http", skip_instance_cache=True)
    with pytest.raises(Exception) as caught:
        fs.cat_file(url, start=0, end=10)
    return caught.value


class _Down(RangeServer):
    """Every GET answers a bare 503: a store that is down, not one that throttles."""

    def __init__(self, folder):
        super().__init__(folder)
        self.RequestHandlerClass = type(
            "Down", (self.RequestHandlerClass,), {"do_GET": lambda h: h.send_error(503)}
        )


def test_throttling_answers_are_told_from_faults_and_their_retry_after_read(blob):
    folder, _ = blob
    with range_server(folder, throttle=Throttle(0, "s3")) as server:
        slow_down = answer_of(f"{server.url}/blob")
    with range_server(folder, throttle=Throttle(0, "hub", retry_after=3)) as server:
        too_many = answer_of(f"{server.url}/blob")
    with serving(_Down(folder)) as server:
        down = answer_of(f"{server.url}/blob")
    assert is_throttling(slow_down) and retry_after(slow_down) is None
    assert is_throttling(too_many) and retry_after(too_many) == 3
    assert not is_throttling(down) and is_transient(down)


def test_s3_slow_down_through_s3fs_is_throttling_after_s3fs_own_tries(s3_bucket, moto_server):
    import s3fs

    bucket, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    fs.pipe(f"{bucket}/blob", b"x" * 100)
    throttle = Throttle(0, "s3")
    with serving(ThrottlingProxy(moto_server.split("://")[1], throttle)) as proxy:
        through = s3fs.S3FileSystem(
            client_kwargs={"endpoint_url": proxy.endpoint},
            # botocore's own retries off, so that the answers counted here are s3fs's alone
            config_kwargs={"retries": {"max_attempts": 1}},
            skip_instance_cache=True,
        )
        with pytest.raises(OSError) as caught:
            through.cat_file(f"{bucket}/blob", start=0, end=10)
    assert is_throttling(caught.value) and is_transient(caught.value)
    # s3fs asks again itself on SlowDown (S3FileSystem.retries tries, 10 answers for this
    # one read) before wdsvlm sees it
    assert throttle.throttled >= s3fs.S3FileSystem.retries


def test_a_retry_after_is_waited_out_before_asking_again(blob, tmp_path):
    folder, data = blob
    throttle = Throttle(8, "hub", retry_after=1)
    policy = ReadPolicy(block_bytes=8192, node_dir=str(tmp_path / "node"))
    counts = RequestCounts()
    with range_server(folder, throttle=throttle) as server:
        assert (
            read_range(f"{server.url}/blob", 0, 24 * 8192, policy=policy, counts=counts)
            == (data[: 24 * 8192])
        )
    waits = [
        later[0] - at
        for (at, admitted), later in zip(throttle.answers, throttle.answers[1:], strict=False)
        if not admitted
    ]
    assert waits and min(waits) >= 1.0, waits  # one reader: the next answer is its retry
    assert counts.throttled == throttle.throttled == len(waits)


def test_nothing_is_paced_or_written_until_a_store_throttles_or_a_cap_is_set(blob, tmp_path):
    folder, data = blob
    policy = ReadPolicy(block_bytes=4096, node_dir=str(tmp_path / "node"))
    with range_server(folder) as server:
        started = time.monotonic()
        assert read_range(f"{server.url}/blob", 0, None, policy=policy) == data
        assert read_range(f"{server.url}/blob", 0, 64 * 4096, policy=policy) == data[: 64 * 4096]
    assert time.monotonic() - started < 5
    assert not (tmp_path / "node").exists()


def test_throttle_retries_do_not_use_up_the_fault_attempts(blob, tmp_path):
    folder, data = blob
    throttle = Throttle(10, "s3")
    policy = ReadPolicy(block_bytes=4096, attempts=1, node_dir=str(tmp_path / "node"))
    counts = RequestCounts()
    with range_server(folder, throttle=throttle) as server:
        got = read_range(f"{server.url}/blob", 0, 32 * 4096, policy=policy, counts=counts)
    assert got == data[: 32 * 4096]
    assert counts.throttled == throttle.throttled > 0 and counts.retries == 0
    assert counts.requests == 32 + counts.throttled


def test_a_request_throttled_past_throttle_wait_fails_within_it_naming_url_byte_and_time(
    blob, tmp_path
):
    folder, _ = blob
    policy = ReadPolicy(throttle_wait=2.5, node_dir=str(tmp_path / "node"))
    with range_server(folder, throttle=Throttle(0, "hub", retry_after=1)) as server:
        started = time.monotonic()
        with pytest.raises(
            StorageError, match=r"/blob: throttled for ([\d.]+) s at byte 4096 "
        ) as e:
            read_range(f"{server.url}/blob", 4096, 8192, policy=policy)
    # the node's pacing counts in throttle_wait: no turn taken past it
    assert float(e.value.args[0].split("throttled for ")[1].split()[0]) <= 2.5
    assert time.monotonic() - started < 2.5 + 0.4


def _paced(node: governor.Governor, store: str, seconds: float, every: float = 0.0) -> float:
    """Requests to ``store`` in their turns (at least ``every`` s apart) for ``seconds``: the
    store's rate after them."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        time.sleep(max(every, node.turn(store, None)))
    return node.rate(store)


def _limit_found(tmp_path) -> tuple[governor.Governor, str, float]:
    """A node that sent 40 requests at once, was throttled (20/s, then x1.5 a second), and
    throttled again: the limit found. The node, its store and the rate throttled the second
    time."""
    node = governor.Governor(str(tmp_path))
    store = "http://127.0.0.1:1"
    for _ in range(40):
        node.turn(store, None)
    node.throttled(store)
    found = _paced(node, store, 1.2)
    node.throttled(store)
    return node, store, found


def test_the_rate_is_halved_on_throttling_and_grows_back(tmp_path):
    node = governor.Governor(str(tmp_path))
    store = "http://127.0.0.1:1"
    assert all(node.turn(store, None) == 0 for _ in range(40))  # ungoverned: at once
    node.throttled(store)
    assert node.rate(store) == 20  # half the 40 requests of the last second
    node.throttled(store)
    assert node.rate(store) == 20  # the answers to requests already sent: no second cut
    found = _paced(node, store, 2.3)  # the node's limit unknown: half as much again each second
    assert found in (30, 45, 67.5)
    node.throttled(store)  # the limit found: back to the last rate taken, the ceiling remembered
    assert node.rate(store) == pytest.approx(found / 1.5)
    time.sleep(governor.WINDOW)
    grown = _paced(node, store, 2.3)
    assert found / 1.5 < grown <= 0.9 * found  # back toward 0.9 x the rate that was throttled
    node.throttled(store)  # below the ceiling: bunched requests, a quarter off
    assert node.rate(store) == 0.75 * grown


def test_a_probe_that_finds_the_limit_goes_back_a_tenth_under_the_last_rate_taken(tmp_path):
    node, store, found = _limit_found(tmp_path)
    time.sleep(governor.WINDOW)
    rates, until = [node.rate(store)], time.monotonic() + 15
    while rates[-1] < found and time.monotonic() < until:  # 0.9 x ceiling, held, then probing
        rate = _paced(node, store, 0.5)
        if rate != rates[-1]:
            rates.append(rate)
    assert rates[-1] >= found, "the rate did not probe above the ceiling"
    node.throttled(store)
    # 0.9 x the probe's rate before its last step (was: half the rate throttled)
    assert node.rate(store) == pytest.approx(0.9 * rates[-2])


def test_the_rate_does_not_grow_while_the_node_sends_well_under_it(tmp_path):
    node, store, _ = _limit_found(tmp_path)
    time.sleep(governor.WINDOW)
    rate = node.rate(store)
    # 0.65 of the rate allowed (the readers' own pace) for 3 s
    assert _paced(node, store, 3.2, every=1 / (0.65 * rate)) == rate  # was: grown


def _read_in_turn(url: str, node_dir: str, cap: float) -> None:
    policy = ReadPolicy(block_bytes=1024, requests_per_second=cap, node_dir=node_dir)
    read_range(url, 0, 40 * 1024, policy=policy)


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_a_node_cap_holds_for_processes_forked_and_spawned_together(blob, tmp_path):
    folder, _ = blob
    cap = 30.0
    counted = Throttle(10**9)  # throttles nothing: times every answer
    with range_server(folder, throttle=counted) as server:
        args = (f"{server.url}/blob", str(tmp_path / "node"), cap)
        procs = [
            multiprocessing.get_context(method).Process(target=_read_in_turn, args=args)
            for method in ("fork", "spawn", "forkserver")
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0, f"{p} did not finish in time or failed"
    times = [at for at, _ in counted.answers]
    assert len(times) == 3 * 40
    busiest = max(sum(1 for t in times if a <= t < a + 1.0) for a in times)
    assert busiest <= cap + 1, busiest
    assert len(times) / (times[-1] - times[0]) >= 0.8 * cap


def test_the_budget_lies_in_the_node_folder_the_table_copy_uses_by_default():
    from wdsvlm.storage.folders import node_folder

    assert governor.governor_of(None).path == os.path.join(node_folder(), governor.FILE)


def test_the_default_budget_follows_wdsvlm_local_dir(tmp_path, monkeypatch):
    first = governor.governor_of(None)
    monkeypatch.setenv("WDSVLM_LOCAL_DIR", str(tmp_path / "other"))
    assert governor.governor_of(None).path == str(tmp_path / "other" / governor.FILE)
    assert governor.governor_of(None) is not first


def test_the_stagger_spreads_a_large_jobs_ranks_and_leaves_small_jobs_alone():
    assert {governor.start_delay(rank, 64) for rank in range(64)} == {0.0}
    delays = [governor.start_delay(rank, 1024) for rank in range(1024)]
    assert delays == sorted(delays) and max(delays) <= 15
    per_second = [sum(1 for d in delays if s <= d < s + 1) for s in range(16)]
    assert max(per_second) <= 100, per_second
    assert governor.start_delay(999, 100_000) <= 15


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_four_ranks_of_two_workers_through_a_throttling_store_give_the_unthrottled_batches():
    example = os.path.join(REPO, "shards_example")
    with range_server(example) as server:
        unthrottled = bench_throttle.run_pass(server.url, ranks=4, workers=2, block=1 << 20)
    throttle = Throttle(20, "s3")
    with range_server(example, throttle=throttle) as server:
        throttled = bench_throttle.run_pass(server.url, ranks=4, workers=2, block=256 * 1024)
    assert throttle.throttled > 0  # the store did throttle the pass
    assert throttled == unthrottled and all(unthrottled)
