"""How DataLoader workers start: from a fork server that holds no thread, never by forking the
threaded training process; many starts right after a resume in a 2-rank gloo group never
hang; a script whose workers would re-run its top-level code is refused with the fix."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import textwrap

import pytest

import wdsvlm

from .conftest import EXAMPLE, REPO, run_process

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
SMALL = {"max_length": 256, "batch_size": 2, "tile_size": 32, "max_image_side": 64}


def started_workers(loader) -> tuple[list, object]:
    """The processes that starting ``loader``'s workers (its first two batches) added, and the
    running iterator."""
    before = {p.pid for p in multiprocessing.active_children()}
    batches = iter(loader)
    next(batches)
    next(batches)
    workers = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert len(workers) == loader.settings.num_workers
    return workers, batches


def parent_and_threads(pid: int) -> tuple[int, int]:
    """The parent of process ``pid`` and how many threads that parent runs."""
    with open(f"/proc/{pid}/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
    return parent, len(os.listdir(f"/proc/{parent}/task"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.processes
def test_workers_are_forked_from_a_process_that_runs_no_thread():
    import threading

    stop = threading.Event()
    busy = threading.Thread(target=stop.wait, daemon=True)  # this process is threaded
    busy.start()
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, num_workers=2, **SMALL)
    workers, batches = started_workers(loader)
    for worker in workers:
        parent, threads = parent_and_threads(worker.pid)
        assert parent != os.getpid(), "a worker was forked from the training process"
        assert threads == 1, f"the process workers fork from runs {threads} threads"
    batches.close()
    stop.set()


@pytest.mark.processes
def test_fork_is_there_for_those_who_ask_and_a_wrong_name_is_refused():
    loader = wdsvlm.Loader(
        EXAMPLE, TOKENIZER, num_workers=2, multiprocessing_context="fork", **SMALL
    )
    workers, batches = started_workers(loader)
    assert {parent_and_threads(w.pid)[0] for w in workers} == {os.getpid()}
    batches.close()
    with pytest.raises(ValueError, match="multiprocessing_context 'threads' is not one of"):
        wdsvlm.Loader(EXAMPLE, TOKENIZER, multiprocessing_context="threads", **SMALL)


SCRIPT = """
import wdsvlm
{body}
"""
LOOP = f"""
loader = wdsvlm.Loader({EXAMPLE!r}, {TOKENIZER!r}, num_workers=2, max_length=256,
                       batch_size=2, tile_size=32, max_image_side=64)
print("batches", sum(1 for _ in loader))
"""


@pytest.mark.processes
@pytest.mark.parametrize("guarded", [False, True], ids=["top-level", "guarded"])
def test_a_script_whose_workers_would_rerun_its_top_level_is_refused(tmp_path, guarded):
    body = LOOP
    if guarded:
        body = (
            "def main():\n"
            + textwrap.indent(LOOP, "    ")
            + '\nif __name__ == "__main__":\n    main()\n'
        )
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(body=body))
    run = run_process(
        [sys.executable, str(script)], timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    if guarded:
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.startswith("batches ")
    else:
        assert run.returncode == 1
        assert f"{script}, line 4: DataLoader workers start with" in run.stderr  # made there
        assert 'if __name__ == "__main__":' in run.stderr


FORK_AFTER_RESIZE = f"""
import faulthandler, wdsvlm
faulthandler.dump_traceback_later(100, exit=True)  # a hang prints every thread's stack
small = dict(max_length=512, batch_size=2, tile_size=256, max_image_side=512, tokens_per_tile=16)
print("alone", sum(1 for _ in wdsvlm.Loader({EXAMPLE!r}, {TOKENIZER!r}, **small)), flush=True)
import cv2
print("opencv_threads", cv2.getNumThreads(), flush=True)
loader = wdsvlm.Loader({EXAMPLE!r}, {TOKENIZER!r}, num_workers=2, multiprocessing_context="fork",
                       **small)
