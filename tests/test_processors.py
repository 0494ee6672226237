"""What every family shares: content lists from stored messages, and pixel normalisation."""

from __future__ import annotations

import pytest
import torch

from wdsvlm.families.hf_processor import content_items, pixel_affine, pixel_table
from wdsvlm.families.inputs import normalise
from wdsvlm.testing.tiny import tiny_processor


def test_each_marker_becomes_an_image_item_in_place_and_drops_its_newline():
    assert content_items("<image>\nWhat is it?") == [
        {"type": "image"},
        {"type": "text", "text": "What is it?"},
    ]
    assert content_items("Compare <image> and<image>\n\nthis.") == [
        {"type": "text", "text": "Compare "},
        {"type": "image"},
        {"type": "text", "text": " and"},
        {"type": "image"},
        {"type": "text", "text": "\nthis."},
    ]
    assert content_items("no image") == [{"type": "text", "text": "no image"}]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "smolvlm"])
def test_normalising_by_arithmetic_or_by_table_gives_the_processors_values(family):
    image_processor = tiny_processor(family).image_processor
    table = pixel_table(image_processor)
    units = torch.arange(256, dtype=torch.uint8).repeat(3, 1).view(1, 3, 16, 16)
    expected = image_processor.normalize(
        image_processor.rescale(units[0].numpy(), image_processor.rescale_factor),
        image_processor.image_mean,
        image_processor.image_std,
    )
    assert torch.equal(normalise(units, table)[0], torch.from_numpy(expected))
    assert torch.equal(
        normalise(units, table, pixel_affine(image_processor))[0], torch.from_numpy(expected)
    )
    # an affine that is not the table's is not used: the table decides
    wrong = pixel_affine(image_processor) * torch.tensor([[1.0], [1.001], [1.0]])
    assert torch.equal(normalise(units, table, wrong)[0], torch.from_numpy(expected))
