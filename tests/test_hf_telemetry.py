"""The Loader's figures (``Loader.metrics()``, names under ``data/``) where users read them: in a
real ``wdsvlm.hf.Trainer``'s training logs every ``logging_steps`` (its log history, the
console, and the TensorBoard event file ``report_to="tensorboard"`` writes, read back), the
evaluation's logs and its own Loader leaving them as they are; and in the plain loop of
docs/monitoring.md."""

from __future__ import annotations

import math
import os
import re

import pytest
import transformers
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import wdsvlm
import wdsvlm.hf
from wdsvlm.pipeline.timing import STAGES
from wdsvlm.testing.tiny import tiny_model, tiny_processor

from .conftest import REPO
from .test_readme import run_python_example

DATA = os.path.join(REPO, "shards_example")
STEPS, EVERY = 4, 2  # max_steps, logging_steps (and eval_steps)
# the figures every training log carries (a stage's seconds: those of the stages that ran)
ALWAYS = ("data/steps", "data/wait_fraction", "data/wait_s", "data/samples_per_s")


@pytest.fixture(scope="module", params=[0, pytest.param(2, marks=pytest.mark.processes)])
def run(request, tmp_path_factory):
    """A Trainer run of ``STEPS`` steps on a Loader of 0 or 2 workers, logged every ``EVERY``
    to TensorBoard and evaluated as often on an evaluation Loader: its log history, console
    output and scalars."""
    tmp = tmp_path_factory.mktemp("telemetry")
    processor = tiny_processor("qwen2_5_vl")
    settings = dict(processor=processor, max_length=1024, batch_size=2)
    loader = wdsvlm.Loader(DATA, num_workers=request.param, **settings)
    validation = os.path.join(DATA, "shapes-000004.tar")
    evaluate = wdsvlm.Loader(validation, evaluation=True, **settings)
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "out"),
        max_steps=STEPS,
        logging_steps=EVERY,
        eval_strategy="steps",
        eval_steps=EVERY,
        report_to="tensorboard",  # into $TENSORBOARD_LOGGING_DIR (below)
        use_cpu=True,
        disable_tqdm=True,  # the Trainer prints each log on the console
        save_strategy="no",
    )
    model = tiny_model("qwen2_5_vl", processor)
    with pytest.MonkeyPatch.context() as env, _console() as console:
        env.setenv("TENSORBOARD_LOGGING_DIR", str(tmp / "tb"))  # read as the Trainer is made
        trainer = wdsvlm.hf.Trainer(model=model, args=args, loader=loader, eval_dataset=evaluate)
        trainer.train()
    loader.close()
    evaluate.close()
    events = EventAccumulator(str(tmp / "tb"))
    events.Reload()
    scalars = {
        tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]
    }
    return trainer.state.log_history, console.getvalue(), scalars


class _console:
    """What the Trainer prints (its ``PrinterCallback``), captured."""

    def __enter__(self):
        import contextlib
        import io

        self.out = io.StringIO()
        self.redirect = contextlib.redirect_stdout(self.out)
        self.redirect.__enter__()
        return self.out

    def __exit__(self, *exc):
        return self.redirect.__exit__(*exc)


def test_each_training_log_carries_the_loaders_figures_of_its_logging_steps(run):
    history, _, _ = run
    logs = [h for h in history if "loss" in h]
    assert [h["step"] for h in logs] == list(range(EVERY, STEPS + 1, EVERY))
    for log in logs:
        assert set(ALWAYS) <= set(log), sorted(log)
        assert log["data/steps"] == EVERY  # reset at each log: this interval's batches only
        assert 0 <= log["data/wait_fraction"] <= 1
        assert log["data/samples_per_s"] > 0 and log["data/wait_s"] >= 0
        assert all(isinstance(v, float) and math.isfinite(v) for k, v in log.items() if "/" in k)
        stages = [f"data/{s}_s" for s in STAGES if f"data/{s}_s" in log]
        assert "data/tokenize_s" in stages and "data/decode_image_s" in stages, sorted(log)
        assert all(log[s] >= 0 for s in stages)


def test_the_evaluations_logs_and_the_runs_summary_carry_no_data_figures(run):
    history, _, _ = run
    evals = [h for h in history if "eval_loss" in h]
    assert [h["step"] for h in evals] == list(range(EVERY, STEPS + 1, EVERY))
    others = [h for h in history if "loss" not in h]
    assert others and not any(k.startswith("data/") for h in others for k in h)


def test_the_figures_reach_tensorboard_and_the_console(run):
    history, console, scalars = run
    logged = {h["step"]: h for h in history if "loss" in h}
    for name in ALWAYS:
        # the Trainer's TensorBoard callback files a training log's keys under "train/"
        tag = f"train/{name}"
        assert tag in scalars, sorted(scalars)
        assert scalars[tag] == pytest.approx({s: h[name] for s, h in logged.items()}, rel=1e-6)
    assert "'data/wait_fraction'" in console and "'data/steps'" in console


def test_with_gradient_accumulation_a_logs_figures_count_every_batch_of_its_steps(tmp_path):
    processor = tiny_processor("qwen2_5_vl")
    loader = wdsvlm.Loader(DATA, processor=processor, max_length=1024, batch_size=2)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        logging_steps=1,
        gradient_accumulation_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
    )
    model = tiny_model("qwen2_5_vl", processor)
    trainer = wdsvlm.hf.Trainer(model=model, args=args, loader=loader)
    trainer.train()
    loader.close()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["data/steps"] for h in logs] == [2.0, 2.0]  # batches: 1 step x 2 accumulated


@pytest.mark.processes
def test_the_monitoring_pages_loop_prints_each_intervals_figures(monkeypatch, capsys):
    """docs/monitoring.md's loop: a toy model's steps on 2 workers; every 5 steps it prints
    the figures of the 5 steps since the previous call."""
    pattern = r"```python\n(# monitor.py\n.*?)```"
    scope = run_python_example("docs/monitoring.md", pattern, monkeypatch)
    loader = scope["train"]()
    lines = capsys.readouterr().out.splitlines()
    steps = len(loader)
    assert [line.split(":")[0] for line in lines] == [f"step {n}" for n in range(5, steps + 1, 5)]
    figures = [re.findall(r"(\d+(?:\.\d+)?)(?:%| samples/s| s)", line) for line in lines]
    assert all(len(f) == 4 for f in figures), lines
    assert all(0 <= float(f[0]) <= 100 and float(f[1]) > 0 for f in figures), lines
    # the workers decoded images and tokenized in some interval (the stages' seconds arrive)
    assert sum(float(f[2]) for f in figures) > 0 and sum(float(f[3]) for f in figures) > 0
    assert loader.metrics(reset=False)["data/steps"] == steps % 5  # since the last call
    loader.close()
