"""The Loader as a Trainer's train dataloader (``LoaderFeed``): this rank's batches as they are,
turned into the model's forward arguments, with ``len`` and ``set_epoch`` of the Loader."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

from .. import compat
from ..errors import WdsvlmError
from ..families.inputs import model_inputs

# the fields of a default-tiling batch handed to a model whose forward takes **kwargs
TILING_FIELDS = ("input_ids", "labels", "position_ids", "pixel_values", "image_tiles")


class LoaderFeed:
    """What the Trainer iterates in place of a DataLoader: not wrapped by Accelerate (each rank
    takes its own batches from its Loader, which already splits the data across ranks), no
    sampler, no collator.

    A batch of a processor's family goes through ``wdsvlm.model_inputs`` (pixels normalised on
    ``device``); a batch of the default tiling gives the model the fields its ``forward``
    names (``TILING_FIELDS`` if it takes ``**kwargs``), uint8 pixels as they are. Either is
    timed as the Loader's work in the training process (``data/loader_s``), not the model's.
    """

    def __init__(self, loader: Any, device: Any, model: Any):
        self.loader = loader
        self.device = device
        self.fields = None if loader.family.name != "tiling" else tiling_fields(model)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[dict]:
        for batch in self.loader:
            yield self.inputs(batch)

    def inputs(self, batch: dict) -> dict:
        # the Loader's work in the training process, not the model's: its figures count it so
        with self.loader._meter.work():
            if self.fields is None:
                return model_inputs(batch, device=self.device)
            return {k: batch[k] for k in self.fields if k in batch}

    def check_position(self, epoch: int, batches: int) -> LoaderFeed:
        """The Trainer resumes at batch ``batches`` of ``epoch``: the Loader, restored from the
        checkpoint, stands there already, so nothing is skipped (checked)."""
        here = (self.loader.epoch, self.loader.batches_done)
        if here != (epoch, batches):
            raise WdsvlmError(
                f"the Trainer resumes at batch {batches} of epoch {epoch}, but the Loader's state "
                f"in the checkpoint stands at batch {here[1]} of epoch {here[0]}: was the "
                "checkpoint saved with other gradient_accumulation_steps, another number of "
                "ranks or another Loader length (batches_per_epoch)?"
            )
        return self


def tiling_fields(model: Any) -> tuple[str, ...]:
    """The batch fields a model of the default tiling takes: those its forward names."""
    forward = getattr(model, "forward", model)
    params = inspect.signature(forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return TILING_FIELDS
    fields = tuple(k for k in TILING_FIELDS if k in params)
    if "input_ids" not in fields:
        raise WdsvlmError(
            f"{type(model).__name__}.forward takes none of the batch's fields "
            f"({', '.join(TILING_FIELDS)}): a Loader of the default tiling gives the model "
            "these by name"
        )
    return fields


def positioned_skip(feed: LoaderFeed, epoch: int) -> contextlib.AbstractContextManager:
    """While ``epoch`` runs, the Trainer's ``skip_first_batches`` on the feed checks that the
    restored Loader stands where the Trainer resumes instead of skipping batches (the Trainer
    would otherwise replay the data to skip what the checkpoint took)."""

    def skip_first_batches(original: Any, dataloader: Any, num_batches: int) -> Any:
        if dataloader is feed:
            return feed.check_position(epoch, num_batches)
        return original(dataloader, num_batches)

    return compat.trainer_skip_first_batches(skip_first_batches)
