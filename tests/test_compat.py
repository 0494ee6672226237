"""wdsvlm.compat: a transformers without one of the private names wdsvlm.hf relies on fails
the check (run when wdsvlm.hf is imported) naming transformers, its version and the supported
range; the Trainer's epoch is found however it is passed."""

from __future__ import annotations

import functools
import inspect
import os
import re
import sys

import pytest
import transformers
import transformers.core_model_loading
import transformers.masking_utils
import transformers.trainer

from wdsvlm import compat
from wdsvlm.hf.trainer import LoaderTrainerMixin

from .conftest import REPO, run_process


def _drop_trainer_method(name):
    return lambda monkeypatch: monkeypatch.delattr(transformers.Trainer, name)


MISSING = {  # what the check names: how it is taken away
    **{f"Trainer.{name}": _drop_trainer_method(name) for name in compat.TRAINER_METHODS},
    "Trainer._run_epoch(epoch)": lambda monkeypatch: monkeypatch.setattr(
        transformers.Trainer, "_run_epoch", lambda self, *args, **kwargs: None
    ),
    "transformers.trainer.skip_first_batches": lambda monkeypatch: monkeypatch.delattr(
        transformers.trainer, "skip_first_batches"
    ),
    "ALL_MASK_ATTENTION_FUNCTIONS._global_mapping": lambda monkeypatch: monkeypatch.setattr(
        type(transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS), "_global_mapping", None
    ),
    "PretrainedConfig._attn_implementation": lambda monkeypatch: monkeypatch.delattr(
        transformers.PretrainedConfig, "_attn_implementation"
    ),
    "transformers.core_model_loading.revert_weight_conversion": lambda monkeypatch: (
        monkeypatch.delattr(transformers.core_model_loading, "revert_weight_conversion")
    ),
}


@pytest.mark.parametrize("what", list(MISSING))
def test_a_missing_private_name_fails_the_check_naming_version_and_range(monkeypatch, what):
    compat.trainer_internals()  # this transformers has them all
    MISSING[what](monkeypatch)
    message = (
        f"transformers {re.escape(transformers.__version__)} is not supported by wdsvlm: "
        f".*{re.escape(what)}.* is missing or changed "
        rf"\(supported: transformers {re.escape(compat.TRANSFORMERS_RANGE)}\)"
    )
    with pytest.raises(compat.UnsupportedVersionError, match=message):
        compat.trainer_internals()


@pytest.mark.processes
def test_the_check_runs_when_wdsvlm_hf_is_imported():
    code = "import transformers.trainer as t; del t.skip_first_batches; import wdsvlm.hf"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    run = run_process([sys.executable, "-c", code], timeout=120, env=env, cwd=REPO)
    assert run.returncode != 0
    assert "UnsupportedVersionError: transformers " in run.stderr, run.stderr[-3000:]
    assert "transformers.trainer.skip_first_batches is missing" in run.stderr
    assert compat.TRANSFORMERS_RANGE in run.stderr


def test_every_trainer_private_method_wdsvlm_hf_overrides_is_checked():
    overridden = {
        name
        for name in vars(LoaderTrainerMixin)
        if name.startswith("_") and not name.startswith("__")
    }
    assert overridden and overridden <= set(compat.TRAINER_METHODS)


def test_the_epoch_is_found_passed_by_position_or_by_keyword():
    run_epoch = functools.partial(transformers.Trainer._run_epoch, None)  # as if bound
    names = list(inspect.signature(run_epoch).parameters)
    values = {name: f"<{name}>" for name in names}
    values["epoch"] = 3
    positional = tuple(values[n] for n in names)
    assert compat.run_epoch_epoch(run_epoch, positional, {}) == 3
    assert compat.run_epoch_epoch(run_epoch, (), values) == 3
    assert compat.run_epoch_epoch(run_epoch, positional[:2], dict(list(values.items())[2:])) == 3


def test_the_names_give_what_wdsvlm_hf_reads_of_them():
    assert {"sdpa", "flash_attention_2"} <= compat.mask_attention_implementations()
    config = transformers.AutoConfig.for_model("llama", attn_implementation="sdpa")
    assert compat.attention_implementation(config) == "sdpa"


