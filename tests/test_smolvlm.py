"""SmolVLMFamily against the processor itself: costs, token ids and pixels, bit for bit."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import SmolVLMImageProcessorPil

from wdsvlm.families.smolvlm import SmolVLMFamily
from wdsvlm.testing.tiny import tiny_model, tiny_processor

from .conftest import photo

# A long edge of 100 px over 32 px tiles: no multiple of the tile, so the processor's float
# truncations matter (and a 32 px tile, 2x2 patches of 16, is one token: fast).
ODD = {"size": {"longest_edge": 100}, "max_image_size": {"longest_edge": 32}}


def published():
    """The tiny processor with SmolVLMImageProcessorPil's own defaults (364 px tiles, 4 across)."""
    proc = tiny_processor("smolvlm")
    proc.image_processor = SmolVLMImageProcessorPil()
    return proc


def pixel_table(ip) -> torch.Tensor:
    """[3, 256]: what the image processor's own rescale/normalize make of each uint8 value."""
    x = np.tile(np.arange(256, dtype=np.uint8), (3, 1, 1))
    x = ip.rescale(x, ip.rescale_factor) if ip.do_rescale else x.astype(np.float32)
    x = ip.normalize(x, ip.image_mean, ip.image_std) if ip.do_normalize else x
    return torch.from_numpy(np.ascontiguousarray(x[:, 0, :], dtype=np.float32))


def units(family: SmolVLMFamily, img: Image.Image) -> torch.Tensor:
    s = family.unit_size
    out = torch.empty(family.image_cost(*img.size), 3, s, s, dtype=torch.uint8)
    family.image_units(img, out)
    return out


def spliced(family: SmolVLMFamily, text: str, images: list[Image.Image]) -> list[int]:
    """Tokenize the unexpanded text, then put each image's ids in place of its placeholder."""
    ids = family.tokenizer(text)["input_ids"]
    image_id = family.tokenizer.convert_tokens_to_ids(family.placeholder)
    out, queue = [], list(images)
    for i in ids:
        out.extend(family.image_token_ids(*queue.pop(0).size).tolist() if i == image_id else [i])
    assert not queue
    return out


def check(proc, sizes, pixels: bool = True) -> None:
    """Each size, alone in the processor: tiles, token ids and (optionally) pixels agree."""
    family = SmolVLMFamily(proc)
    table = pixel_table(proc.image_processor)
    image_id = proc.tokenizer.convert_tokens_to_ids(proc.image_token)
    for n, (w, h) in enumerate(sizes):
        img = photo(w, h, n) if pixels else Image.new("RGB", (w, h), (200, 30, 90))
        got = proc(text=[family.placeholder], images=[[img]], return_tensors="pt")
        pv = got["pixel_values"][0]
        assert family.image_cost(w, h) == len(pv), (w, h)
        ids = got["input_ids"][0].tolist()
        assert spliced(family, family.placeholder, [img]) == ids, (w, h)
        expansion = family.image_token_ids(w, h)
        assert (expansion == image_id).sum() == proc.image_seq_len * len(pv), (w, h)
        if pixels:
            u = units(family, img).long()
            assert torch.equal(table[torch.arange(3)[:, None, None], u], pv), (w, h)


# Long, short and square; exact multiples of the tile and one pixel over; upscaled small images.
EDGES = [(1, 1), (5, 300), (300, 5), (2000, 20), (20, 2000), (364, 364), (365, 364)]
EDGES += [(728, 364), (1456, 1456), (1457, 3), (100, 80), (640, 480), (3000, 2000), (513, 2047)]


def test_default_smolvlm_sizes_match_costs_tokens_and_pixels():
    check(published(), EDGES)


def test_idefics3_is_the_same_family_under_its_own_name():
    proc = tiny_processor("idefics3")
    assert SmolVLMFamily(proc).name == "idefics3"
    assert SmolVLMFamily(tiny_processor("smolvlm")).name == "smolvlm"
    check(proc, [(1, 1), (2000, 20), (640, 480)])


def test_a_long_edge_that_is_no_multiple_of_the_tile_takes_the_processors_rounding():
    # The processor's get_number_of_image_patches disagrees with its own output on about half
    # of these sizes: only replaying its float expressions in its order agrees.
    random.seed(0)
    sizes = [(random.randint(1, 400), random.randint(1, 400)) for _ in range(150)]
    check(tiny_processor("smolvlm", **ODD), EDGES + sizes, pixels=False)
    check(tiny_processor("smolvlm", **ODD), sizes[:40])


