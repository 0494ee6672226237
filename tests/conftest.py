"""Fixtures: small input datasets made on the spot, and real storage servers on 127.0.0.1."""

from __future__ import annotations

import gc
import io
import json
import multiprocessing.process
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.request

import numpy as np
import pytest
from PIL import Image, ImageDraw

# One thread per process for torch's (and every OpenMP library's) kernels: the suite runs many
# processes side by side on few cores, where each one's own threads only compete (about a
# fifth of the CPU time of the model tests, on 2 cores). Subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "shards_example")


SERVER_FIXTURES = {"moto_server", "gcs_server", "s3_bucket", "gcs_bucket", "proxied"}


# `make test` runs the suite side by side in pytest-xdist workers. A test module's tests run in
# one worker, so that its module fixtures are built once (`--dist loadscope`, with the scheduler
# below). These modules start the most processes: they go first, so that the run does not end
# waiting on one of them. The Ray tests are one group: they look for Ray processes and session
# files left behind, machine-wide, so no two of them may run at once.
SLOWEST_FIRST = [
    "test_ray_workers",
    "test_workers",
    "test_hf",
    "test_train",
    "test_ddp",
    "test_loader",
    "test_video_families",
    "test_storage",
    "test_multinode",
    "test_readme",
    "test_elastic",
    "test_map",
    "test_sizing",
]
SAME_GROUP = {"test_ray": "test_ray_workers"}


def module_group(nodeid: str) -> str:
    """The group a test runs in: its module's name, or the one it shares (``SAME_GROUP``)."""
    name = os.path.basename(nodeid.split("::", 1)[0]).removesuffix(".py")
    return SAME_GROUP.get(name, name)


def pytest_collection_modifyitems(items):
    """Tests on a storage server start a real process: marked ``processes`` (see pyproject).
    The slowest modules are put first, a module's tests in the order written."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.processes)

    def rank(item) -> int:
        group = module_group(item.nodeid)
        return SLOWEST_FIRST.index(group) if group in SLOWEST_FIRST else len(SLOWEST_FIRST)

    items.sort(key=rank)


def pytest_collection_finish(session):
    """What the test modules imported (torch, transformers, the models' classes) is moved out
    of the garbage collector's sight: a full collection (a test's own, or Python's when the heap
    grows) then walks only what the tests made, not the 500,000 or more objects made at import
    (0.3-0.6 s a collection before, a fifth of the video tests' time)."""
    gc.collect()
    gc.freeze()


# what an import runs to look something up: ctypes.util.find_library (ldconfig), platform,
# and matplotlib building its font cache on first use (fc-list)
LOOKUPS = (
    os.path.join("ctypes", "util.py"),
    os.sep + "platform.py",
    os.path.join("matplotlib", "font_manager.py"),
)


@pytest.fixture(autouse=True)
def _no_process_unless_marked(request, monkeypatch):
    """A test not marked ``processes`` starts no process (a subprocess, DataLoader workers, a
    fork server): `make test-fast` leaves out exactly the tests that do."""
    if request.node.get_closest_marker("processes"):
        yield
        return
    started = []
    start, popen = multiprocessing.process.BaseProcess.start, subprocess.Popen.__init__

    def recorded_start(self, *args, **kwargs):
        started.append(f"a process ({type(self).__name__} {self.name})")
        return start(self, *args, **kwargs)

    def recorded_popen(self, args, *rest, **kwargs):
        # an import's look-up (ctypes.util.find_library runs ldconfig) is not the test's
        callers = {frame.filename for frame in traceback.extract_stack(limit=8)}
        if not any(name.endswith(LOOKUPS) for name in callers):
            started.append(f"a subprocess {str(args)[:120]}")
        return popen(self, args, *rest, **kwargs)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recorded_start)
    monkeypatch.setattr(subprocess.Popen, "__init__", recorded_popen)
    yield
    if started:
        pytest.fail(f"{request.node.nodeid} started {started[0]}: mark it `processes`")


