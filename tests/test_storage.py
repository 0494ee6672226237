"""Object storage for real: datasets written to and streamed from a moto S3 server and the
GCS emulator (real server processes on 127.0.0.1), and network faults injected by a proxy
between the client and the S3 server."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import multiprocessing
import os
import random
import threading
import time

import aiohttp
import botocore.exceptions
import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem

import wdsvlm
from wdsvlm.errors import ObjectNotFoundError
from wdsvlm.pipeline.order import span
from wdsvlm.pipeline.read import ReadSamples
from wdsvlm.storage.fs import ReadPolicy, is_transient, read_range
from wdsvlm.testing.stores import RangeServer, range_server, serving

from .conftest import EXAMPLE, run_cli
from .faults import FaultProxy
from .test_ddp import digest

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {
    "max_length": 1024,
    "batch_size": 2,
    "tile_size": 64,
    "max_image_side": 128,
    "tokens_per_tile": 8,
    "shuffle_buffer": 50,
    "pack_window": 50,
}
QUICK = ReadPolicy(block_bytes=128 * 1024, attempts=8, backoff=0.01, max_backoff=0.1, timeout=0.5)


def batches_of(source, storage_options=None, **options) -> list[str]:
    loader = wdsvlm.Loader(
        source, TOKENIZER, storage_options=storage_options, **{**SMALL, **options}
    )
    return [digest(b) for b in loader]


def upload(folder: str, url: str, options: dict) -> None:
    fs, path = fsspec.core.url_to_fs(url, **options)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".tar") or name == "index.json":
            fs.put_file(os.path.join(folder, name), f"{path}/{name}")


def cli_write(inputs, image_root, output, options) -> None:
    command = ["write", "--input", inputs, "--image-root", image_root, "--output", output, "-q"]
    if options:
        command += ["--storage-options", json.dumps(options)]
    run = run_cli(*command)
    assert run.returncode == 0, run.stderr


@pytest.fixture(scope="module")
def local_batches():
    return batches_of(EXAMPLE)


@pytest.mark.processes
@pytest.mark.parametrize("store", ["s3_bucket", "gcs_bucket"])
def test_write_to_a_bucket_with_the_cli_and_stream_it_back_identical(
    llava_input, tmp_path, request, store
):
    path, root, _ = llava_input
    bucket, options = request.getfixturevalue(store)
    cli_write(path, root, str(tmp_path / "local"), None)
    cli_write(path, root, f"{bucket}/ds", options)
    remote = batches_of(f"{bucket}/ds", options, max_length=512, batch_size=2)
    assert remote == batches_of(str(tmp_path / "local"), max_length=512, batch_size=2)
    assert len(remote) > 0


def test_example_from_gcs_matches_local(gcs_bucket, local_batches):
    bucket, options = gcs_bucket
    upload(EXAMPLE, f"{bucket}/example", options)
    assert batches_of(f"{bucket}/example", options) == local_batches


@pytest.fixture
def proxied(s3_bucket, moto_server):
    """shards_example in a bucket, and storage options that reach it through a FaultProxy."""
    bucket, options = s3_bucket
    upload(EXAMPLE, f"{bucket}/example", options)
    proxy = FaultProxy(int(moto_server.rsplit(":", 1)[1]))
    through = {
        "client_kwargs": {"endpoint_url": proxy.endpoint},
        # botocore's own retries off: what reaches wdsvlm is what the network did
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    yield f"{bucket}/example", through, proxy
    proxy.close()


def resources() -> tuple[int, int, int]:
    return (
        len(os.listdir("/proc/self/fd")),
        sum(t.name != "fault-proxy" for t in threading.enumerate()),
        len(multiprocessing.active_children()),
    )


def test_batches_through_cuts_503s_and_stalls_are_identical_and_nothing_leaks(
    proxied, local_batches
):
    url, options, proxy = proxied
    assert batches_of(url, options, read_policy=QUICK) == local_batches  # warm: pools, loop
    before = resources()
    proxy.error, proxy.cut, proxy.stall = 0.15, 0.15, 0.05
    faulty = batches_of(url, options, read_policy=QUICK)
    assert proxy.faults >= 5, (proxy.faults, proxy.requests)
    assert faulty == local_batches
    proxy.faults_off()
    after = resources()
    assert after[1:] == before[1:]  # threads and processes
    # Descriptors: a stalled request is abandoned at its deadline, and its socket goes when
    # the peer lets go (here: the proxy closing) or the HTTP client's own timeout ends it.
    proxy.close()
    deadline = time.monotonic() + 10
    while resources()[0] > before[0] + 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert resources()[0] <= before[0] + 2, (before, resources())


def test_with_workers_and_faults_the_batches_are_identical(proxied, local_batches):
    url, options, proxy = proxied
    proxy.error, proxy.cut = 0.1, 0.1
    assert batches_of(url, options, read_policy=QUICK, num_workers=2) == batches_of(
        EXAMPLE, num_workers=2
    )
    assert proxy.faults > 0


def test_a_permanent_fault_names_the_url_within_the_configured_time(proxied):
    url, options, proxy = proxied
    policy = ReadPolicy(block_bytes=128 * 1024, attempts=3, backoff=0.05, timeout=0.5)
    loader = wdsvlm.Loader(url, TOKENIZER, storage_options=options, read_policy=policy, **SMALL)
    proxy.cut = 1.0  # every response breaks: retried, then given up
    started = time.monotonic()
    with pytest.raises(wdsvlm.StorageError, match=r"example/shapes-00000\d\.tar: gave up at byte"):
        list(loader)
    assert time.monotonic() - started < 10
    proxy.faults_off()
    proxy.stall = 1.0  # every response stalls: each try times out
    started = time.monotonic()
    with pytest.raises(wdsvlm.StorageError, match=r"gave up at byte \d+ after 3 attempts"):
        list(wdsvlm.Loader(url, TOKENIZER, storage_options=options, read_policy=policy, **SMALL))
    assert time.monotonic() - started < 10
    proxy.faults_off()
    proxy.status = 403  # refused: not retried at all
    started = time.monotonic()
    with pytest.raises(
        wdsvlm.StorageError, match=r"example/index\.json: cannot read from byte 0: PermissionError"
    ):
        wdsvlm.Loader(url, TOKENIZER, storage_options=options, read_policy=policy, **SMALL)
    assert time.monotonic() - started < 2


def test_a_missing_shard_fails_at_once_or_is_skipped_and_reported(s3_bucket):
    bucket, options = s3_bucket
    upload(EXAMPLE, f"{bucket}/example", options)
    loader = wdsvlm.Loader(f"{bucket}/example", TOKENIZER, storage_options=options, **SMALL)
    fs, path = fsspec.core.url_to_fs(bucket, **options)
    fs.rm_file(f"{path}/example/shapes-000001.tar")
    started = time.monotonic()
    with pytest.raises(ObjectNotFoundError, match=r"shapes-000001\.tar"):
        list(loader)
    assert time.monotonic() - started < 5  # no retries for a 404
    skipping = wdsvlm.Loader(
        f"{bucket}/example", TOKENIZER, storage_options=options, on_shard_error="skip", **SMALL
    )
    keys = [k for b in skipping for row in b["sample_keys"] for k in row]
    skipped = skipping.stats()["skipped"]
    index = wdsvlm.load_index(EXAMPLE)
    lost = next(s for s in index["shards"] if s["name"] == "shapes-000001.tar")["samples"]
    assert skipped["unreadable_shard"] >= lost  # each pass over it counts its samples
    assert not any(k.startswith("shapes-000001.tar/") for k in keys)
    assert len(set(keys)) == index["totals"]["samples"] - lost
    for name in os.listdir(EXAMPLE):  # nothing left to read: an error, not an endless spin
        if name.endswith(".tar") and name != "shapes-000001.tar":
            fs.rm_file(f"{path}/example/{name}")
    started = time.monotonic()
    with pytest.raises(wdsvlm.StorageError, match="a whole pass over global worker 0"):
        list(skipping)
    assert time.monotonic() - started < 10


def local_files_under(scheme: str, before_request) -> None:
    """Register ``scheme://``: local files, ``before_request(start, end)`` called before each
    request (it may raise, as a network or a bug would)."""

    class Local(LocalFileSystem):
        protocol = (scheme,)

        @classmethod
        def _strip_protocol(cls, path):
            return path.removeprefix(f"{scheme}://")

        def cat_file(self, path, start=None, end=None, **kwargs):
            before_request(start, end)
            return super().cat_file(path, start=start, end=end, **kwargs)

    fsspec.register_implementation(scheme, Local, clobber=True)


def test_read_range_resumes_where_a_read_broke(tmp_path):
    data = os.urandom(300_000)
    (tmp_path / "blob").write_bytes(data)
    calls = []

    def every_third_breaks(start, end):
        calls.append((start, end))
        if len(calls) % 3 == 2:
            raise ConnectionResetError("connection reset by peer")

    local_files_under("flaky", every_third_breaks)
    policy = ReadPolicy(block_bytes=50_000, attempts=3, backoff=0.001)
    got = read_range(f"flaky://{tmp_path}/blob", 10, 290_000, None, policy)
    assert got == data[10:290_000]
    starts = [s for s, _ in calls]
    assert starts[0] == 10 and starts == sorted(starts)  # never back to an earlier byte
    assert len(calls) > 6  # blocks, and the failed ones again


def test_errors_are_told_apart():
    assert not is_transient(FileNotFoundError("nope"))
    assert not is_transient(PermissionError("AccessDenied"))
    assert not is_transient(OSError("NoSuchBucket: the bucket does not exist"))
    assert is_transient(ConnectionResetError(104, "reset"))
    assert is_transient(TimeoutError())
    assert is_transient(OSError("An error occurred (ServiceUnavailable) 503"))
    # a URL is not an answer: a shard may be called data-000404.tar
    assert is_transient(ConnectionResetError("http://127.0.0.1:4040/b/data-000404.tar: reset"))

    class Answer(Exception):
        def __init__(self, status):
            super().__init__(f"status {status}")
            self.status = status

    assert is_transient(Answer(503)) and is_transient(Answer(429))
    assert not is_transient(Answer(404)) and not is_transient(Answer(403))
    # what s3fs makes of a 503 and of a 400; the network faults of its HTTP clients
    assert is_transient(OSError(errno.EBUSY, "SlowDown")) and is_transient(OSError(errno.EIO, "?"))
    assert not is_transient(OSError(errno.EINVAL, "InvalidRange"))
    assert is_transient(aiohttp.ClientPayloadError("cut short"))
    assert is_transient(aiohttp.ServerDisconnectedError())
    assert is_transient(botocore.exceptions.ReadTimeoutError(endpoint_url="http://s3"))
    # a bug is no network fault
    for bug in (TypeError("x"), KeyError("etag"), AttributeError("read"), ValueError("x")):
        assert not is_transient(bug)


def test_a_bug_under_a_read_surfaces_at_once_while_a_network_fault_is_retried(tmp_path):
    (tmp_path / "blob").write_bytes(b"x" * 1000)
    calls, raising = [], []

    def fails(start, end):
        calls.append(start)
        raise raising[0]

    local_files_under("failing", fails)
    url = f"failing://{tmp_path}/blob"
    policy = ReadPolicy(attempts=4, backoff=0.001)
    for bug in (TypeError("unsupported operand"), KeyError("ETag"), AttributeError("no read")):
        calls.clear()
        raising[:] = [bug]
        with pytest.raises(type(bug)):
            read_range(url, 0, 1000, None, policy)
        assert len(calls) == 1, f"{bug!r} was asked for again"
    # nor is a bug counted as an unreadable shard in skip mode: it is raised as it is
    calls.clear()
    raising[:] = [TypeError("unsupported operand")]
    entries = [{"key": "k", "offset": 0, "size": 1000}]
    read = ReadSamples(policy=policy, on_shard_error="skip", read_ahead=0)
    with pytest.raises(TypeError):
        list(read(iter([span(url, "blob", entries)])))
    assert len(calls) == 1
    calls.clear()
    raising[:] = [ConnectionResetError("connection reset by peer")]
    with pytest.raises(wdsvlm.StorageError, match="gave up at byte 0 after 4 attempts"):
        read_range(url, 0, 1000, None, policy)
    assert len(calls) == 4


def test_a_shared_shard_cache_serves_later_epochs_from_disk_within_its_bound(
    proxied, local_batches, tmp_path
):
    url, options, proxy = proxied
    cache = str(tmp_path / "cache")
    cached = {"cache_dir": cache, "read_policy": QUICK}
    proxy.cut = 0.1  # fetching whole shards goes through faults too
    assert batches_of(url, options, **cached) == local_batches
    example = sum(e.stat().st_size for e in os.scandir(EXAMPLE) if e.name.endswith(".tar"))
    assert wdsvlm.storage.cache.ShardCache(cache).size() == example
    proxy.faults_off()
    loader = wdsvlm.Loader(url, TOKENIZER, storage_options=options, **cached, **SMALL)
    proxy.status = 503  # the store goes down: a loader sharing the cache needs nothing from it
    requests = proxy.requests
    assert [digest(b) for b in loader] == local_batches
    assert proxy.requests == requests  # every shard came from the cache
    proxy.faults_off()
    # a bound smaller than the data: least recently used shards go, the batches stay the same
    small = str(tmp_path / "small")
    bound = 2 * max(e.stat().st_size for e in os.scandir(EXAMPLE) if e.name.endswith(".tar"))
    bounded = {"cache_dir": small, "cache_bytes": bound}
    assert batches_of(url, options, **bounded) == local_batches
    assert 0 < wdsvlm.storage.cache.ShardCache(small).size() <= bound
    tiny = {"cache_dir": str(tmp_path / "tiny"), "cache_bytes": 1000}  # no shard fits
    assert batches_of(url, options, **tiny) == local_batches
    assert wdsvlm.storage.cache.ShardCache(str(tmp_path / "tiny")).size() == 0


def test_worker_processes_fill_one_cache_together(s3_bucket, tmp_path):
    bucket, options = s3_bucket
    upload(EXAMPLE, f"{bucket}/example", options)
    cache = {"cache_dir": str(tmp_path / "cache"), "num_workers": 2}
    shared = batches_of(f"{bucket}/example", options, **cache)
    assert shared == batches_of(EXAMPLE, num_workers=2)
    cached = wdsvlm.storage.cache.ShardCache(str(tmp_path / "cache"))
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(  # each shard once, by its sha256
        [".lock"]  # and the lock taken while making room: no fetch left behind
        + [os.path.basename(cached.path(s["sha256"])) for s in wdsvlm.load_index(EXAMPLE)["shards"]]
    )


@contextlib.contextmanager
def counting_store(folder: str, sizes: list[int], delay: float):
    """Blobs of random bytes of these sizes in ``folder``, served on 127.0.0.1 by a
    ``RangeServer`` (it counts the bytes it serves) answering each ranged read ``delay``
    seconds late; yields the server and the shards as ``(url, local path, size, sha256)``."""
    os.makedirs(folder)
    shards = []
    for i, size in enumerate(sizes):
        data = os.urandom(size)
        path = os.path.join(folder, f"blob-{i:02d}.tar")
        with open(path, "wb") as f:
            f.write(data)
        shards.append((f"blob-{i:02d}.tar", path, size, hashlib.sha256(data).hexdigest()))
    with serving(RangeServer(folder, delay)) as server:
        yield server, [(f"{server.url}/{name}", *rest) for name, *rest in shards]


def read_through_cache(folder, bound, shards, passes, seed, barrier) -> None:
    """A reader process: each shard of ``shards`` in turn, ``passes`` times, three ranges of
    each read through a ``ShardCache`` and checked against the file the store serves."""
    cache = wdsvlm.storage.cache.ShardCache(folder, bound)
    policy = ReadPolicy(block_bytes=16 * 1024, attempts=4, backoff=0.01, timeout=10)
    rng = random.Random(seed)
    barrier.wait(timeout=120)
    for _ in range(passes):
        for url, path, size, sha256 in shards:
            with open(path, "rb") as f:
                data = f.read()
            for _ in range(3):
                start = rng.randrange(size)
                stop = min(size, start + rng.randrange(1, 20_000))
                got = cache.read(url, size, start, stop, None, policy, sha256=sha256)
                assert got == data[start:stop], f"{url} [{start}, {stop}): wrong bytes"


def run_readers(count: int, args_of, timeout: float, sample=None) -> None:
    """``count`` forked ``read_through_cache`` processes (``args_of(i)``: their arguments),
    started together; ``sample()`` is called every few milliseconds while they run. A process
    that fails fails the test, and so does one still running after ``timeout`` seconds."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(count)
    readers = [
        context.Process(target=read_through_cache, args=(*args_of(i), barrier), daemon=True)
        for i in range(count)
    ]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    try:
        while any(r.is_alive() for r in readers) and time.monotonic() < deadline:
            if sample is not None:
                sample()
            time.sleep(0.002)
        late = [r.pid for r in readers if r.is_alive()]
        assert not late, f"readers {late} still running after {timeout} s"
    finally:
        for reader in readers:
            reader.kill()
            reader.join(timeout=10)
    assert [r.exitcode for r in readers] == [0] * count