def test_the_torchvision_resize_is_the_processors_own_and_refuses_a_pil_processor():
    import torch

    from wdsvlm.testing.tiny import tiny_processor

    processor = tiny_processor("qwen2_vl", backend="torchvision").image_processor
    pixels = torch.arange(3 * 20 * 30, dtype=torch.int64).reshape(3, 20, 30).remainder(256)
    pixels = pixels.to(torch.uint8)
    got = compat.torchvision_resize(processor, pixels, 14, 28)
    assert got.shape == (3, 14, 28) and got.dtype == torch.uint8
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.image_utils import SizeDict

    size = SizeDict(height=14, width=28)
    assert torch.equal(got, TorchvisionBackend.resize(processor, pixels, size, processor.resample))
    with pytest.raises(TypeError, match="not a torchvision-backed processor"):
        compat.torchvision_resize(tiny_processor("qwen2_vl").image_processor, pixels, 14, 28)


@pytest.fixture
def fresh_video_check():
    compat.video_settings_not_sampling.cache_clear()
    yield
    compat.video_settings_not_sampling.cache_clear()


def test_the_video_processors_settings_not_for_sampling_are_read_from_its_preprocess(
    monkeypatch, fresh_video_check
):
    """What ``families/video.py`` keeps from ``sample_frames`` is what ``preprocess`` pops in
    this transformers; a ``preprocess`` that pops nothing before ``sample_frames`` (a version
    that moved them) fails the check naming transformers, its version and the range."""
    import transformers.video_processing_utils as vpu

    from wdsvlm.families.qwen_video import QwenVideo
    from wdsvlm.testing.qwen import qwen_processor

    popped = compat.video_settings_not_sampling()
    assert set(popped) == {
        "input_data_format",
        "do_convert_rgb",
        "do_sample_frames",
        "device",
        "video_metadata",
    }
    video = QwenVideo(qwen_processor("qwen2_vl"), "qwen2_vl")
    assert video.sampling and not set(popped) & set(video.sampling)
    compat.video_settings_not_sampling.cache_clear()

    def preprocess(self, videos, **kwargs):  # a version that pops them elsewhere
        return self._preprocess(videos, sample_indices_fn=self.sample_frames, **kwargs)

    monkeypatch.setattr(vpu.BaseVideoProcessor, "preprocess", preprocess)
    message = (
        f"transformers {re.escape(transformers.__version__)} is not supported by wdsvlm: "
        ".*popped before sample_frames.* is missing or changed "
        rf"\(supported: transformers {re.escape(compat.TRANSFORMERS_RANGE)}\)"
    )
    with pytest.raises(compat.UnsupportedVersionError, match=message):
        QwenVideo(qwen_processor("qwen2_vl"), "qwen2_vl")


def test_smolvlms_size_cap_is_its_modules_and_a_version_without_it_fails_the_check(monkeypatch):
    from wdsvlm.families.smolvlm import SmolVLMFamily
    from wdsvlm.testing.tiny import tiny_processor

    processor = tiny_processor("smolvlm")
    module = sys.modules[type(processor.image_processor).__module__]
    assert SmolVLMFamily(processor).max_side == module.MAX_IMAGE_SIZE == 4096
    monkeypatch.delattr(module, "MAX_IMAGE_SIZE")
    message = (
        f"transformers {re.escape(transformers.__version__)} is not supported by wdsvlm: "
        rf"{re.escape(module.__name__)}\.MAX_IMAGE_SIZE is missing or changed"
    )
    with pytest.raises(compat.UnsupportedVersionError, match=message):
        SmolVLMFamily(processor)


def test_an_install_without_transformers_sources_gets_the_known_video_settings(
    monkeypatch, fresh_video_check
):
    """Where ``preprocess``'s source cannot be read (an install of compiled or zipped
    modules: ``inspect.getsource`` raises ``OSError``), a supported transformers gets the
    settings known for its range, not an error saying they moved; outside the range the
    check still fails, naming the range."""

    from wdsvlm.families.qwen_video import QwenVideo
    from wdsvlm.testing.qwen import qwen_processor

    read = compat.video_settings_not_sampling()
    compat.video_settings_not_sampling.cache_clear()

    def no_source(obj):
        raise OSError("could not get source code")

    monkeypatch.setattr(inspect, "getsource", no_source)
    assert compat.video_settings_not_sampling() == read == compat.VIDEO_SETTINGS_NOT_SAMPLING
    video = QwenVideo(qwen_processor("qwen2_vl"), "qwen2_vl")
    assert video.sampling and not set(read) & set(video.sampling)
    compat.video_settings_not_sampling.cache_clear()
    compat.transformers_version.cache_clear()
    monkeypatch.setattr(transformers, "__version__", "6.0.0")
    try:
        with pytest.raises(compat.UnsupportedVersionError, match=r"transformers 6\.0\.0 .*>=5\.24"):
            compat.video_settings_not_sampling()
    finally:
        compat.transformers_version.cache_clear()
