"""wdsvlm.testing.tiny: each family's tiny processor renders its published chat template, expands
image placeholders, and feeds a tiny model; packed rows equal the samples run one by one."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from wdsvlm.testing import tokenizer
from wdsvlm.testing.tiny import FAMILIES, tiny_model, tiny_processor

from .conftest import EXAMPLE

CONVERSATION = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]},
]
QWEN3 = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
    "<|im_start|>assistant\nA red square.<|im_end|>\n"
)
QWEN2 = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + QWEN3
SMOL = "User:<image>What is it?<end_of_utterance>\nAssistant: A red square.<end_of_utterance>\n"
RENDERED = {
    "qwen2_vl": QWEN2,
    "qwen2_5_vl": QWEN2,
    "qwen3_vl": QWEN3,
    "smolvlm": "<|im_start|>" + SMOL,
    "idefics3": "<|begin_of_text|>" + SMOL,
    # a turn's images first, then each text piece after a newline
    "llava_onevision": "<|im_start|>user <image>\nWhat is it?<|im_end|>"
    "<|im_start|>assistant \nA red square.<|im_end|>",
}
SPECIAL = {
    "qwen": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>"]
    + ["<|image_pad|>", "<|video_pad|>"],
    "smol": ["<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<global-img>"]
    + ["<image>", "<row_1_col_1>", "<row_6_col_6>"],
    "llava": ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<image>", "<video>"],
}


def picture(w: int = 100, h: int = 60) -> Image.Image:
    return Image.new("RGB", (w, h), (220, 30, 30))


def image_tokens(processor, out) -> int:
    """How many image tokens the processor says ``out`` holds."""
    if "image_grid_thw" in out:
        return int(out["image_grid_thw"].prod(-1).sum()) // processor.image_processor.merge_size**2
    if "batch_num_images" in out:  # LLaVA-OneVision: the count the processor gives vLLM
        sizes = out["image_sizes"].tolist()
        return sum(processor._get_num_multimodal_tokens(image_sizes=sizes)["num_image_tokens"])
    return out["pixel_values"].shape[1] * processor.image_seq_len  # tiles x tokens a tile


@pytest.mark.parametrize("family", FAMILIES)
def test_processor_and_model(family):
    processor = tiny_processor(family)
    tokenizer = processor.tokenizer
    kind = next((k for k in SPECIAL if family.startswith(k)), "smol")
    for token in SPECIAL[kind]:
        assert len(tokenizer.encode(token, add_special_tokens=False)) == 1, token

    text = processor.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == RENDERED[family]
    # The tokenizer carries the same template (text-only callers render the same).
    assert tokenizer.chat_template == processor.chat_template

    out = processor(text=[text], images=[[picture()]], return_tensors="pt")
    ids = out["input_ids"]
    n_image = int((ids == processor.image_token_id).sum())
    assert n_image == image_tokens(processor, out) > 0
    if family.startswith("qwen"):
        assert int(out["mm_token_type_ids"].sum()) == n_image
        counted = processor._get_num_multimodal_tokens(image_sizes=[(60, 100)])
        assert counted["num_image_tokens"] == [n_image]

    model = tiny_model(family, processor)
    assert model.dtype == torch.float32
    with torch.no_grad():
        logits = model(**out).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_match_single_samples(family):
    """Two samples in one row, position ids restarting and no attention mask, give the logits
    each gives alone: the models mask packed rows without flash attention."""
    processor = tiny_processor(family)
    model = tiny_model(family, processor, seed=1)
    samples = []
    for question, answer, image in [
        ("What is it?", "Red.", picture()),
        ("And?", "Blue.", picture(50, 90)),
    ]:
        conv = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
        text = processor.apply_chat_template(conv, tokenize=False)
        samples.append(processor(text=[text], images=[[image]], return_tensors="pt"))
    packed: dict[str, torch.Tensor] = {"input_ids": torch.cat([s["input_ids"] for s in samples], 1)}
    if family.startswith("qwen"):
        positions = []
        for s in samples:
            mrope, _ = model.model.get_rope_index(
                s["input_ids"],
                image_grid_thw=s["image_grid_thw"],
                mm_token_type_ids=s["mm_token_type_ids"],
                attention_mask=s["attention_mask"],
            )
            length = s["input_ids"].shape[1]
            # Text positions first: Qwen builds the packed mask from that row only.
            positions.append(torch.cat([torch.arange(length).view(1, 1, length), mrope]))
        packed["position_ids"] = torch.cat(positions, 2)
        packed["pixel_values"] = torch.cat([s["pixel_values"] for s in samples])
        packed["image_grid_thw"] = torch.cat([s["image_grid_thw"] for s in samples])
        packed["mm_token_type_ids"] = torch.cat([s["mm_token_type_ids"] for s in samples], 1)
    else:
        lengths = [s["input_ids"].shape[1] for s in samples]
        packed["position_ids"] = torch.cat([torch.arange(n) for n in lengths]).view(1, -1)
        if family == "llava_onevision":  # each sample's crops in a row, with their sizes
            packed["pixel_values"] = torch.cat([s["pixel_values"][0] for s in samples])
            for key in ("image_sizes", "batch_num_images"):
                packed[key] = torch.cat([s[key] for s in samples])
        else:
            for key in ("pixel_values", "pixel_attention_mask"):
                packed[key] = torch.cat([s[key] for s in samples], 1)
    with torch.no_grad():
        alone = torch.cat([model(**s).logits[0] for s in samples])
        together = model(**packed).logits[0]
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_image_kwargs_override_sizes():
    small = tiny_processor("qwen2_vl")
    large = tiny_processor("qwen2_vl", max_pixels=256 * 28 * 28)
    big = picture(400, 300)
    n_small = image_tokens(small, small(text=["<|image_pad|>"], images=[[big]]))
    n_large = image_tokens(large, large(text=["<|image_pad|>"], images=[[big]]))
    assert n_small <= 64 < n_large <= 256

    processor = tiny_processor(
        "smolvlm", max_image_size={"longest_edge": 128}, size={"longest_edge": 256}
    )
    assert processor.image_seq_len == (128 // 16) ** 2 // 4
    out = processor(text=["<image>"], images=[[picture()]], return_tensors="pt")
    assert out["pixel_values"].shape[-1] == 128
    with torch.no_grad():
        logits = tiny_model("smolvlm", processor)(**out).logits
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        tiny_processor("smolvlm", max_image_size={"longest_edge": 48})


def test_seed_decides_the_weights():
    a, b, c = (tiny_model("qwen3_vl", seed=s).state_dict() for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_processor_pickles_and_has_its_families_real_video_processor():
    from transformers import BaseVideoProcessor

    processor = pickle.loads(pickle.dumps(tiny_processor("qwen2_5_vl")))
    out = processor(text=["<|image_pad|>"], images=[[picture()]])
    assert image_tokens(processor, out) > 0
    assert isinstance(processor.video_processor, BaseVideoProcessor)
    out = processor(
        text=["<|vision_start|><|video_pad|><|vision_end|>"],
        videos=[np.zeros((4, 56, 56, 3), dtype=np.uint8)],
        do_sample_frames=False,
    )
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]


def test_unknown_family_and_missing_tokenizer(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match="unknown family"):
        tiny_processor("llava")
    monkeypatch.setattr(tokenizer, "TOKENIZER_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="lacks its package data"):
        tiny_processor("smolvlm")


def test_the_shipped_tokenizer_is_the_one_trained_on_shards_example():
    # A copy (package data, so that wdsvlm.testing works from a wheel) that must not drift:
    # whoever remakes shards_example/tokenizer copies it to wdsvlm/testing/example_tokenizer.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shipped = (tokenizer.TOKENIZER_DIR / name).read_bytes()
        assert shipped == (Path(EXAMPLE) / "tokenizer" / name).read_bytes(), name
