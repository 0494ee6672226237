"""The README's copy-paste example runs and prints what the README shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from .conftest import REPO


def test_readme_quick_start_runs_as_shown(tmp_path):
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    match = re.search(r"```bash\n(mkdir -p /tmp/wds_demo.*?)```\n\n```\n(.*?)```", readme, re.S)
    assert match, "Quick start example not found in README.md"
    script, shown = match.groups()
    bin_dir = os.path.dirname(sys.executable) + "/"
    script = script.replace(".venv/bin/", bin_dir).replace("/tmp/wds_demo", str(tmp_path))
    run = subprocess.run(["bash", "-euc", script], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    shown = shown.replace("/tmp/wds_demo", str(tmp_path))
    got = [re.sub(r"in \d+\.\d s", "in T s", line) for line in run.stdout.splitlines()]
    want = [re.sub(r"in \d+\.\d s", "in T s", line) for line in shown.splitlines()]
    assert got == want


def test_readme_pipeline_example_runs(monkeypatch):
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    match = re.search(r"```python\n(import webdataset as wds\n.*?)```", readme, re.S)
    assert match, "pipeline example not found in README.md"
    monkeypatch.chdir(REPO)
    scope: dict = {}
    exec(compile(match.group(1), "README.md", "exec"), scope)  # noqa: S102 - our own README
    assert scope["stats"].counts == {}
    sample = scope["sample"]  # the last one the loop saw
    assert sample["pixel_values"].shape[0] == sum(sample["image_tiles"]) > 0


def test_readme_loader_example_runs(monkeypatch, capsys):
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    match = re.search(r"```python\n(import wdsvlm\n\nloader = wdsvlm.Loader\(.*?)```", readme, re.S)
    assert match, "Loader example not found in README.md"
    monkeypatch.chdir(REPO)
    scope: dict = {}
    exec(compile(match.group(1), "README.md", "exec"), scope)  # noqa: S102 - our own README
    assert scope["loader"].stats()["samples"] == 320
    assert "'fill': 0.9" in capsys.readouterr().out
