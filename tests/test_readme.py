"""The examples of README.md and of the docs pages run and print what they show."""

from __future__ import annotations

import os
import re
import sys

import pytest

from .conftest import REPO, run_process


def doc_blocks(page: str, pattern: str) -> tuple[str, ...]:
    """The groups of ``pattern`` in ``page`` (a path from the repository's top level)."""
    with open(os.path.join(REPO, page)) as f:
        match = re.search(pattern, f.read(), re.S)
    assert match, f"example {pattern!r} not found in {page}"
    return match.groups()


def run_python_example(page: str, pattern: str, monkeypatch) -> dict:
    """Run a Python block of ``page`` in the repository root, as an imported module would
    (``__name__`` is not ``"__main__"``); its variables afterwards."""
    (code,) = doc_blocks(page, pattern)
    with open(os.path.join(REPO, page)) as f:
        above = f.read().split(code)[0].count("\n")  # tracebacks then name the page's lines
    monkeypatch.chdir(REPO)
    scope: dict = {"__name__": "example"}
    exec(compile("\n" * above + code, page, "exec"), scope)  # noqa: S102 - our own documentation
    return scope


@pytest.mark.processes
def test_readme_quick_start_writes_and_prints_as_shown(tmp_path):
    pattern = r"```bash\n(mkdir -p /tmp/wds_demo.*?)```\n\n```\n(.*?)```"
    script, shown = doc_blocks("README.md", pattern)
    bin_dir = os.path.dirname(sys.executable) + "/"
    script = script.replace(".venv/bin/", bin_dir).replace("/tmp/wds_demo", str(tmp_path))
    run = run_process(["bash", "-euc", script], timeout=240)
    assert run.returncode == 0, run.stderr
    shown = shown.replace("/tmp/wds_demo", str(tmp_path))
    got = [re.sub(r"in \d+\.\d s", "in T s", line) for line in run.stdout.splitlines()]
    want = [re.sub(r"in \d+\.\d s", "in T s", line) for line in shown.splitlines()]
    assert got == want


@pytest.mark.processes
def test_readme_training_loop_trains_on_every_sample(monkeypatch, capsys):
    scope = run_python_example("README.md", r"```python\n(# train_quick.py\n.*?)```", monkeypatch)
    loader = scope["train"](epochs=1)
    # an epoch is one pass over the 320 samples and a little of the next (carried over)
    assert 320 <= loader.stats()["samples"] <= 1.25 * 320
    assert "'fill': 0.9" in capsys.readouterr().out  # packed rows at least 90% full


@pytest.mark.processes
def test_loading_page_loader_example_runs(monkeypatch, capsys):
    pattern = r"```python\n(import wdsvlm\n\nloader = wdsvlm.Loader\(.*?)```"
    scope = run_python_example("docs/loading.md", pattern, monkeypatch)
    # an epoch is one pass over the 320 samples and a little of the next (carried over)
    assert 320 <= scope["loader"].stats()["samples"] <= 1.25 * 320
    assert "'fill': 0.9" in capsys.readouterr().out


@pytest.mark.processes
def test_loading_page_pipeline_example_runs(monkeypatch):
    pattern = r"```python\n(import webdataset as wds\n.*?)```"
    scope = run_python_example("docs/loading.md", pattern, monkeypatch)
    assert scope["stats"].counts == {}
    sample = scope["sample"]  # the last one the loop saw
    assert sample["pixel_values"].shape[0] == sum(sample["image_tiles"]) > 0


@pytest.mark.processes
def test_training_page_torchrun_loop_trains_and_resumes(tmp_path):
    (code,) = doc_blocks("docs/training.md", r"```python\n(# train_min.py\n.*?)```")
    (tmp_path / "train_min.py").write_text(code)
    os.symlink(os.path.join(REPO, "shards_example"), tmp_path / "shards_example")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    runs = []
    for epochs, processes in (("1", 2), ("2", 1)):  # the resume is onto another topology
        command = [torchrun, "--standalone", f"--nproc_per_node={processes}", "train_min.py"]
        env = {**os.environ, "EPOCHS": epochs, "OMP_NUM_THREADS": "1"}
        run = run_process(command, timeout=200, cwd=tmp_path, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        runs.append(run.stdout)
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", runs[0] + runs[1])]
    assert losses and all(0 < x < 20 for x in losses)
    assert "epoch 0 batch" in runs[0] and "epoch 1 batch" not in runs[0]
    # the second run starts where the first one's checkpoint stands: the end of epoch 0
    assert re.search(r"rank 0: resumed in epoch 0 after batch (\d+)", runs[1])
    assert "epoch 1 batch" in runs[1] and "epoch 0 batch" not in runs[1]


def test_readme_processor_example_prints_as_shown(monkeypatch, capsys):
    pattern = r"```python\n(import wdsvlm\nfrom wdsvlm.testing.tiny import .*?)```"
    scope = run_python_example("README.md", pattern, monkeypatch)
    (shown,) = doc_blocks("README.md", r"print\(batch\[\"position_ids\"\].*?\n# (.*?)\n```")
    assert capsys.readouterr().out.strip() == shown
    assert scope["batch"]["family"] == "qwen2_5_vl"
