"""The user's own steps in the pipeline: ``map`` on each sample before tokenization
(``SampleMap``, run by ``Tokenize``) and ``image_map`` on each decoded image (``ImageMap``,
run by ``Collate``).

Each call gets a ``numpy.random.Generator`` seeded from the loader's seed and the sample's
place (its pass and its place in the pass's global order; for an image, also its index), so
an augmentation draws the same numbers for a sample on any topology, after a resume and when a
stage takes a held sample again, and other numbers in the next pass.
"""

from __future__ import annotations

import copy
import traceback
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import WdsvlmError
from ..format.images import image_members
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
    return np.random.default_rng([seed, sample.get("__pass__") or 0, pos, *more])


class UserStep:
    """The user's function ``fn`` with the loader's ``seed`` and what its exceptions do."""

    kind = "map"

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
    ``messages`` are tokenized) or None to drop it (counted as ``filtered``). An exception
    skips the sample as ``map_error`` (``map_errors="skip"``) or stops the run (``"raise"``).
    """

    def __call__(self, record: dict, sample: dict, stats: SkipStats) -> dict | None:
        """The record to tokenize, or None if it is dropped or skipped (counted in ``stats``)."""
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
        return out


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
