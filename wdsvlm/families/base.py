"""The Family interface: everything the pipeline stages ask of a way of turning images into
tokens and pixels.

Every stage talks to one family object: the default nanoVLM-style tiling (``tiling.py``,
chosen when the Loader gets a tokenizer) or a Hugging Face processor's family (``qwen.py``,
``smolvlm.py``, chosen by ``registry.family_of``). A family answers from an image's size
alone how many vision units (tiles, patches) it costs and which token ids stand for it, so
packing works on index metadata; at decode time it writes the image's units, uint8
``[cost, 3, S, S]``, into the batch's tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ..format.images import image_members

if TYPE_CHECKING:
    import numpy as np
    import torch


@runtime_checkable
class Family(Protocol):
    """What Tokenize, DecodeImages, Collate, the Loader and ``model_inputs`` call."""

    name: str  # the family in messages and fingerprints (batch["family"] for a processor's)
    names: tuple[str, ...]  # every batch["family"] this class gives (none for the tiling)
    unit_name: str  # what a vision unit is, in messages: "tiles", "patches"
    unit_size: int  # side S of a unit, in pixels
    tokenizer: Any  # the tokenizer the text is encoded with (None: an images-only tiling)
    placeholder: str  # the one token the chat template puts where an image goes
    # what goes before and after an image's ids in a document (no template there): what the
    # chat template writes around the placeholder, ("", "") for nothing
    image_wrap: tuple[str, str]
    device_fields: tuple[str, ...]  # batch tensors model_inputs moves for model_fields

    @property
    def chat_template(self) -> Any:
        """The chat template the family renders with; None: the tokenizer's own."""

    @property
    def modules(self) -> tuple[str, ...]:
        """Modules a worker process imports ahead: the family's own and its processor's."""

    def chat_messages(self, messages: list[dict]) -> list[dict]:
        """Stored messages (``<image>`` markers in string content) as its template takes them."""

    def image_cost(self, width: int, height: int, alone: bool = True) -> int:
        """Vision units (tiles, patches) of an image displayed at ``width x height``;
        ``alone``: whether it is its sample's only image (LLaVA-OneVision cuts an image alone
        into crops at a resolution of its own, and gives each of several images one view)."""

    def image_token_ids(self, width: int, height: int, alone: bool = True) -> np.ndarray:
        """The int64 token ids that replace the placeholder of an image of that size."""

    def fingerprint_facts(self) -> list:
        """What decides the tokens beyond the tokenizer (checked when a loader resumes)."""

    def decode(self, sample: dict, out: torch.Tensor, edit: Edit | None = None) -> None:
        """Decode a sample's images into ``out``, uint8 ``[sum of costs, 3, S, S]``, in order;
        ``edit(index, image)``, if given, makes each decoded image (PIL, RGB, as displayed)
        into the one to resize (of the same size)."""

    def constant_fields(self) -> dict:
        """Fields every batch carries: the family's name and pixel table for model_inputs."""

    def batch_fields(self, rows: list[list[dict]], batch: dict) -> dict:
        """Fields of one batch from its rows of samples (Qwen: image grids, mRoPE positions)."""

    def model_fields(self, batch: dict, units: torch.Tensor, normalised: Any) -> dict:
        """The forward's pixel arguments from a batch's uint8 units (for model_inputs)."""


Edit = Callable[[int, Any], Any]
"""``edit(index, image)``: the user's ``image_map`` on a sample's decoded image (PIL)."""


def decode_each(
    sample: dict,
    out: torch.Tensor,
    cost: Callable[..., int],
    fill: Callable[..., object],
    edit: Edit | None = None,
) -> None:
    """Decode a sample's images, in order, into ``out``: image by image, ``cost(w, h,
    alone)`` units each, written by ``fill(bytes, index size, its slice of out, edit)``,
    which checks the image against the size in the sample's index entry and passes the
    decoded image through ``edit(image)`` (None: as it is)."""
    start = 0
    names = image_members(sample)
    sizes = sample["__meta__"]["images"]
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        count = cost(*size, len(sizes) == 1)
        one = None if edit is None else functools.partial(edit, i)
        fill(sample[name], size, out[start : start + count], one)
        start += count