@pytest.mark.processes
def test_a_shard_cache_shared_by_processes_never_holds_more_than_its_bound(tmp_path):
    folder, size = str(tmp_path / "cache"), 64 * 1024
    bound = 2 * size
    most = [0]

    def sample():
        # under the cache's folder lock (the one it holds while it makes room and reserves a
        # fetch's bytes), so that the files counted are those of one moment
        with open(os.path.join(folder, ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            total = 0
            for entry in os.scandir(folder):
                if entry.name.endswith(".tar") or ".fetch" in entry.name:  # in-flight fetches
                    with contextlib.suppress(FileNotFoundError):
                        total += entry.stat().st_size
        most[0] = max(most[0], total)

    with counting_store(str(tmp_path / "store"), [size] * 12, delay=0.005) as (_, shards):
        os.makedirs(folder)

        def args_of(i):  # each reader in its own order
            return folder, bound, shards[3 * i :] + shards[: 3 * i], 2, i

        run_readers(4, args_of, timeout=240, sample=sample)
    assert 0 < most[0] <= bound, f"{most[0]} bytes in a cache bounded at {bound}"
    assert 0 < wdsvlm.storage.cache.ShardCache(folder).size() <= bound


@pytest.mark.processes
def test_a_shard_cache_shared_by_processes_fetches_each_shard_once(tmp_path):
    folder = str(tmp_path / "cache")
    sizes = [256 * 1024] * 6 + [100_000]
    with counting_store(str(tmp_path / "store"), sizes, delay=0.01) as (server, shards):
        run_readers(4, lambda i: (folder, 2**30, shards, 1, i), timeout=240)
        served = server.served
    # all four read the same shards at the same time: each shard comes from the store once
    assert served <= 1.1 * sum(sizes), f"{served / sum(sizes):.2f}x the dataset's bytes"
    assert wdsvlm.storage.cache.ShardCache(folder).size() == sum(sizes)


def test_memory_and_http_sources_give_the_same_batches(local_batches, tmp_path):
    names = [n for n in os.listdir(EXAMPLE) if n.endswith(".tar") or n == "index.json"]
    memory = fsspec.filesystem("memory")
    folder = f"/example-{time.monotonic_ns()}"
    for name in names:
        with open(os.path.join(EXAMPLE, name), "rb") as f:
            memory.pipe(f"{folder}/{name}", f.read())
    assert batches_of(f"memory://{folder}") == local_batches

    with range_server(EXAMPLE) as server:
        assert batches_of(server.url) == local_batches


def test_errors_never_show_the_credentials(s3_bucket):
    bucket, options = s3_bucket
    secret = "wdsvlm-test-secret-4f9a"
    with_secret = {**options, "key": "testing", "secret": secret}
    run = run_cli("verify", f"{bucket}/nothing-here", "--storage-options", json.dumps(with_secret))
    assert run.returncode != 0 and "nothing-here" in run.stderr
    assert secret not in run.stdout + run.stderr
    with pytest.raises(wdsvlm.WdsvlmError) as caught:
        wdsvlm.Loader(f"{bucket}/nothing-here", TOKENIZER, storage_options=with_secret)
    assert secret not in str(caught.value) and "nothing-here" in str(caught.value)


def test_a_cancelled_read_stops_before_its_next_request(tmp_path):
    (tmp_path / "blob").write_bytes(b"x" * 1000)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(wdsvlm.StorageError, match="cancelled at byte 0"):
        read_range(str(tmp_path / "blob"), 0, 1000, None, None, cancel)


def test_skip_mode_resumes_past_a_shard_that_went_away(tmp_path):
    import shutil

    data = str(tmp_path / "ds")
    shutil.copytree(EXAMPLE, data)
    options = {**SMALL, "on_shard_error": "skip"}
    loader = wdsvlm.Loader(data, TOKENIZER, **options)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    held = {p for p, _ in state["workers"][0]["window"]["places"]}
    assert held, "the state holds samples to read again"
    # the shard of a held sample goes away before the restart
    place = state["workers"][0]["window"]["places"][0]
    gone = wdsvlm.pipeline.plan.Plan(data).locate(place[0], [place[1]])[0]["shard"]
    os.remove(os.path.join(data, gone))
    resumed = wdsvlm.Loader(data, TOKENIZER, **options)
    resumed.load_state_dict(state)
    keys = [k for b in resumed for row in b["sample_keys"] for k in row]
    assert keys and not any(k.startswith(gone + "/") for k in keys)
    assert resumed.stats()["skipped"]["unreadable_shard"] > 0


def test_a_mixture_file_in_a_bucket_names_its_sources_relative_to_it(s3_bucket, tmp_path):
    bucket, options = s3_bucket
    upload(EXAMPLE, f"{bucket}/mix/example", options)
    text = b"sources:\n  - {path: example, repeat: 0.5}\n  - {path: example, choose: 10, name: b}\n"
    fs, path = fsspec.core.url_to_fs(f"{bucket}/mix/mixture.yaml", **options)
    fs.pipe(path, text)
    os.symlink(EXAMPLE, tmp_path / "example")
    (tmp_path / "mixture.yaml").write_bytes(text)
    remote = batches_of(f"{bucket}/mix/mixture.yaml", options, batches_per_epoch=3)
    assert remote == batches_of(str(tmp_path / "mixture.yaml"), batches_per_epoch=3)


class _NoLength(RangeServer):
    """Files of ``folder`` sent whole, HEAD and GET alike, with no ``Content-Length`` (the body
    ends when the connection closes, as a server streaming generated bytes sends it)."""

    def __init__(self, folder: str):
        super().__init__(folder)
        import http.server

        class Unsized(http.server.BaseHTTPRequestHandler):
            def do_HEAD(self):
                self.send_response(200)
                self.end_headers()

            def do_GET(self):
                path = os.path.join(folder, os.path.basename(self.path))
                self.send_response(200)
                self.end_headers()
                with open(path, "rb") as f:
                    self.wfile.write(f.read())

            def log_message(self, *args):
                pass

        self.RequestHandlerClass = Unsized


def test_the_size_of_an_object_a_server_does_not_state_is_unknown():
    """An HTTP server that sends no ``Content-Length``: ``object_size`` says it does not
    know (``None``), not a ``TypeError``; a file's size is its size."""
    from wdsvlm.storage.fs import object_size

    with serving(_NoLength(EXAMPLE)) as server:
        assert object_size(f"{server.url}/index.json") is None
    index = os.path.join(EXAMPLE, "index.json")
    assert object_size(index) == os.path.getsize(index)