print("forked", sum(1 for _ in loader), flush=True)
"""


@pytest.mark.processes
def test_workers_forked_after_the_process_resized_images_do_not_hang(tmp_path):
    """OpenCV's thread pool does not survive a fork: once it has run in the training process,
    a worker forked from it hangs in its first resize. The tiling keeps the pool off."""
    script = tmp_path / "fork_after_resize.py"
    script.write_text(FORK_AFTER_RESIZE)
    run = run_process(
        [sys.executable, str(script)], timeout=150, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert run.returncode == 0, run.stdout[-1000:] + run.stderr[-4000:]
    alone, threads, forked = (int(line.split()[1]) for line in run.stdout.split("\n")[:3])
    assert alone > 0 and forked > 0
    assert threads == 1  # the pool never started in the training process


@pytest.mark.processes
def test_many_worker_starts_right_after_a_resume_in_a_gloo_group_never_hang():
    """scripts/stress_worker_start.py: 2 ranks x 40 DataLoader starts (80 workers a rank),
    each right after load_state_dict, with native threads entering Python all along (what
    makes a forked worker hang at start, at about 1 start in 200 with fork)."""
    run = run_process(
        [
            sys.executable,
            os.path.join(REPO, "scripts", "stress_worker_start.py"),
            "--starts",
            "40",
            "--native-threads",
            "2",
            "--deadline",
            "30",
            "--json",
        ],
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["context"] == "forkserver"
    assert result["starts"] == 80 and result["hangs"] == 0


def _environment_seen(payload: bytes, answer) -> None:
    import pickle

    os.environ["WDSVLM_TEST_OWN"] = "the worker's own"
    pickle.loads(payload)  # a worker's copy of the Loader's stream
    answer.put((os.environ.get("WDSVLM_TEST_PROBE"), os.environ.get("WDSVLM_TEST_OWN")))


@pytest.mark.processes
def test_workers_see_the_environment_as_it_is_when_they_start(monkeypatch):
    """The fork server keeps the environment it started with; a worker must see credentials
    and settings put in the environment since, as a forked worker would."""
    import pickle

    context = multiprocessing.get_context("forkserver")
    warm = context.Process(target=os.getpid)  # the fork server is up before the change
    warm.start()
    warm.join()
    monkeypatch.setenv("WDSVLM_TEST_PROBE", "set after the server started")
    loader = wdsvlm.Loader(EXAMPLE, TOKENIZER, batches_per_epoch=2, **SMALL)
    answer = context.Queue()
    child = context.Process(target=_environment_seen, args=(pickle.dumps(loader.stream), answer))
    child.start()
    # what changed since the server started comes; the rest of the worker's own stays
    assert answer.get(timeout=60) == ("set after the server started", "the worker's own")
    child.join(timeout=60)


@pytest.mark.processes
def test_after_an_error_in_a_worker_the_workers_stop_at_once(tmp_path):
    """The error's traceback keeps the DataLoader's iterator alive; the workers must not wait
    for the cycle collector (and then 5 s each) to be told to stop."""
    import shutil
    import time

    data = str(tmp_path / "ds")
    shutil.copytree(EXAMPLE, data)
    loader = wdsvlm.Loader(data, TOKENIZER, num_workers=2, **SMALL)
    os.remove(os.path.join(data, "shapes-000002.tar"))
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(wdsvlm.StorageError) as caught:
        for _ in loader:
            pass
    started = time.monotonic()
    workers = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert not workers, f"workers still running after the error: {workers}"
    assert time.monotonic() - started < 1
    assert caught.value  # the traceback (and what it holds) is still alive here


@pytest.mark.parametrize(
    "source,line,guarded",
    [
        ('if __name__ == "__main__":\n    main()\n', 2, True),
        ("if '__main__' == __name__:\n    main()\n", 2, True),
        ('if __name__ == "__main__" and not FLAG:\n    main()\n', 2, True),
        ('try:\n    if __name__ == "__main__":\n        main()\nfinally:\n    pass\n', 3, True),
        ('if __name__ == "__main__":\n    main()\nelse:\n    main()\n', 4, False),
        ('def f():\n    if __name__ == "__main__":\n        main()\n', 3, False),
        ("main()\n", 1, False),
    ],
    ids=["guard", "reversed", "and", "in-try", "else-branch", "in-a-function", "top-level"],
)
def test_the_main_guard_is_read_from_the_script(tmp_path, source, line, guarded):
    from wdsvlm.loader.workers import _guarded

    script = tmp_path / "train.py"
    script.write_text("import wdsvlm\n\n" + source)
    assert _guarded(str(script), line + 2) is guarded


def test_the_settings_are_frozen_and_hashable():
    import dataclasses

    settings = wdsvlm.LoaderSettings(storage_options={"anon": True})
    assert hash(settings) == hash(wdsvlm.LoaderSettings(storage_options={"anon": False}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_length = 1


TRAINER = f"""
import json, os, time
import wdsvlm

