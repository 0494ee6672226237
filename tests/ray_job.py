"""The Ray side of tests/test_ray.py, run as ``python -m tests.ray_job CASE WORKDIR`` inside a
network namespace of its own that holds only loopback (so every server Ray and moto start
listens on 127.0.0.1 and nowhere else). It writes what it found to ``WORKDIR/CASE.json``;
the test asserts on it. Past its time limit it prints every thread's stack and exits."""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # no usage statistics
os.environ["RAY_AUTH_MODE"] = "disabled"  # no token written to ~/.ray
for name, value in {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}.items():
    os.environ[name] = value

import ray  # noqa: E402

import wdsvlm  # noqa: E402
from wdsvlm.tools.cli import main as cli  # noqa: E402

from .conftest import _serve, command_lines  # noqa: E402

serve = contextlib.contextmanager(_serve)  # a server on 127.0.0.1 while in the with block
write_on_ray = functools.partial(wdsvlm.write_dataset, engine="ray")

TEMP_PREFIX = "wdsvlm-ray-"  # Ray's session files go under /tmp/wdsvlm-ray-*, removed after


@contextlib.contextmanager
def ray_session(cpus: int, resources: dict | None = None):
    """A local Ray of ``cpus`` CPUs (and custom ``resources``), its session files in a folder
    of its own, stopped and removed after."""
    temp = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")  # short: Ray's socket paths
    ray.init(
        num_cpus=cpus,
        resources=resources,
        include_dashboard=False,
        _temp_dir=temp,
        log_to_driver=False,
    )
    try:
        yield temp
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def ray_cluster(cpus: int, port: int):
    """A cluster started by ``ray start --head`` on 127.0.0.1:``port`` (as users start one),
    its session files in a folder of its own; yields its address. Stopped and removed after."""
    temp = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    head = [ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}"]
    head += [f"--num-cpus={cpus}", "--include-dashboard=false", f"--temp-dir={temp}"]
    head += ["--disable-usage-stats"]
    subprocess.run(head, check=True, capture_output=True)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def moto():
    """A moto S3 server on 127.0.0.1 and a bucket; yields ``(s3 URL, storage_options)``."""
    import s3fs

    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    with serve([exe, "-H", "127.0.0.1", "-p", "PORT"]) as endpoint:
        options = {"client_kwargs": {"endpoint_url": endpoint}}
        s3fs.S3FileSystem(**options).mkdir("out")
        yield "s3://out", options


def http_server(folder: str):
    """Python's http.server on 127.0.0.1 serving ``folder``; yields its URL."""
    return serve([sys.executable, "-m", "http.server", "PORT", "-b", "127.0.0.1", "-d", folder])


