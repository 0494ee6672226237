"""LlavaOnevisionFamily against the processor itself: crops, token counts, ids and pixels."""

from __future__ import annotations

import random

import pytest
import torch
from PIL import Image
from transformers import LlavaOnevisionImageProcessorPil

from wdsvlm.families.hf_processor import pixel_table
from wdsvlm.families.llava_onevision import LlavaOnevisionFamily
from wdsvlm.families.registry import family_of
from wdsvlm.testing.llava_onevision import TinyLlavaOnevisionProcessor
from wdsvlm.testing.tiny import tiny_processor

from .conftest import photo

# Tiny, thin, square, extreme aspect ratios (both ways), exact multiples of the view and one
# pixel over, upscaled small images, and large ones whose features the model shrinks.
SIZES = [
    (1, 1),
    (3, 2),
    (7, 13),
    (5, 300),
    (300, 5),
    (2000, 11),
    (11, 2000),
    (56, 56),
    (57, 56),
    (112, 56),
    (56, 336),
    (30, 40),
    (100, 60),
    (337, 113),
    (640, 480),
    (480, 640),
    (1000, 1000),
    (1600, 900),
    (3000, 2000),
]


def crops(family: LlavaOnevisionFamily, image: Image.Image, alone: bool = True) -> torch.Tensor:
    """The family's crops of ``image``, normalised with the processor's own table."""
    s = family.unit_size
    out = torch.empty(family.image_cost(*image.size, alone), 3, s, s, dtype=torch.uint8)
    family.image_units(image, out, alone)
    table = pixel_table(family.image_processor)
    return table[torch.arange(3)[:, None, None], out.long()]


def published():
    """The tiny processor with the published image settings: 384 px views of 27 x 27 SigLIP
    features (729 tokens), the published grid of 1 to 6 views a side, anyres_max_9."""
    proc = tiny_processor("llava_onevision")
    proc.image_processor = LlavaOnevisionImageProcessorPil()
    proc.num_image_tokens = 729
    return proc


def check(proc, sizes, pixels: bool = True) -> None:
    """Each size alone in the processor: crops, token ids and (optionally) pixels agree."""
    family = family_of(proc)
    for n, (w, h) in enumerate(sizes):
        image = photo(w, h, n) if pixels else Image.new("RGB", (w, h), (200, 30, 90))
        got = proc(text=["Look: <image> here"], images=[[image]], return_tensors="pt")
        assert family.image_cost(w, h) == got["pixel_values"].shape[1], (w, h)
        expansion = family.image_token_ids(w, h).tolist()
        image_id = family.image_token_id
        ids = got["input_ids"][0].tolist()
        first = ids.index(image_id)
        assert ids[first : first + len(expansion)] == expansion, (w, h)
        assert ids.count(image_id) == len(expansion), (w, h)
        if pixels:
            assert torch.equal(crops(family, image), got["pixel_values"][0]), (w, h)


def test_crops_tokens_and_pixels_of_an_image_alone_equal_the_processor():
    check(tiny_processor("llava_onevision"), SIZES)


def test_token_counts_from_the_size_equal_the_processor_for_many_sizes():
    random.seed(0)
    sizes = [(random.randint(1, 3000), random.randint(1, 3000)) for _ in range(60)]
    sizes += [(random.randint(1, 60), random.randint(1, 4000)) for _ in range(20)]
    check(tiny_processor("llava_onevision"), sizes, pixels=False)
    # the processor's own count (what vLLM asks it) over many more, at the published sizes
    proc = published()
    family = family_of(proc)
    many = [(random.randint(1, 5000), random.randint(1, 5000)) for _ in range(500)]
    counts = proc._get_num_multimodal_tokens(image_sizes=[(h, w) for w, h in many])
    assert [len(family.image_token_ids(w, h)) for w, h in many] == counts["num_image_tokens"]


def test_the_published_settings_give_the_processors_crops_and_pixels():
    check(published(), [(1, 1), (5, 300), (384, 384), (385, 384), (640, 480), (2000, 11)])


def test_each_of_several_images_is_one_view_on_the_mean_colour_and_one_newline():
    proc = tiny_processor("llava_onevision")
    family = family_of(proc)
    images = [photo(640, 480, 1), photo(30, 200, 2), photo(56, 56, 3)]
    got = proc(text=["<image><image> and <image>"], images=[images], return_tensors="pt")
    ids = got["input_ids"][0]
    assert int((ids == family.image_token_id).sum()) == 3 * (proc.num_image_tokens + 1)
    for k, image in enumerate(images):
        assert family.image_cost(*image.size, False) == 1
        assert len(family.image_token_ids(*image.size, False)) == proc.num_image_tokens + 1
        assert torch.equal(crops(family, image, alone=False)[0], got["pixel_values"][k][0])


def test_a_cls_token_dropped_by_the_default_strategy_is_one_token_fewer():
    base = tiny_processor("llava_onevision")
    proc = TinyLlavaOnevisionProcessor(
        base.image_processor,
        base.tokenizer,
        base.video_processor,
        num_image_tokens=base.num_image_tokens + 1,  # a CLIP view: its features and CLS
        vision_feature_select_strategy="default",
        chat_template=base.chat_template,
    )
    check(proc, [(1, 1), (640, 480), (2000, 11), (3000, 2000)], pixels=False)
    family = family_of(proc)
    got = proc(text=["<image><image>"], images=[[photo(9, 9), photo(90, 9)]], return_tensors="pt")
    expected = 2 * len(family.image_token_ids(9, 9, False))
    assert int((got["input_ids"][0] == family.image_token_id).sum()) == expected


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"size": {"height": 56, "width": 112}}, "square height and width"),
        ({"image_grid_pinpoints": [[56, 56], [56, 100]]}, "not all multiples of its size 56"),
        ({"do_resize": False}, "do_resize=True"),
    ],
)
def test_settings_it_cannot_replay_are_refused_naming_them(settings, message):
    with pytest.raises(ValueError, match=message):
        family_of(tiny_processor("llava_onevision", **settings))


def test_batch_fields_list_each_images_size_and_each_samples_image_count():
    family = family_of(tiny_processor("llava_onevision"))
    rows = [
        [{"__meta__": {"images": [[640, 480]]}}, {"__meta__": {"images": []}}],
        [{"__meta__": {"images": [[30, 200], [56, 56]]}}],
    ]
    fields = family.batch_fields(rows, {})
    assert fields["image_sizes"].tolist() == [[480, 640], [200, 30], [56, 56]]
    assert fields["batch_num_images"].tolist() == [1, 2]
    assert family.batch_fields([[{"__meta__": {"images": []}}]], {})["image_sizes"].shape == (0, 2)