{{helpers}}

def main():
    loader = wdsvlm.Loader({EXAMPLE!r}, {TOKENIZER!r}, num_workers=2, batches_per_epoch=40,
                           max_length=256, batch_size=2, tile_size=32, max_image_side=64)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    print(json.dumps(descendants(os.getpid())), flush=True)
    time.sleep(600)  # until killed


if __name__ == "__main__":
    main()
"""


def started_at(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot; with the pid, what tells it from
    a later process given the same pid), or None when no such process runs (a zombie is done)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in "ZX" else int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """Every process below ``pid`` (children, theirs, ...), as ``{pid: started_at}``."""
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue  # not a process, or one that just ended
        children.setdefault(parent, []).append(int(name))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = started_at(child)
            todo.append(child)
    return {p: t for p, t in found.items() if t is not None}


def still_running(processes: dict[int, int]) -> list[int]:
    return [pid for pid, t in processes.items() if started_at(pid) == t]


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_fork_server_and_workers_exit_when_the_training_process_is_killed(tmp_path):
    """A training process killed outright (SIGKILL, the OOM killer) leaves no process behind:
    its fork server, the workers forked from it and the resource trackers all exit."""
    import select
    import signal
    import subprocess
    import time

    script = tmp_path / "train.py"
    import inspect

    helpers = "\n\n".join(inspect.getsource(f) for f in (started_at, descendants))
    script.write_text(TRAINER.format(helpers=helpers))
    with open(tmp_path / "stderr", "w+") as stderr:
        trainer = subprocess.Popen(
            [sys.executable, str(script)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            start_new_session=True,  # its group: whatever the test leaves is killed with it
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        left: dict[int, int] = {}
        try:
            ready, _, _ = select.select([trainer.stdout], [], [], 120)
            line = trainer.stdout.readline() if ready else ""
            stderr.seek(0)
            assert line, f"the training process printed nothing in 120 s:\n{stderr.read()[-3000:]}"
            left = {int(pid): t for pid, t in json.loads(line).items()}
            assert len(left) >= 3, f"expected a fork server and 2 workers, found {left}"
            os.kill(trainer.pid, signal.SIGKILL)
            trainer.wait(timeout=30)
            deadline = time.monotonic() + 20
            while still_running(left) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not still_running(left), (
                f"still running 20 s after the training process was killed: "
                f"{still_running(left)} of {sorted(left)}"
            )
        finally:
            for pid in still_running(left):
                os.kill(pid, signal.SIGKILL)
            try:
                os.killpg(trainer.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            trainer.kill()
            trainer.wait()


FIRST_START = f"""
import json, logging, os, sys
import torch
import wdsvlm

SMALL = dict(max_length=256, batch_size=2, tile_size=32, max_image_side=64, tokens_per_tile=4)


def children():
    '''The command lines of this process's children.'''
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{{name}}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{{name}}/cmdline", "rb") as f:
                command = f.read().replace(bytes(1), b" ").decode()
        except (OSError, ValueError):
            continue
        if parent == os.getpid():
            found.append(command)
    return found


def epochs(loader):
    out = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        out += list(loader)
    return out


