"""The one home of what wdsvlm uses of other libraries that they do not promise: private names
of CPython, torch and transformers.

Each part of wdsvlm that needs one of these calls its check here when it is imported (or, for
a library imported lazily, when it first needs it), so that a version that moved or removed
the name fails at once, with the library, its version and the range wdsvlm is tested with,
never hours into a run at the first checkpoint. Nothing else in the package touches these
names: the functions below are the only way to them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

from .errors import WdsvlmError


class UnsupportedVersionError(WdsvlmError):
    """A library's installed version lacks what wdsvlm relies on."""


def unsupported(library: str, version: str, tested: str, what: str) -> UnsupportedVersionError:
    """The error for ``library`` at ``version`` lacking ``what``; ``tested``: the supported
    range."""
    return UnsupportedVersionError(
        f"{library} {version} is not supported by wdsvlm: {what} is missing or changed "
        f"(supported: {library} {tested}); install a version in that range"
    )


def _require(library: str, version: str, tested: str, what: str, found: Any) -> Any:
    if found is None:
        raise unsupported(library, version, tested, what)
    return found


# The ranges each group of names below was checked against.
CPYTHON_RANGE = ">=3.10,<3.15"
TORCH_RANGE = ">=2.13,<3"
TRANSFORMERS_RANGE = ">=5.24,<6"


@functools.cache
def transformers_version() -> str:
    import transformers

    return transformers.__version__


# ---- CPython: multiprocessing's fork server, the C library ------------------------------------


def _python_version() -> str:
    import platform

    return platform.python_version()


@functools.cache
def check_forkserver() -> None:
    """The fork server's private attributes the Loader's workers read (``loader/workers.py``):
    the modules it preloads, and the write end of its "alive" pipe each of its children holds."""
    from multiprocessing import forkserver

    server = _require(
        "Python",
        _python_version(),
        CPYTHON_RANGE,
        "multiprocessing.forkserver._forkserver",
        getattr(forkserver, "_forkserver", None),
    )
    for name in ("_preload_modules", "_forkserver_alive_fd"):
        if name not in vars(server):
            raise unsupported(
                "Python", _python_version(), CPYTHON_RANGE, f"the fork server's {name}"
            )


def forkserver_preload() -> list[str]:
    """The modules this process's fork server is set to import before it forks."""
    from multiprocessing import forkserver

    check_forkserver()
    preload = forkserver._forkserver._preload_modules
    return list(preload if preload is not None else ["__main__"])


def close_forkserver_alive_fd() -> None:
    """In a process the fork server started: close its copy of the server's "alive" pipe, so
    that the server exits once the training process (the only other holder) is gone."""
    from multiprocessing import forkserver

    check_forkserver()
    server = forkserver._forkserver
    alive = server._forkserver_alive_fd
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None  # a server this worker would start is its own


@functools.cache
def libc() -> Any:
    """The C library (Linux: ``madvise``, ``prctl`` are called through it), loaded once."""
    if sys.platform != "linux":
        return None
    try:
        found = ctypes.CDLL(None, use_errno=True)
        found.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        found.madvise.restype = ctypes.c_int
    except (OSError, AttributeError):  # no C library to call
        return None
    return found


def subcommands(parser: Any) -> Any:
    """The sub-parsers of an ``argparse`` parser (what its ``add_subparsers`` returned), so
    that a subcommand can be added to a parser built elsewhere (argparse keeps them in the
    private ``_actions``, as ``_SubParsersAction``)."""
    import argparse

    kind = getattr(argparse, "_SubParsersAction", None)
    found = [a for a in getattr(parser, "_actions", []) if kind and isinstance(a, kind)]
    what = "argparse's _actions and _SubParsersAction"
    return _require("CPython", _python_version(), CPYTHON_RANGE, what, found[0] if found else None)


# ---- torch: shared memory made at once, stopping a DataLoader's workers now -------------------


def _torch_version() -> str:
    import torch

    return torch.__version__


@functools.cache
def check_torch() -> None:
    """The private names of torch the Loader uses, there and callable."""
    import torch
    from torch.utils.data import dataloader

    wanted = {
        "torch.UntypedStorage._new_shared": getattr(torch.UntypedStorage, "_new_shared", None),
        "torch.utils.data.dataloader._MultiProcessingDataLoaderIter._shutdown_workers": getattr(
            getattr(dataloader, "_MultiProcessingDataLoaderIter", None), "_shutdown_workers", None
        ),
    }
    for what, found in wanted.items():
        if not callable(found):
            raise unsupported("torch", _torch_version(), TORCH_RANGE, what)


def new_shared_storage(nbytes: int) -> Any:
    """An uninitialised ``torch.UntypedStorage`` of ``nbytes`` made in shared memory at once
    (``share_memory_()`` on a private one would fault in and copy a private buffer first)."""
    import torch

    check_torch()
    return torch.UntypedStorage._new_shared(nbytes)


def shutdown_workers(batches: Any) -> None:
    """Stop a DataLoader iterator's worker processes now and free what they hold (torch does
    this when the iterator is collected, which may be much later)."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is None:  # an iterator without workers has none
        return
    try:
        shutdown()
    except RuntimeError:
        # A worker that dies while it stops (one busy mid-batch may abort at exit) trips
        # torch's SIGCHLD handler inside the shutdown, cutting it short: they were told to
        # stop, so stop the rest here and say nothing.
        for worker in getattr(batches, "_workers", ()):
            if worker.is_alive():
                worker.terminate()
            worker.join(timeout=5)


def ready_batches(batches: Any) -> int:
    """Batches a DataLoader iterator's workers made, queued or come early, not yet taken."""
    try:
        return batches._data_queue.qsize() + sum(len(t) == 2 for t in batches._task_info.values())
    except (AttributeError, NotImplementedError, OSError):  # no workers; macOS: no qsize()
        return 0  # cannot tell


# ---- transformers: the Trainer's private methods, the attention and weight-name registries --
# wdsvlm.hf overrides (by name) and calls the Trainer's private methods below, swaps the
# module-level skip_first_batches of transformers.trainer while an epoch runs, reads the
# registry of attention implementations that build a mask and a config's attention
# implementation, and maps a model's weights to the names save_pretrained writes.
# trainer_internals() checks them all when wdsvlm.hf is imported.

# The Trainer's private methods wdsvlm.hf overrides or calls, with the arguments it relies on.
TRAINER_METHODS = {
    "_run_epoch": ("epoch",),
    "_get_output_dir": ("trial",),
    "_save_checkpoint": ("model", "trial"),
    "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
    "_get_num_items_in_batch": ("batch_samples", "device"),
}


def _transformers(what: str, found: Any) -> Any:
    return _require("transformers", transformers_version(), TRANSFORMERS_RANGE, what, found)


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def torchvision_resize(processor: Any, pixels: Any, height: int, width: int) -> Any:
    """``pixels`` (uint8 ``[..., 3, H, W]``) resized to ``height x width`` by the resize of a
    torchvision-backed image or video processor's backend class (transformers'
    ``TorchvisionBackend``, which the model classes wrap with their own sizing), with the
    processor's ``resample``: the processor's pixels, bit for bit."""
    from transformers.image_utils import SizeDict

    backends = _module("transformers.image_processing_backends")
    backend = _transformers(
        "transformers.image_processing_backends.TorchvisionBackend",
        getattr(backends, "TorchvisionBackend", None),
    )
    if not isinstance(processor, backend):
        raise TypeError(f"{type(processor).__name__} is not a torchvision-backed processor")
    size = SizeDict(height=height, width=width)
    return backend.resize(processor, pixels, size, resample=processor.resample)


def smolvlm_video_template() -> str:
    """The chat template SmolVLM's processor renders a conversation with a video by when no
    template is asked for (``apply_chat_template`` switches to it; the published templates
    have no video)."""
    module = _module("transformers.models.smolvlm.processing_smolvlm")
    found = getattr(module, "DEFAULT_CHAT_TEMPLATE", None)
    return _transformers(
        "transformers.models.smolvlm.processing_smolvlm.DEFAULT_CHAT_TEMPLATE", found
    )


# What ``BaseVideoProcessor.preprocess`` pops before ``sample_frames`` in TRANSFORMERS_RANGE.
VIDEO_SETTINGS_NOT_SAMPLING = (
    "input_data_format",
    "do_convert_rgb",
    "do_sample_frames",
    "device",
    "video_metadata",
)


def _transformers_in_range() -> bool:
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(TRANSFORMERS_RANGE, prereleases=True).contains(transformers_version())


@functools.cache
def video_settings_not_sampling() -> tuple[str, ...]:
    """The settings ``BaseVideoProcessor.preprocess`` pops before it hands the rest to
    ``sample_frames`` (``families/video.py`` hands ``sample_frames`` the same rest), read from
    the source of ``preprocess`` itself: every ``kwargs.pop("...")`` before ``sample_frames``
    (in 5.24: ``VIDEO_SETTINGS_NOT_SAMPLING``). An install without transformers' ``.py``
    sources (compiled or zipped) gets ``VIDEO_SETTINGS_NOT_SAMPLING`` on a version in
    ``TRANSFORMERS_RANGE``; a readable source that differs fails the check."""
    module = _module("transformers.video_processing_utils")
    preprocess = getattr(getattr(module, "BaseVideoProcessor", None), "preprocess", None)
    try:
        source = inspect.getsource(preprocess) if preprocess is not None else ""
    except (OSError, TypeError):  # no source to read: the version decides
        if preprocess is not None and _transformers_in_range():
            return VIDEO_SETTINGS_NOT_SAMPLING
        source = ""
    head, found, _ = source.partition("self.sample_frames")
    popped = tuple(re.findall(r"""kwargs\.pop\(["'](\w+)["']""", head)) if found else ()
    what = "the settings popped before sample_frames in BaseVideoProcessor.preprocess"
    return _transformers(what, popped if "do_sample_frames" in popped else None)


def smolvlm_max_image_size(image_processor: Any) -> int:
    """``MAX_IMAGE_SIZE`` of the module of a SmolVLM/Idefics3 image processor: the side both
    sides of a resized image are capped at (4096 in 5.24)."""
    module = sys.modules.get(type(image_processor).__module__)
    found = getattr(module, "MAX_IMAGE_SIZE", None)
    what = f"{type(image_processor).__module__}.MAX_IMAGE_SIZE"
    return int(_transformers(what, found if isinstance(found, int) else None))


def trainer_internals() -> None:
    """Check every private name of transformers that wdsvlm.hf uses; an
    ``UnsupportedVersionError`` names the first one missing."""
    import transformers

    trainer_methods(transformers.Trainer)
    _trainer_module()
    mask_attention_implementations()
    _attention_property()
    _weight_reverter()


def trainer_methods(trainer_class: type) -> None:
    """``trainer_class`` has each of ``TRAINER_METHODS``, taking the arguments named there."""
    for name, arguments in TRAINER_METHODS.items():
        method = getattr(trainer_class, name, None)
        try:
            takes = set(inspect.signature(method).parameters) if callable(method) else set()
        except (TypeError, ValueError):
            takes = set()
        found = method if set(arguments) <= takes else None
        _transformers(f"{trainer_class.__name__}.{name}({', '.join(arguments)})", found)


def run_epoch_epoch(run_epoch: Callable, args: tuple, kwargs: dict) -> int:
    """The epoch a call ``run_epoch(*args, **kwargs)`` of the Trainer's ``_run_epoch`` (bound)
    is for, passed by position or by keyword."""
    arguments = inspect.signature(run_epoch).bind(*args, **kwargs).arguments
    return _transformers("the epoch argument of Trainer._run_epoch", arguments.get("epoch"))


def trainer_output_dir(trainer: Any, trial: Any) -> str:
    """The folder the Trainer saves its checkpoints of ``trial`` in."""
    return trainer._get_output_dir(trial=trial)


def _trainer_module() -> Any:
    module = _module("transformers.trainer")
    found = module if callable(getattr(module, "skip_first_batches", None)) else None
    return _transformers("transformers.trainer.skip_first_batches", found)


@contextlib.contextmanager
def trainer_skip_first_batches(replacement: Callable[[Callable, Any, int], Any]) -> Iterator[None]:
    """While the block runs, the Trainer's ``skip_first_batches(dataloader, num_batches)`` is
    ``replacement(original, dataloader, num_batches)``."""
    module = _trainer_module()
    original = module.skip_first_batches

    def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
        return replacement(original, dataloader, num_batches)

    module.skip_first_batches = skip_first_batches
    try:
        yield
    finally:
        module.skip_first_batches = original


def mask_attention_implementations() -> set[str]:
    """The attention implementations transformers builds an attention mask for."""
    functions = getattr(_module("transformers.masking_utils"), "ALL_MASK_ATTENTION_FUNCTIONS", None)
    mapping = getattr(functions, "_global_mapping", None)
    found = mapping if isinstance(mapping, dict) else None
    what = "transformers.masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping"
    return set(_transformers(what, found))


def _attention_property() -> property:
    config = getattr(_module("transformers"), "PretrainedConfig", None)
    found = getattr(config, "_attn_implementation", None)
    what = "PretrainedConfig._attn_implementation"
    return _transformers(what, found if isinstance(found, property) else None)


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a model's (text) config asks for; None if it names none."""
    _attention_property()
    return getattr(config, "_attn_implementation", None)


def _weight_reverter() -> Callable:
    module = _module("transformers.core_model_loading")
    found = getattr(module, "revert_weight_conversion", None)
    return _transformers("transformers.core_model_loading.revert_weight_conversion", found)


def revert_weight_conversion(model: Any, state_dict: dict) -> dict:
    """``state_dict`` (the model's own) under the names ``model.save_pretrained`` writes."""
    return _weight_reverter()(model, state_dict)


def model_from_config(model_class: type, config: Any, **options: Any) -> Any:
    """A model of ``model_class`` with random weights from ``config``, built with ``options``
    (``attn_implementation``, ``dtype``) as ``from_pretrained`` would build it
    (``wdsvlm.testing``'s tiny models)."""
    build = _transformers(
        f"{model_class.__name__}._from_config", getattr(model_class, "_from_config", None)
    )
    return build(config, **options)