@pytest.fixture(autouse=True)
def _own_node_folder(tmp_path_factory, monkeypatch):
    """Each test has its own node folder (the copies of shard tables and sidecars, the request
    budget): none is served by copies another test, or an earlier run, left behind."""
    monkeypatch.setenv("WDSVLM_LOCAL_DIR", str(tmp_path_factory.mktemp("node")))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope`` (pyproject's default) by ``module_group``: xdist's own ``loadgroup``
    cannot be used, as it renames tests through an attribute pytest 9 no longer reads."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return module_group(nodeid)

    return ModuleGroups(config, log)


def make_image(path: str, size: tuple[int, int], fmt: str, seed: int = 0, **save) -> str:
    """A small picture with some structure (so JPEG and PNG differ from a flat fill)."""
    img = Image.new("RGB", size, (30 + 7 * seed % 200, 90, 160))
    draw = ImageDraw.Draw(img)
    w, h = size
    draw.ellipse([w // 5, h // 5, 3 * w // 4, 3 * h // 4], fill=(240, 200, 20))
    draw.rectangle([0, 0, w // 6, h // 3], fill=(10, 160, 60))
    img.save(path, format=fmt, **save)
    return path


def photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise: resampling filters see edges, ramps and texture."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) % 256], -1)
    noisy = base + rng.normal(0, 25, (height, width, 3))
    return Image.fromarray(noisy.clip(0, 255).astype(np.uint8), "RGB")


def write_jsonl(path: str, records: list) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


@pytest.fixture
def llava_input(tmp_path):
    """A LLaVA JSONL file of 12 records with every shape of sample the writer must handle.

    Returns ``(input path, image root, records)``.
    """
    root = tmp_path / "images"
    root.mkdir()
    make_image(str(root / "a.jpg"), (320, 200), "JPEG", 1, quality=85)
    make_image(str(root / "b.png"), (64, 256), "PNG", 2)
    make_image(str(root / "c.jpg"), (500, 375), "JPEG", 3, quality=70)
    make_image(str(root / "d.gif"), (90, 60), "GIF", 4)  # not kept as is: re-encoded to PNG
    exif = Image.Exif()
    exif[0x0112] = 6  # stored 300x100, shown 100x300
    make_image(str(root / "rotated.jpg"), (300, 100), "JPEG", 5, exif=exif)
    os.makedirs(root / "sub")
    make_image(str(root / "sub" / "e.webp"), (128, 128), "WEBP", 6)

    def rec(i, conversations, image=None, **extra):
        r = {"id": f"r{i}", "conversations": conversations, **extra}
        if image is not None:
            r["image"] = image
        return r

    def qa(q, a):
        return [{"from": "human", "value": q}, {"from": "gpt", "value": a}]

    records = [
        rec(0, qa("<image>\nWhat is this?", "A yellow disc."), "a.jpg"),
        rec(1, qa("Describe <image> please.", "A tall picture."), ["b.png"]),
        rec(2, qa("What is 2+2?", "4.")),  # text only
        rec(3, qa("<image>\n<image>\nCompare them.", "The first is wider."), ["a.jpg", "c.jpg"]),
        rec(
            4,
            [{"from": "system", "value": "Be brief."}]
            + qa("<image>\nColor?", "Yellow.")
            + qa("And the corner?", "Green."),
            "c.jpg",
        ),
        rec(5, qa("<image>\nAnimated?", "No."), "d.gif"),
        rec(6, qa("<image>\nWhich way is up?", "The long side is vertical."), "rotated.jpg"),
        rec(7, qa("Caption this.", "A disc on blue."), "sub/e.webp"),  # no marker: placed first
        rec(8, qa("Say hi", "Hi! " * 200)),  # a long answer
        rec(9, qa("<image>\nÜnïcödé?", "Ja, 日本語 too."), "b.png"),
        rec(10, qa("<image>\nAgain?", "Again."), "a.jpg", source="custom_source"),
        rec(11, qa("Last one", "Done.")),
    ]
    path = write_jsonl(str(tmp_path / "llava.jsonl"), records)
    return path, str(root), records


@pytest.fixture
def cauldron_input(tmp_path):
    root = tmp_path / "cimages"
    root.mkdir()
    make_image(str(root / "x.jpg"), (200, 100), "JPEG", 7)
    make_image(str(root / "y.png"), (100, 200), "PNG", 8)
    records = [
        {
            "images": ["x.jpg", "y.png"],
            "texts": [
                {"user": "How many?", "assistant": "Two.", "source": "vqa_set"},
                {"user": "Sure?", "assistant": "Yes."},
            ],
        },
        {"images": [], "texts": [{"user": "No image here.", "assistant": "Right."}]},
        {"images": [{"path": "x.jpg"}], "texts": [{"user": "Q", "assistant": "A"}], "system": "S"},
    ]
    path = write_jsonl(str(tmp_path / "cauldron.jsonl"), records)
    return path, str(root), records


def run_process(args: list[str], timeout: float, **options) -> subprocess.CompletedProcess:
    """``subprocess.run(args)`` in a new process group, text output captured. Past
    ``timeout`` the whole group is killed (torchrun's ranks and every worker with it), and the
    test fails with what it printed: a hang is a red test, never a process left behind."""
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        **options,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(args)} did not finish in {timeout} s; its output:\n"
            f"{out[-3000:]}\n{err[-6000:]}"
        )
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever it left running
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def command_lines() -> dict[int, bytes]:
    """Every live process of this machine: its command line (Ray names its workers
    ``ray::...``), by pid."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                found[int(name)] = open(f"/proc/{name}/cmdline", "rb").read()
            except OSError:  # gone meanwhile
                continue
    return found


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``wdsvlm ARGS`` in this process, as the console script runs it: the exit code, and
    what it printed on stdout and stderr (logged warnings and progress bars included); an
    exception that escapes (``-v``) is printed as the interpreter would, exit code 1."""
    import contextlib
    import io
    import logging
    import traceback

    from wdsvlm.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse: usage errors, --help
                code = e.code if isinstance(e.code, int) else 1
            except Exception:  # noqa: BLE001 - shown as the interpreter shows it
                traceback.print_exc()
                code = 1
    finally:
        root.removeHandler(handler)
    return subprocess.CompletedProcess(["wdsvlm", *args], code, out.getvalue(), err.getvalue())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server for {url} exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return  # it answers: up
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"server at {url} did not come up in {timeout} s")


def _serve(args: list[str]):
    """Run the server ``args`` (with ``PORT`` in them) on 127.0.0.1 until the generator is
    closed; yields its endpoint URL once it answers."""
    port = _free_port()
    args = [str(port) if a == "PORT" else a for a in args]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_http(endpoint, proc)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def moto_server():
    """A real moto S3 server process on 127.0.0.1; yields its endpoint URL."""
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    yield from _serve([exe, "-H", "127.0.0.1", "-p", "PORT"])


@pytest.fixture
def s3_bucket(moto_server, monkeypatch):
    """A new, empty bucket on the moto server; yields ``(s3 URL, storage_options)``."""
    import s3fs

    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    options = {"client_kwargs": {"endpoint_url": moto_server}}
    fs = s3fs.S3FileSystem(**options)
    bucket = f"bucket-{time.monotonic_ns()}"
    fs.mkdir(bucket)
    return f"s3://{bucket}", options


def read_image_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def decode(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


# gcsfs probes a bucket's type over gRPC, which the emulator does not speak (each probe then
# waits 60 s); this turns the probe off. It must be set before gcsfs is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """A real gcp-storage-emulator server process on 127.0.0.1; yields its endpoint URL."""
    exe = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
    data = str(tmp_path_factory.mktemp("gcs"))
    yield from _serve(
        [exe, "-d", data, "start", "--host", "127.0.0.1", "--port", "PORT", "-q", "-M"]
    )


@pytest.fixture
def gcs_bucket(gcs_server):
    """A new, empty bucket on the emulator; yields ``(gs URL, storage_options)``."""
    import gcsfs

    options = {"endpoint_url": gcs_server, "token": "anon", "project": "test"}
    fs = gcsfs.GCSFileSystem(**options)
    bucket = f"bucket-{time.monotonic_ns()}"
    fs.mkdir(bucket)
    return f"gs://{bucket}", options


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    """Each test video of ``wdsvlm.testing.videos.SPECS`` by name: its spec, its bytes and a
    file of them (transformers' load_video reads files)."""
    from wdsvlm.testing.videos import SPECS, make_video

    folder = tmp_path_factory.mktemp("videos")
    out = {}
    for spec in SPECS:
        data = make_video(spec)
        path = folder / f"{spec.name}.mp4"
        path.write_bytes(data)
        out[spec.name] = (spec, data, str(path))
    return out