def main():
    logging.basicConfig(stream=sys.stderr, level=logging.DEBUG, format="%(name)s: %(message)s")
    before = children()
    loader = wdsvlm.Loader({EXAMPLE!r}, {TOKENIZER!r}, num_workers=2, **SMALL)
    made = children()  # nothing iterated yet
    loader.set_epoch(0)
    batches = list(loader)
    loader.set_epoch(1)
    batches += list(loader)
    stats = loader.stats()
    forked = wdsvlm.Loader({EXAMPLE!r}, {TOKENIZER!r}, num_workers=2,
                           multiprocessing_context="fork", **SMALL)
    expected = epochs(forked)
    assert len(batches) == len(expected) > 2, (len(batches), len(expected))
    for ours, theirs in zip(batches, expected):
        assert ours["sample_keys"] == theirs["sample_keys"]
        assert ours.keys() == theirs.keys()
        for name, value in ours.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, theirs[name]), name
    assert stats == forked.stats()
    print(json.dumps({{"before": before, "made": made, "batches": len(batches)}}))


if __name__ == "__main__":
    main()
"""


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_fork_server_starts_with_the_loader(tmp_path):
    """In a fresh process the fork server starts when the Loader is made (its imports overlap
    the set-up); the batches and stats of its workers are those of forked workers, bit for
    bit."""
    script = tmp_path / "first_start.py"
    script.write_text(FIRST_START)
    run = run_process(
        [sys.executable, str(script)], timeout=240, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert run.returncode == 0, run.stdout[-1000:] + run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert not [c for c in result["before"] if "forkserver" in c]
    assert [c for c in result["made"] if "forkserver" in c], result["made"]


@pytest.mark.processes
def test_spawned_workers_give_the_batches_of_forked_workers():
    import torch

    spawned = wdsvlm.Loader(
        EXAMPLE,
        TOKENIZER,
        num_workers=2,
        multiprocessing_context="spawn",
        batches_per_epoch=4,
        **SMALL,
    )
    forked = wdsvlm.Loader(
        EXAMPLE,
        TOKENIZER,
        num_workers=2,
        multiprocessing_context="fork",
        batches_per_epoch=4,
        **SMALL,
    )
    for epoch in range(2):
        spawned.set_epoch(epoch)
        forked.set_epoch(epoch)
        for ours, theirs in zip(spawned, forked, strict=True):
            assert ours["sample_keys"] == theirs["sample_keys"]
            assert torch.equal(ours["pixel_values"], theirs["pixel_values"])


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.processes
def test_persistent_workers_serve_every_epoch(workers):
    loader = wdsvlm.Loader(
        EXAMPLE,
        TOKENIZER,
        num_workers=workers,
        multiprocessing_context="spawn",
        persistent_workers=True,
        batches_per_epoch=2 * workers,
        **SMALL,
    )
    before = {p.pid for p in multiprocessing.active_children()}
    seen = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        assert len(list(loader)) == 2 * workers
        seen.append({p.pid for p in multiprocessing.active_children()} - before)
    assert len(seen[0]) == workers and seen[0] == seen[1] == seen[2]
    loader.close()


@pytest.mark.processes
def test_a_resumed_epoch_goes_on_exactly_whatever_the_start_method():
    """From a saved state (its buffers holding samples cut by truncation and some still
    untokenized), spawned workers give every batch forked workers give."""
    import torch

    settings = dict(SMALL, truncate=True, batches_per_epoch=12, shuffle_buffer=40, pack_window=30)
    settings["span_samples"] = None  # chunks of 64 samples: the resumed batches truncate
    first = wdsvlm.Loader(EXAMPLE, TOKENIZER, num_workers=2, **settings)
    batches = iter(first)
    for _ in range(3):
        next(batches)
    state = first.state_dict()
    batches.close()
    runs = []
    for context in ("spawn", "fork"):
        loader = wdsvlm.Loader(
            EXAMPLE, TOKENIZER, num_workers=2, multiprocessing_context=context, **settings
        )
        loader.load_state_dict(state)
        runs.append(list(loader))
        assert loader.stats()["truncated"] > 0
    spawned, forked = runs
    assert len(spawned) == len(forked) == 9
    for ours, theirs in zip(spawned, forked, strict=True):
        assert ours["sample_keys"] == theirs["sample_keys"]
        for name, value in ours.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, theirs[name]), name


@pytest.mark.processes
def test_stopping_after_the_first_batch_stops_the_workers():
    before = {p.pid for p in multiprocessing.active_children()}
    loader = wdsvlm.Loader(
        EXAMPLE, TOKENIZER, num_workers=2, multiprocessing_context="spawn", **SMALL
    )
    batches = iter(loader)
    assert next(batches)["sample_keys"]
    batches.close()
    workers = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert not workers, f"workers still running after the iteration stopped: {workers}"


@pytest.mark.processes
def test_an_error_before_the_first_batch_stops_the_workers(tmp_path):
    """Every shard went away: the error comes, and no worker is left running."""
    import glob
    import shutil

    data = str(tmp_path / "ds")
    shutil.copytree(EXAMPLE, data)
    loader = wdsvlm.Loader(data, TOKENIZER, num_workers=2, multiprocessing_context="spawn", **SMALL)
    for shard in glob.glob(os.path.join(data, "*.tar")):
        os.remove(shard)
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(wdsvlm.StorageError):
        for _ in loader:
            pass
    workers = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert not workers, f"workers still running after the error: {workers}"


def two_workers(context: str, batches_per_epoch: int):
    return wdsvlm.Loader(
        EXAMPLE,
        TOKENIZER,
        num_workers=2,
        multiprocessing_context=context,
        batches_per_epoch=batches_per_epoch,
        **SMALL,
    )


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("context", ["forkserver", "spawn"])
def test_close_stops_the_workers_in_the_middle_of_an_epoch(context):
    """``close()`` after 3 of 20 batches: the worker processes are gone within 5 s, and the
    epoch's iteration ends there."""
    import time

    loader = two_workers(context, batches_per_epoch=20)
    workers, batches = started_workers(loader)
    next(batches)  # 3 of 20
    pids = [p.pid for p in workers]
    assert all(alive(pid) for pid in pids)
    loader.close()
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if alive(pid)], "workers still running 5 s after close()"
    assert next(batches, None) is None  # the epoch's iteration ended with close()
    assert loader.batches_done == 3
    again = list(loader)  # new workers go on from where the loader stands
    assert len(again) == 17


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals")
@pytest.mark.parametrize("context", ["forkserver", "spawn", "fork"])
def test_a_worker_killed_mid_epoch_is_an_error_within_seconds(context):
    """A DataLoader worker killed outright (SIGKILL, the OOM killer) in the middle of an epoch
    is a RuntimeError in the training process: at once where the workers are this process's
    children (``spawn``, ``fork``: torch's SIGCHLD handler), within the DataLoader's status
    check (5 s) where they are the fork server's."""
    import signal
    import time

    loader = two_workers(context, batches_per_epoch=200)
    workers, batches = started_workers(loader)
    os.kill(workers[0].pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(RuntimeError, match="exited unexpectedly|killed by signal"):
        for _ in batches:
            assert time.monotonic() - killed < 30, "no error 30 s after a worker was killed"
    took = time.monotonic() - killed
    bound = 12.0 if context == "forkserver" else 3.0
    assert took < bound, f"{context}: the error came {took:.1f} s after the worker died"
    loader.close()


@pytest.mark.processes
def test_a_script_that_leaves_an_iteration_open_exits_without_a_traceback(tmp_path):
    # the iteration's generators are closed at interpreter exit, when modules are torn down:
    # stopping its workers and its hang watchdog then must not raise
    script = tmp_path / "open.py"
    script.write_text(
        "import wdsvlm\n"
        'if __name__ == "__main__":\n'
        f"    loader = wdsvlm.Loader({EXAMPLE!r}, {TOKENIZER!r}, num_workers=2, **{SMALL!r})\n"
        "    batches = iter(loader)\n"
        "    next(batches)\n"
        '    print("one batch", flush=True)\n'
    )
    run = run_process(
        [sys.executable, str(script)], timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == "one batch\n"
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr
