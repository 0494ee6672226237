"""The user's own steps in the pipeline: ``map`` on each sample before tokenization
(``SampleMap``, run by ``Tokenize``) and ``image_map`` on each decoded image (``ImageMap``,
run by ``Collate``).

Each call gets a ``numpy.random.Generator`` seeded from the loader's seed and the sample's
place (its pass and its place in the pass's global order; for an image, also its index),
hashed as the pass's order hashes its seed (``order.seeded_rng``), so an augmentation draws
the same numbers for a sample on any topology, after a resume and when a stage takes a held
sample again, and other numbers in the next pass.

``check_workers_get`` refuses, when the Loader is built, a function that DataLoader workers
could not get.
"""

from __future__ import annotations

import copy
import io
import os
import sys
import traceback
import types
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import WdsvlmError
from ..format.images import image_members
from .order import seeded_rng
from .stats import SkipStats, sample_name

MAP_ERRORS = ("skip", "raise")
_SAMPLE, _IMAGE = 0, 1  # the two streams of random numbers of a sample


class MapFailed(Exception):
    """The user's function raised on a sample, and ``map_errors="skip"``: skip it."""


def rng_for(seed: int, sample: dict, *more: int) -> np.random.Generator:
    """The generator of one call: from (seed, pass, place in the pass, ``more``); a sample read
    outside a pass's order (the Loader's sizing reads a few) by its key instead."""
    pos = sample.get("__pos__")
    if pos is None:
        pos = 2**40 + zlib.crc32(sample_name(sample).encode())
    return seeded_rng("wdsvlm-map", seed, sample.get("__pass__") or 0, pos, *more)


_FORK = ', or multiprocessing_context="fork" if no thread runs in this process when workers start'


def check_workers_get(fn: Callable, setting: str, start_method: str) -> None:
    """Refuse, naming it and the fixes, a ``map``/``image_map`` (``setting``) that DataLoader
    workers started with ``start_method`` could not get (they would fail as they start).
    ``spawn`` and ``forkserver`` workers get it pickled, so by reference: a lambda or a nested
    function cannot be pickled, and a function or class of ``__main__`` is not found in a
    worker when ``__main__`` has no file the workers import (a notebook, ``python -c``, an
    interactive interpreter). ``fork`` workers inherit it as it is."""
    if start_method == "fork":
        return
    from multiprocessing.reduction import ForkingPickler

    of_main: list[Any] = []  # the functions and classes it is pickled with that live in __main__

    class Pickler(ForkingPickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, (type, types.FunctionType)) and obj.__module__ == "__main__":
                of_main.append(obj)
            return NotImplemented

    name = getattr(fn, "__qualname__", None) or repr(fn)
    workers = f"DataLoader workers started with multiprocessing_context={start_method!r}"
    try:
        Pickler(io.BytesIO()).dump(fn)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same
        raise ValueError(
            f"{setting}={name} cannot be pickled ({type(e).__name__}: {e}), and {workers} get "
            "it pickled: define it at the top level of a module (not a lambda or a nested "
            f"function), or use num_workers=0{_FORK}"
        ) from None
    if of_main and not _workers_import_main():
        where = "is defined" if of_main[0] is fn else f"uses __main__.{of_main[0].__qualname__}"
        raise ValueError(
            f"{setting}={name} {where} in __main__ (a notebook, `python -c` or an interactive "
            f"interpreter), which {workers} cannot import: they would fail as they start. "
            "Define it in a module they can import (a .py file, imported here), or use "
            f"num_workers=0{_FORK}"
        )


def _workers_import_main() -> bool:
    """Whether a ``spawn`` or fork server worker imports this process's ``__main__`` (as
    ``multiprocessing.spawn`` decides): from a script's file or a ``-m`` module, not from a
    package's ``__main__.py``, nor where there is no file (a notebook, ``python -c``)."""
    main = sys.modules.get("__main__")
    module = getattr(getattr(main, "__spec__", None), "name", None)
    if module is not None:
        return module != "__main__" and not module.endswith(".__main__")
    path = getattr(main, "__file__", None)
    return path is not None and os.path.splitext(os.path.basename(path))[0] != "ipython"


class UserStep:
    """The user's function ``fn`` with the loader's ``seed`` and what its exceptions do.
    ``clock`` (a ``timing.StageClock``, set by the Loader's stream in each worker): where
    its calls' time is charged, as the stage named ``kind``."""

    kind = "map"
    clock = None

    def __init__(self, fn: Callable, seed: int, errors: str = "skip"):
        if errors not in MAP_ERRORS:
            raise ValueError(f"map_errors must be one of {MAP_ERRORS}, not {errors!r}")
        self.fn, self.seed, self.errors = fn, seed, errors

    @property
    def name(self) -> str:
        return f"{self.kind} {getattr(self.fn, '__qualname__', repr(self.fn))}"

    def failure(self, e: BaseException, sample: dict) -> str:
        """``"KIND FN raised on SHARD/KEY: ERROR (at FILE:LINE in FUNCTION: CODE)"``: the error
        and the last line of its traceback."""
        frames = traceback.extract_tb(e.__traceback__)
        at = ""
        if frames:
            last = frames[-1]
            at = f" (at {last.filename}:{last.lineno} in {last.name}: {last.line})"
        return f"{self.name} raised on {sample_name(sample)}: {type(e).__name__}: {e}{at}"

    def run(self, sample: dict, *args: Any) -> Any:
        """``fn(*args)`` on ``sample``'s behalf; an exception becomes ``MapFailed`` (to skip
        the sample) or, with ``map_errors="raise"``, a ``WdsvlmError``; both name it."""
        try:
            if self.clock is None:
                return self.fn(*args)
            with self.clock.stage(self.kind):
                return self.fn(*args)
        except Exception as e:  # noqa: BLE001 - the user's code: skipped or raised as asked
            detail = self.failure(e, sample)
            if self.errors == "raise":
                raise WdsvlmError(detail) from e
            raise MapFailed(detail) from e


class SampleMap(UserStep):
    """``map=fn``: ``fn(sample, rng)`` on each sample before it is tokenized.

    ``sample`` is the stored JSON record (``messages`` and whatever else it holds, such as
    ``source`` or ``id``) with ``__key__``, ``__shard__``, ``__images__`` (the stored image
    bytes, in order) and ``__meta__`` (the sample's index entry: image sizes, ...) added, and
    ``__source__`` for a mixture's samples. ``fn`` returns the sample (changed or not; its
    ``messages`` are tokenized) or None to drop it (counted as ``filtered``). An exception,
    or messages that cannot be tokenized, skip the sample as ``map_error``
    (``map_errors="skip"``) or stop the run (``"raise"``).
    """

    def __call__(
        self,
        record: dict,
        sample: dict,
        stats: SkipStats,
        messages_of: Callable[[dict], Any] | None = None,
    ) -> Any:
        """The record to tokenize, or None if it is dropped or skipped (counted in ``stats``).
        With ``messages_of`` (the tokenizer's, raising ``KeyError``, ``TypeError`` or
        ``ValueError`` on messages it cannot take): what it makes of that record."""
        view = dict(record)
        view.update(
            __key__=sample.get("__key__"),
            __shard__=sample.get("__shard__"),
            __images__=[sample[name] for name in image_members(sample)],
            __meta__=copy.deepcopy(sample.get("__meta__", {})),  # the plan's own stays as is
        )
        if "__source__" in sample:
            view["__source__"] = sample["__source__"]
        try:
            out = self.run(sample, view, rng_for(self.seed, sample, _SAMPLE))
        except MapFailed as e:
            stats.skip("tokenize", "map_error", sample, str(e))
            return None
        if out is None:
            stats.skip("tokenize", "filtered", sample, "map returned None", streak=False)
            return None
        if not isinstance(out, dict) or "messages" not in out:
            raise WdsvlmError(
                f"{self.name} returned {type(out).__name__} for {sample_name(sample)}: it must "
                "return the sample (a dict with its messages) or None to drop it"
            )
        if messages_of is None:
            return out
        try:
            return messages_of(out)
        except (KeyError, TypeError, ValueError) as e:
            detail = (
                f"{self.name} returned messages that cannot be tokenized for "
                f"{sample_name(sample)}: {type(e).__name__}: {e} (they must be a list of "
                '{"role": ..., "content": str})'
            )
            if self.errors == "raise":
                raise WdsvlmError(detail) from e
            stats.skip("tokenize", "map_error", sample, detail)
            return None


class ImageMap(UserStep):
    """``image_map=fn``: ``fn(pixels, rng)`` on each image once decoded, before the family
    resizes and tiles it: ``pixels`` is a writable uint8 array ``[height, width, 3]`` (RGB,
    as displayed); ``fn`` returns an array of the same shape (the image's tokens were planned
    from its size: another size is an error naming the sample). An exception skips the sample
    as ``map_error`` (its row pads instead) or stops the run, as ``map_errors`` says."""

    kind = "image_map"

    def for_sample(self, sample: dict) -> Callable[[int, Any], Any]:
        """``edit(index, image)``: a PIL image to the PIL image ``fn`` makes of it."""
        from PIL import Image

        def edit(index: int, image: Any) -> Any:
            pixels = np.array(image, dtype=np.uint8)  # a writable copy
            out = np.asarray(self.run(sample, pixels, rng_for(self.seed, sample, _IMAGE, index)))
            if out.shape != pixels.shape or out.dtype != np.uint8:
                raise WdsvlmError(
                    f"{self.name} made image {index} of {sample_name(sample)} {out.dtype} "
                    f"{tuple(out.shape)} from uint8 {tuple(pixels.shape)}: it must keep the size "
                    "and dtype (the image's tokens were planned from its size)"
                )
            return Image.fromarray(out, "RGB")

        return edit
