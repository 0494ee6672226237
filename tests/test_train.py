"""The main job, scripts/train_ddp.py, under torchrun with 2 processes: it trains, saves, and a
resumed run goes on with the very batches the uninterrupted run had."""

from __future__ import annotations

import math
import os
import re
import sys

import pytest

from .conftest import REPO, run_process

pytestmark = pytest.mark.processes


def train(out, *extra) -> str:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    script = os.path.join(REPO, "scripts", "train_ddp.py")
    command = [torchrun, "--standalone", "--nproc_per_node=2", script, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = run_process(
        [*command, "--epochs", "2", "--log-every", "2", "--print-keys", *extra],
        timeout=200,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def keys_by_step(log: str) -> dict[int, str]:
    return {int(s): k for s, k in re.findall(r"^step (\d+) keys (.*)$", log, re.M)}


def test_train_ddp_trains_and_resumes_with_the_same_batches(tmp_path):
    whole = train(tmp_path / "whole", "--max-steps", "8")
    losses = [float(x) for x in re.findall(r": loss (\d+\.\d+),", whole)]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]  # it learns
    assert re.search(r"^trained 8 steps in [\d.]+ s: loss [\d.]+ -> [\d.]+$", whole, re.M)
    assert re.search(r"fill (\d+\.\d)%", whole) and "waiting for data" in whole
    first = train(tmp_path / "part", "--max-steps", "3")
    assert "saved" in first and max(keys_by_step(first)) == 3
    resumed = train(tmp_path / "part", "--resume", "--max-steps", "8")
    assert "resumed at step 3" in resumed
    resumed_losses = [float(x) for x in re.findall(r": loss (\S+),", resumed)]
    assert len(resumed_losses) == 3 and all(math.isfinite(x) for x in resumed_losses)
    after = keys_by_step(resumed)
    assert sorted(after) == [4, 5, 6, 7, 8]
    assert after == {s: k for s, k in keys_by_step(whole).items() if s > 3}


@pytest.mark.parametrize("model", ["qwen2_5_vl-tiny", "smolvlm-tiny", "llava_onevision-tiny"])
def test_train_ddp_trains_a_transformers_architecture_on_packed_batches(tmp_path, model):
    log = train(tmp_path / model, "--model", model, "--max-steps", "12", "--workers", "1")
    losses = [float(x) for x in re.findall(r": loss (\d+\.\d+),", log)]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    first, last = re.search(
        r"^trained 12 steps in [\d.]+ s: loss ([\d.]+) -> ([\d.]+)$", log, re.M
    ).groups()
    assert float(last) < float(first) and losses[-1] < losses[0]  # it learns
    fills = [float(x) for x in re.findall(r"fill (\d+\.\d)%", log)]
    assert fills and min(fills) > 90  # packed
