"""Collate: the batch format, fixed shapes, tile order = image-token order, and packed
samples that cannot see each other (packed loss == each sample's loss alone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wdsvlm.pipeline.collate import Collate, block_causal_mask, collate_rows, segment_ids
from wdsvlm.pipeline.images import ImageConfig
from wdsvlm.pipeline.tokenize import IGNORE_INDEX

IMAGE = 99  # image token id in these tests
TILE4 = ImageConfig(tile_size=4)
NO_TILES = torch.empty((0, 3, 4, 4), dtype=torch.uint8)
PER_TILE = 2  # image tokens per tile


def make_sample(key, n_text, tiles=(), colour_base=0, rng=None):
    """A tokenized sample: text tokens, then per image a run of PER_TILE x tiles image tokens;
    each tile a distinct constant colour (colour_base + tile number)."""
    rng = rng or np.random.default_rng(len(key))
    ids = [int(t) for t in rng.integers(1, 90, n_text)]
    for count in tiles:
        ids += [IMAGE] * (PER_TILE * count)
    ids = np.asarray(ids, dtype=np.int64)
    labels = ids.copy()
    labels[0] = IGNORE_INDEX
    labels[ids == IMAGE] = IGNORE_INDEX
    total = sum(tiles)
    pixels = torch.arange(colour_base, colour_base + total, dtype=torch.uint8)
    pixels = pixels.view(total, 1, 1, 1).expand(total, 3, 4, 4).contiguous()
    return {
        "__key__": key,
        "__shard__": "s",
        "input_ids": ids,
        "labels": labels,
        "image_tiles": list(tiles),
        "pixel_values": pixels,
    }


def test_batch_format_shapes_and_dtypes_are_fixed():
    collate = Collate(max_length=32, batch_size=3, pad_token_id=0, image_config=TILE4)
    batches = [
        collate([[make_sample("a", 5, (2,)), make_sample("b", 9)], [make_sample("c", 30)]]),
        collate([[make_sample("d", 1)]]),  # fewer packs than rows: padding rows
    ]
    for batch in batches:
        for name in ("input_ids", "attention_mask", "labels", "position_ids"):
            assert batch[name].shape == (3, 32) and batch[name].dtype == torch.long, name
        assert batch["cu_seqlens"].dtype == torch.int32 and batch["cu_seqlens"][-1] == 3 * 32
        assert isinstance(batch["max_seqlen"], int)
        assert batch["pixel_values"].dtype == torch.uint8 and batch["pixel_values"].shape[1:] == (
            3,
            4,
            4,
        )
        assert batch["image_tiles"].dtype == torch.long
        assert batch["num_loss_tokens"] == (batch["labels"] != IGNORE_INDEX).sum()
        assert len(batch["sample_keys"]) == 3
    assert batches[0]["sample_keys"] == [["s/a", "s/b"], ["s/c"], []]
    assert batches[1]["attention_mask"][1:].sum() == 0
    assert (batches[1]["labels"][1:] == IGNORE_INDEX).all()


def test_cu_seqlens_match_position_ids():
    collate = Collate(max_length=20, batch_size=2, pad_token_id=0, image_config=TILE4)
    batch = collate([[make_sample("a", 4), make_sample("b", 6)], [make_sample("c", 20)]])
    pos = batch["position_ids"].flatten()
    starts = torch.nonzero(pos == 0).flatten().to(torch.int32)
    assert torch.equal(
        batch["cu_seqlens"], torch.cat([starts, torch.tensor([40], dtype=torch.int32)])
    )
    assert batch["cu_seqlens"].tolist() == [0, 4, 10, 20, 40]  # padding is a segment of its own
    assert batch["max_seqlen"] == 20
    assert batch["position_ids"][0, :10].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]


def test_tiles_come_in_image_token_order():
    collate = Collate(max_length=64, batch_size=2, pad_token_id=0, image_config=TILE4)
    rows = [
        [make_sample("a", 3, (2, 1), colour_base=10), make_sample("b", 2, (3,), colour_base=20)],
        [make_sample("c", 5, (1,), colour_base=30)],
    ]
    batch = collate(rows)
    colours = batch["pixel_values"][:, 0, 0, 0].tolist()
    assert colours == [10, 11, 12, 20, 21, 22, 30]
    assert batch["image_tiles"].tolist() == [2, 1, 3, 1]
    # walking the image-token runs row-major meets the tiles in the same order
    flat = batch["input_ids"].flatten()
    assert int((flat == IMAGE).sum()) == PER_TILE * len(colours)


def test_a_pack_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="does not fit max_length=10"):
        collate_rows([[make_sample("a", 6), make_sample("b", 6)]], 10, 0, NO_TILES)


def test_block_causal_mask_keeps_samples_apart():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert segment_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3]]
    mask = block_causal_mask(pos)[0, 0] == 0
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-7), (torch.float32, 1e-5)])
def test_packed_loss_equals_each_sample_alone(dtype, tolerance):
    """float64 agrees to 1e-7 (RoPE angles are computed in float32 either way); float32 to
    1e-5, the size of float32 rounding over two layers of attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="eager",
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    rng = np.random.default_rng(1)
    row = [make_sample(str(n), n, rng=rng) for n in (7, 11, 5, 3)]
    batch = collate_rows([row, row[:2]], 40, 0, NO_TILES)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            attention_mask=block_causal_mask(batch["position_ids"], dtype),
            position_ids=batch["position_ids"],
        ).logits
    packed = torch.nn.functional.cross_entropy(
        logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none"
    )
    for r, samples in enumerate([row, row[:2]]):
        at = 0
        for s in samples:
            n = len(s["input_ids"])
            with torch.no_grad():
                alone = model(input_ids=torch.from_numpy(s["input_ids"])[None]).logits
            expected = torch.nn.functional.cross_entropy(
                alone[0, :-1], torch.from_numpy(s["labels"])[1:], reduction="none"
            )
            assert torch.allclose(packed[r, at : at + n - 1], expected, atol=tolerance, rtol=0)
            if at + n < 40:  # the shift never crosses into the next sample: its first label
                assert batch["labels"][r, at + n] == IGNORE_INDEX  # is -100
            at += n


def test_images_not_yet_decoded_are_decoded_into_the_batch(tmp_path):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 0, 0)).save(buf, format="PNG")
    good = make_sample("a", 3, (1,))
    del good["pixel_values"]
    good.update({"0.png": buf.getvalue(), "__meta__": {"images": [[8, 8]]}})
    bad = make_sample("b", 3, (1,))
    del bad["pixel_values"]
    bad.update({"0.png": b"broken", "__meta__": {"images": [[8, 8]]}})
    after = make_sample("c", 2, (1,), colour_base=77)
    collate = Collate(32, 1, 0, image_config=ImageConfig(tile_size=8, max_image_side=8))
    after["pixel_values"] = torch.full((1, 3, 8, 8), 77, dtype=torch.uint8)
    batch = collate([[good, bad, after]])
    assert batch["sample_keys"] == [["s/a", "s/c"]]  # the undecodable one left out
    assert batch["pixel_values"].shape == (2, 3, 8, 8)
    assert batch["pixel_values"][0, :, 0, 0].tolist() == [200, 0, 0]
    assert batch["pixel_values"][1, :, 0, 0].tolist() == [77, 77, 77]
    assert batch["attention_mask"].sum() == 5 + 4  # a: 3 text + 2 image tokens, c: 2 + 2
    assert collate.stats.counts == {"undecodable_image": 1}