def test_without_splitting_or_resizing_and_under_the_4096_cap():
    check(tiny_processor("smolvlm", **ODD, do_image_splitting=False), EDGES)
    unresized = [(1, 1), (31, 70), (200, 33), (64, 64)]
    check(tiny_processor("smolvlm", **ODD, do_resize=False), unresized)
    # A long edge over MAX_IMAGE_SIZE is capped: 5000 -> 4096, so 4 tiles of 1024, not 5.
    big = {"size": {"longest_edge": 5000}, "max_image_size": {"longest_edge": 1024}}
    proc = tiny_processor("smolvlm", **big)
    assert SmolVLMFamily(proc).image_cost(2000, 20) == 4 + 1
    check(proc, [(2000, 20), (30, 3000)])


def test_several_images_in_one_text_splice_like_the_processors_expansion():
    proc = tiny_processor("smolvlm", **ODD)
    family = SmolVLMFamily(proc)
    imgs = [photo(90, 20, 1), photo(5, 5, 2), photo(50, 300, 3)]
    text = "User: <image>\n<image>What are these?<end_of_utterance>\nAssistant:<image> Three."
    got = proc(text=[text], images=[imgs], return_tensors="pt")
    assert spliced(family, text, imgs) == got["input_ids"][0].tolist()
    table = pixel_table(proc.image_processor)
    tiles = torch.cat([units(family, i) for i in imgs]).long()
    assert torch.equal(table[torch.arange(3)[:, None, None], tiles], got["pixel_values"][0])
    assert got["pixel_attention_mask"].all()  # every tile is whole: nothing to mask


@pytest.mark.parametrize("family_name", ["smolvlm", "idefics3"])
def test_the_placeholder_is_what_the_chat_template_renders_for_an_image(family_name):
    proc = tiny_processor(family_name)
    content = [{"type": "image"}, {"type": "text", "text": "Hi"}]
    text = proc.apply_chat_template([{"role": "user", "content": content}])
    assert text.count(SmolVLMFamily(proc).placeholder) == 1


def test_no_batch_fields_and_no_model_fields_without_images():
    family = SmolVLMFamily(published())
    samples = [{"__meta__": {"images": [[10, 10]]}, "image_tiles": [17]}]
    assert family.batch_fields([samples], {}) == {}

    def keep(units):
        return units

    assert family.model_fields({}, torch.zeros(0, 3, 364, 364), keep) == {}
    pv = family.model_fields({}, torch.ones(5, 3, 364, 364), keep)["pixel_values"]
    assert pv.shape == (1, 5, 3, 364, 364)


def test_the_wrong_output_tensor_is_named_with_the_shape_it_should_have():
    family = SmolVLMFamily(published())
    with pytest.raises(ValueError, match=r"expected uint8 \(17, 3, 364, 364\)"):
        family.image_units(photo(4, 4), torch.empty(1, 3, 364, 364, dtype=torch.uint8))


@pytest.mark.parametrize("family_name", ["smolvlm", "idefics3"])
def test_packed_tiles_give_the_model_what_the_processor_gives_it_sample_by_sample(family_name):
    # Three samples in two packed rows: [A, B] and [C, padding]. The model must see each
    # sample's tiles in its image tokens, as when the processor's output is run alone.
    proc = tiny_processor(family_name)
    family, table = SmolVLMFamily(proc), pixel_table(proc.image_processor)
    model = tiny_model(family_name, proc).eval()
    imgs = [[photo(300, 90, 1), photo(20, 20, 2)], [], [photo(70, 260, 3)]]
    texts = ["User:<image> and<image>? Two.", "User: hi. Hello.", "User:<image>Tall."]
    alone, ids, units_ = [], [], []
    with torch.no_grad():
        for text, im in zip(texts, imgs, strict=True):
            got = proc(text=[text], images=[im] if im else None, return_tensors="pt")
            alone.append(model(**got).logits[0])
            ids.append(spliced(family, text, im))
            assert ids[-1] == got["input_ids"][0].tolist()
            units_ += [units(family, i) for i in im]
        rows = [ids[0] + ids[1], ids[2]]
        width = max(map(len, rows))
        pad = [proc.tokenizer.pad_token_id] * (width - len(rows[1]))
        input_ids = torch.tensor([rows[0], rows[1] + pad])
        position_ids = torch.tensor(
            [
                list(range(len(ids[0]))) + list(range(len(ids[1]))),
                list(range(len(ids[2]))) + list(range(len(pad))),
            ]
        )
        tiles = torch.cat(units_).long()

        def normalised(units):
            return table[torch.arange(3)[:, None, None], units]

        kwargs = family.model_fields({}, tiles, normalised)
        packed = model(input_ids=input_ids, position_ids=position_ids, **kwargs).logits
    a, b, c = (len(i) for i in ids)
    torch.testing.assert_close(packed[0, :a], alone[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(packed[0, a : a + b], alone[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(packed[1, :c], alone[2], rtol=1e-4, atol=1e-5)
