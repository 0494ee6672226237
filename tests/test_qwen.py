"""The Qwen family alone: counts from sizes and pixels, against the processor itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from wdsvlm.families.hf_processor import pixel_table
from wdsvlm.families.inputs import normalise
from wdsvlm.families.qwen import QwenFamily, mrope_positions
from wdsvlm.families.registry import family_of
from wdsvlm.testing.tiny import tiny_processor

# tiny, thin, square, extreme aspect ratios, exact multiples, upscales and large ones
SIZES = [
    (1, 1),
    (7, 13),
    (5, 300),
    (300, 5),
    (2000, 11),
    (11, 2000),
    (28, 28),
    (56, 56),
    (57, 55),
    (100, 60),
    (224, 224),
    (640, 480),
    (1000, 1000),
    (1023, 17),
    (3000, 2000),
]


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed + width * 7919 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])
def processor(request):
    return tiny_processor(request.param, max_pixels=256 * 28 * 28)


@pytest.mark.parametrize("size", SIZES)
def test_tokens_and_patches_from_the_size_equal_the_processor(processor, size):
    family = family_of(processor)
    out = processor(text=[processor.image_token], images=[[_image(*size)]], return_tensors="pt")
    assert tuple(out["image_grid_thw"][0].tolist()) == family.grid(*size)
    assert family.image_cost(*size) == len(out["pixel_values"])
    assert torch.equal(out["input_ids"][0], torch.from_numpy(family.image_token_ids(*size)))


@pytest.mark.parametrize("size", [(1, 1), (5, 300), (2000, 11), (100, 60), (640, 480)])
def test_pixels_equal_the_processor_bit_for_bit(processor, size):
    family = family_of(processor)
    image = _image(*size)
    expected = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
    units = torch.empty(
        (family.image_cost(*size), 3, family.unit_size, family.unit_size), dtype=torch.uint8
    )
    family.image_units(image, units)
    table = pixel_table(family.image_processor)
    batch = {"temporal_patch_size": family.temporal_patch_size, "image_grid_thw": None}
    fields = QwenFamily.model_fields(
        batch, units, lambda units, out=None: normalise(units, table, out=out)
    )
    assert torch.equal(fields["pixel_values"], expected)


def test_an_aspect_ratio_over_200_is_refused_as_the_processor_refuses_it(processor):
    family = family_of(processor)
    with pytest.raises(ValueError, match="aspect ratio"):
        family.image_cost(2010, 10)
    with pytest.raises(ValueError, match="aspect ratio"):
        processor(text=[processor.image_token], images=[[_image(2010, 10)]])


def test_mrope_positions_count_text_on_and_go_on_after_each_image_grid():
    ids = np.array([5, 5, 9, 9, 9, 9, 9, 9, 5, 9, 5, 5])
    # a grid of 1 x 4 x 6 patches merged by 2: 2 x 3 tokens; then 1 x 2 x 2: one token
    pos = mrope_positions(ids, [(1, 4, 6), (1, 2, 2)], image_token_id=9, merge=2)
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 2:8].tolist() == [2] * 6
    assert pos[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]
    assert pos[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]
    assert pos[:, 8].tolist() == [5, 5, 5]  # 2 + max(2, 3)
    assert pos[:, 9].tolist() == [6, 6, 6]
    assert pos[:, 10:].tolist() == [[7, 8]] * 3
    with pytest.raises(ValueError, match="runs of vision tokens"):
        mrope_positions(ids, [(1, 4, 6)], image_token_id=9, merge=2)
