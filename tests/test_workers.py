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
    """The processes that starting ``loader``'s workers (its first batch) added, and the
    running iterator."""
    before = {p.pid for p in multiprocessing.active_children()}
    batches = iter(loader)
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

    pickle.loads(payload)  # a worker's copy of the Loader's stream
    answer.put(os.environ.get("WDSVLM_TEST_PROBE"))


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
    assert answer.get(timeout=60) == "set after the server started"
    child.join(timeout=60)


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