def digests(url: str, options=None, by_path: bool = False) -> dict[str, str]:
    """Each file's sha256 by its name (``by_path``: by its path under ``url``)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    fs.invalidate_cache()
    return {
        (path[len(root.rstrip("/")) + 1 :] if by_path else path.rsplit("/", 1)[-1]): (
            hashlib.sha256(fs.cat_file(path)).hexdigest()
        )
        for path in sorted(fs.find(root))
    }


def suite(work: str) -> dict:
    """Ray writes of the test's inputs: JSON and Parquet on 1 and 2 CPUs, a Ray Dataset, the
    CLI with --workers and with --ray-address, bad input, an S3 output; and tars written by
    Ray Data's own write_webdataset for `wdsvlm index`."""
    spec = json.load(open(os.path.join(work, "inputs.json")))
    found: dict = {}
    for cpus in (1, 2):
        with ray_session(cpus):
            for kind, inputs in (("json", spec["json"]), ("parquet", spec["parquet"])):
                out = os.path.join(work, f"ray{cpus}-{kind}")
                write_on_ray(
                    inputs, out, image_root=spec["image_root"], progress=False, **spec["options"]
                )
                found[f"ray{cpus}-{kind}"] = digests(out)
            if cpus == 2:
                records = [json.loads(line) for line in open(spec["json"])]
                out = os.path.join(work, "ray-dataset")
                data = ray.data.from_items(records, override_num_blocks=3)
                write_on_ray(
                    data, out, image_root=spec["image_root"], progress=False, **spec["options"]
                )
                found["ray-dataset"] = digests(out)
                out = os.path.join(work, "ray-prefixes")  # shards spread over prefix folders
                write_on_ray(
                    spec["json"],
                    out,
                    image_root=spec["image_root"],
                    progress=False,
                    prefixes=4,
                    **spec["options"],
                )
                found["ray-prefixes"] = digests(out, by_path=True)
                try:
                    write_on_ray(spec["bad"], os.path.join(work, "bad"), progress=False)
                except wdsvlm.BadInputError as e:
                    found["bad-error"] = str(e)
                summary = write_on_ray(
                    spec["bad"], os.path.join(work, "bad"), skip_bad=True, progress=False
                )
                found["bad-skipped"] = summary.skipped
                found["bad-listed"] = open(os.path.join(work, "bad", "skipped.jsonl")).read()
                with http_server(spec["image_root"]) as url:  # images fetched over http
                    records = [json.loads(line) for line in open(spec["json"])]
                    path = os.path.join(work, "http.jsonl")
                    with open(path, "w") as f:
                        for r in records:
                            f.write(json.dumps({**r, "image": f"{url}/{r['image']}"}) + "\n")
                    out = os.path.join(work, "ray-http")
                    write_on_ray(path, out, progress=False, **spec["options"])
                    found["ray-http"] = digests(out)
                with moto() as (bucket, options):
                    write_on_ray(
                        spec["json"],
                        f"{bucket}/ds",
                        image_root=spec["image_root"],
                        storage_options=options,
                        progress=False,
                        **spec["options"],
                    )
                    found["s3"] = digests(f"{bucket}/ds", options)
                rows = []  # raw image bytes and JSON text: no encoder re-encodes them
                for sample in spec["webdataset"]:
                    row = {"__key__": sample["key"], "json": sample["json"]}
                    for suffix, path in sample["images"].items():
                        row[suffix] = open(path, "rb").read()
                    rows.append(row)
                ray.data.from_items(rows, override_num_blocks=1).write_webdataset(
                    os.path.join(work, "rwds"), encoder=None
                )
    # the command line: a local Ray of --workers CPUs, then a running cluster's address
    args = ["write", "--engine", "ray", "--image-root", spec["image_root"], "-q"]
    args += spec["cli_options"]
    out = f"{work}/cli-workers"
    code = cli([*args, "--input", spec["json"], "--output", out, "--workers", "2"])
    found["cli-workers"] = [code, digests(f"{work}/cli-workers")]
    with ray_cluster(2, port=6390) as address:
        out = f"{work}/cli-address"
        code = cli([*args, "--input", spec["json"], "--output", out, "--ray-address", address])
        found["cli-address"] = [code, digests(f"{work}/cli-address")]
    return found


def kill_worker(work: str) -> dict:
    """A Ray worker process killed while it writes a shard to S3: Ray runs the task again and
    the output is whole and the same."""
    spec = json.load(open(os.path.join(work, "inputs.json")))
    killed: list[int] = []
    stop = threading.Event()

    def hunt():
        while not stop.is_set() and not killed:
            for pid, title in command_lines().items():
                if title.startswith(b"ray::_run"):  # a worker running a shard write
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                    return
            time.sleep(0.002)

    with ray_session(2), moto() as (bucket, options):
        thread = threading.Thread(target=hunt, daemon=True)
        thread.start()
        summary = write_on_ray(
            spec["json"],
            f"{bucket}/ds",
            image_root=spec["image_root"],
            storage_options=options,
            progress=False,
            **spec["options"],
        )
        stop.set()
        thread.join()
        return {"killed": killed, "shards": summary.shards, "s3": digests(f"{bucket}/ds", options)}


def run_case(cases: dict) -> None:
    """``python -m MODULE CASE WORKDIR LIMIT``: ``cases[CASE](WORKDIR)``, what it found written
    to ``WORKDIR/CASE.json``; past ``LIMIT`` seconds every thread's stack and exit."""
    case, work = sys.argv[1], sys.argv[2]
    faulthandler.dump_traceback_later(float(sys.argv[3]), exit=True)
    # every Ray session of the job, those wdsvlm starts itself included, under one folder
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix=TEMP_PREFIX, dir="/tmp")
    try:
        found = cases[case](work)
    finally:
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)
    with open(os.path.join(work, f"{case}.json"), "w") as f:
        json.dump(found, f)


if __name__ == "__main__":
    run_case({"suite": suite, "kill_worker": kill_worker})
