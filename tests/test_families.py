"""Model families through the Loader, proven against transformers' own processors and models.

Each family's tiny processor and randomly initialised model are built offline
(``wdsvlm.testing.tiny``). A packed batch of ``shards_example`` must hold, for every sample, exactly
the ``input_ids`` and pixels that the processor makes of that sample alone, and the model must
give on the sample's tokens of the packed row the logits of the sample run alone.
"""

from __future__ import annotations

import json
import os
import tarfile

import numpy as np
import pytest
import torch

import wdsvlm
import wdsvlm.families.qwen
from wdsvlm.errors import TemplateError
from wdsvlm.families import family_of
from wdsvlm.families.hf_processor import conversation, pixel_table
from wdsvlm.families.inputs import normalise
from wdsvlm.format.images import image_members, open_image
from wdsvlm.pipeline.tokenize import IGNORE_INDEX
from wdsvlm.testing.llava_onevision import ONEVISION_PINPOINTS
from wdsvlm.testing.tiny import tiny_model, tiny_processor

from .conftest import EXAMPLE

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "smolvlm", "idefics3", "llava_onevision"]


def dataset_samples(root: str) -> dict[str, dict]:
    """``"SHARD/KEY"`` -> the sample's members, read straight from the tars."""
    index = wdsvlm.load_index(root)
    out: dict[str, dict] = {}
    for shard in index["shards"]:
        with tarfile.open(os.path.join(root, shard["name"])) as tar:
            for member in tar:
                key, _, suffix = member.name.partition(".")
                sample = out.setdefault(f"{shard['name']}/{key}", {})
                sample[suffix] = tar.extractfile(member).read()
    return out


def alone(processor, sample: dict) -> dict:
    """What the processor makes of one stored sample, as a user would call it."""
    messages = json.loads(sample["json"])["messages"]
    conv = conversation(messages)
    text = processor.apply_chat_template(conv, tokenize=False)
    images = [open_image(sample[name]) for name in image_members(sample)]
    return processor(text=[text], images=[images] if images else None, return_tensors="pt")


@pytest.fixture(scope="module")
def samples():
    return dataset_samples(EXAMPLE)


def _batches(processor, n: int, **settings):
    loader = wdsvlm.Loader(
        EXAMPLE,
        processor=processor,
        max_length=settings.pop("max_length", 512),
        batch_size=2,
        shuffle_buffer=8,
        pack_window=32,
        **settings,
    )
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _spans(batch):
    """(row, start, stop, key) of every packed sample."""
    for r, keys in enumerate(batch["sample_keys"]):
        text = batch["position_ids"][0] if batch["position_ids"].ndim == 3 else None
        positions = (text if text is not None else batch["position_ids"])[r]
        starts = torch.nonzero(positions == 0).flatten().tolist()
        for key, start, stop in zip(keys, starts, [*starts[1:], len(positions)], strict=False):
            yield r, start, stop, key


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_batch_holds_what_the_processor_makes_of_each_sample(family, backend, samples):
    processor = tiny_processor(family, backend)
    (batch,) = _batches(processor, 1)
    inputs = wdsvlm.model_inputs(batch)
    assert "attention_mask" not in inputs and inputs["use_cache"] is False
    n_packed = 0
    pixel_at = 0
    model_pixels = inputs["pixel_values"]  # the model's layout: one row per patch or tile
    model_pixels = model_pixels[0] if family in ("smolvlm", "idefics3") else model_pixels
    for r, start, stop, key in _spans(batch):
        ref = alone(processor, samples[key])
        ids = batch["input_ids"][r, start:stop]
        assert torch.equal(ids, ref["input_ids"][0]), key
        labels = batch["labels"][r, start:stop]
        assert labels[0] == IGNORE_INDEX
        assert torch.equal(labels[labels != IGNORE_INDEX], ids[labels != IGNORE_INDEX])
        # the supervised tokens are the answers and their end-of-turn tokens
        answers = [
            m["content"]
            for m in json.loads(samples[key]["json"])["messages"]
            if m["role"] == "assistant"
        ]
        decoded = processor.tokenizer.decode(ids[labels != IGNORE_INDEX])
        for answer in answers:
            assert answer in decoded
        if "pixel_values" in ref:
            expected = reference_pixels(family, ref)
            mine = model_pixels[pixel_at : pixel_at + len(expected)]
            assert torch.equal(mine, expected), key
            pixel_at += len(expected)
        n_packed += 1
    assert n_packed > 2  # packing happened
    assert pixel_at == len(model_pixels) == len(batch["pixel_values"])


def reference_pixels(family: str, ref) -> torch.Tensor:
    """The processor's pixels of one sample, one row per vision unit (patch, tile or crop)."""
    if family.startswith("qwen"):
        return ref["pixel_values"]  # [patches, 3 * T * P * P]
    if family == "llava_onevision":  # [images, most crops, 3, S, S]: each image's crops
        from transformers.models.llava_onevision.modeling_llava_onevision import (
            image_size_to_num_patches,
        )

        pixels = ref["pixel_values"]
        alone = ref["batch_num_images"].tolist() == [1]
        side = pixels.shape[-1]
        counts = [
            image_size_to_num_patches(size, ONEVISION_PINPOINTS, side) if alone else 1
            for size in ref["image_sizes"].tolist()
        ]
        return torch.cat([crops[:n] for crops, n in zip(pixels, counts, strict=True)])
    return ref["pixel_values"][0]  # [tiles, 3, S, S]: one sample, no padding images


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_logits_equal_each_sample_alone(family, backend, samples):
    processor = tiny_processor(family, backend)
    model = tiny_model(family, processor).eval()
    (batch,) = _batches(processor, 1)
    with torch.no_grad():
        packed = model(**wdsvlm.model_inputs(batch)).logits
        checked = 0
        for r, start, stop, key in _spans(batch):
            ref = alone(processor, samples[key])
            logits = model(**ref, use_cache=False).logits[0]
            assert logits.shape[0] == stop - start
            torch.testing.assert_close(packed[r, start:stop], logits, rtol=0, atol=1e-5)
            checked += 1
    assert checked > 2


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_mrope_rows_equal_get_rope_index_of_each_sample_alone(family, samples):
    processor = tiny_processor(family)
    model = tiny_model(family, processor)
    (batch,) = _batches(processor, 1)
    assert batch["position_ids"].shape == (4, *batch["input_ids"].shape)
    checked = 0
    for r, start, stop, key in _spans(batch):
        ref = alone(processor, samples[key])
        if "image_grid_thw" not in ref:
            continue
        expected, _ = model.model.get_rope_index(
            ref["input_ids"],
            mm_token_type_ids=ref["mm_token_type_ids"],
            image_grid_thw=ref["image_grid_thw"],
        )
        assert torch.equal(batch["position_ids"][1:, r, start:stop], expected[:, 0]), key
        assert torch.equal(batch["position_ids"][0, r, start:stop], torch.arange(stop - start))
        checked += 1
    assert checked > 0


def test_a_processor_of_another_family_is_refused_naming_the_supported_ones():
    class LlavaProcessor:
        pass

    with pytest.raises(ValueError, match="Qwen2VLProcessor.*SmolVLMProcessor"):
        family_of(LlavaProcessor())
    with pytest.raises(TypeError, match="tokenizer.*or processor="):
        wdsvlm.Loader(EXAMPLE)
    with pytest.raises(ValueError, match="cannot load the processor '/no/such/processor'"):
        wdsvlm.Loader(EXAMPLE, processor="/no/such/processor")


def test_model_inputs_refuses_a_batch_of_the_default_tiling():
    loader = wdsvlm.Loader(
        EXAMPLE,
        os.path.join(EXAMPLE, "tokenizer"),
        max_length=512,
        batch_size=1,
        tile_size=128,
        max_image_side=256,
        tokens_per_tile=16,
    )
    with pytest.raises(ValueError, match="processor="):
        wdsvlm.model_inputs(next(iter(loader)))


def test_vision_budget_bounds_the_patches_of_every_pack():
    processor = tiny_processor("qwen2_vl")
    merge = processor.image_processor.merge_size
    budget = 150
    batches = _batches(processor, 3, max_tiles_per_pack=budget)
    for batch in batches:
        patches = (batch["input_ids"] == processor.image_token_id).sum(-1) * merge**2
        assert int(patches.max()) <= budget
        assert int(batch["image_grid_thw"].prod(-1).sum()) == int(patches.sum())


def _same(a: dict, b: dict) -> bool:
    return a["sample_keys"] == b["sample_keys"] and all(
        torch.equal(a[k], b[k])
        for k in ("input_ids", "labels", "position_ids", "pixel_values", "image_grid_thw")
    )


@pytest.mark.processes
def test_workers_start_with_the_processor_and_a_resumed_loader_goes_on_exactly():
    processor = tiny_processor("qwen2_5_vl")
    settings = {"max_length": 512, "batch_size": 2, "num_workers": 2, "shuffle_buffer": 8}
    whole = wdsvlm.Loader(EXAMPLE, processor=processor, **settings)
    expected = [b for _, b in zip(range(5), whole, strict=False)]
    whole.close()
    part = wdsvlm.Loader(EXAMPLE, processor=processor, **settings)
    it = iter(part)
    for n in range(2):
        assert _same(next(it), expected[n])
    state = part.state_dict()
    part.close()
    resumed = wdsvlm.Loader(EXAMPLE, processor=processor, **settings)
    resumed.load_state_dict(state)
    got = [b for _, b in zip(range(3), resumed, strict=False)]
    resumed.close()
    assert all(_same(g, e) for g, e in zip(got, expected[2:], strict=True))
    # a processor that makes other images is refused on resume
    other = wdsvlm.Loader(
        EXAMPLE, processor=tiny_processor("qwen2_5_vl", max_pixels=32 * 28 * 28), **settings
    )
    with pytest.raises(ValueError, match="cannot resume.*tokenizer"):
        other.load_state_dict(state)
    other.close()


def test_the_public_stages_take_a_family_and_give_what_the_processor_gives(samples):
    import webdataset as wds

    from wdsvlm.pipeline import DecodeImages, Plan, ReadSamples, Tokenize, WorkerConfig

    processor = tiny_processor("qwen3_vl")
    family = family_of(processor)
    pipe = wds.DataPipeline(
        Plan(EXAMPLE, worker_config=WorkerConfig()),
        ReadSamples(),
        DecodeImages(family=family),
        Tokenize(family=family),
    )
    table = pixel_table(family.image_processor)

    def normaliser(units, out=None):
        return normalise(units, table, out=out)

    checked = 0
    for sample, _ in zip(pipe, range(12), strict=False):
        ref = alone(processor, samples[f"{sample['__shard__']}/{sample['__key__']}"])
        assert torch.equal(torch.from_numpy(sample["input_ids"]), ref["input_ids"][0])
        if "pixel_values" in ref:
            fields = wdsvlm.families.qwen.QwenFamily.model_fields(
                {"temporal_patch_size": 2, "image_grid_thw": None},
                sample["pixel_values"],
                normaliser,
            )
            assert torch.equal(fields["pixel_values"], ref["pixel_values"])
            checked += 1
    assert checked > 3


def _encoded(family, messages, sizes=()):
    from wdsvlm.pipeline import Tokenize

    sample = {
        "__key__": "k",
        "__shard__": "s",
        "json": json.dumps({"messages": messages}).encode(),
        "__meta__": {"images": [list(s) for s in sizes]},
    }
    (out,) = Tokenize(family=family).encode([sample])
    return out


def test_labels_are_the_answer_even_where_the_default_system_turn_holds_the_same_words():
    processor = tiny_processor("qwen2_5_vl")  # renders "You are a helpful assistant." first
    family = family_of(processor)
    messages = [
        {"role": "user", "content": "helpful"},
        {"role": "assistant", "content": "assistant."},
    ]
    out = _encoded(family, messages)
    supervised = out["input_ids"][out["labels"] != IGNORE_INDEX]
    assert processor.tokenizer.decode(supervised) == "assistant.<|im_end|>"
    start = processor.tokenizer.convert_tokens_to_ids("<|im_start|>")
    last_turn = max(i for i, t in enumerate(out["input_ids"]) if t == start)
    assert min(np.flatnonzero(out["labels"] != IGNORE_INDEX)) > last_turn  # not the system's


def test_an_image_inside_an_answer_and_an_empty_answer_are_labelled_as_text_only():
    processor = tiny_processor("qwen2_5_vl")
    family = family_of(processor)
    messages = [
        {"role": "user", "content": "Draw it."},
        {"role": "assistant", "content": "here <image> done"},
        {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": ""},
    ]
    out = _encoded(family, messages, sizes=[(56, 56)])
    supervised = out["input_ids"][out["labels"] != IGNORE_INDEX]
    assert processor.tokenizer.decode(supervised) == "here  done<|im_end|><|im_end|>"


def test_an_image_the_family_refuses_is_skipped_and_counted_naming_the_sample(tmp_path):
    from .conftest import make_image, write_jsonl

    records = []
    for i, size in enumerate([(64, 48)] * 5 + [(1000, 4)]):  # 1000x4: aspect ratio over 200
        image = make_image(str(tmp_path / f"{i}.png"), size, "PNG", seed=i)
        records.append(
            {
                "id": f"r{i}",
                "image": image,
                "conversations": [
                    {"from": "human", "value": "<image>\nWhat is it?"},
                    {"from": "gpt", "value": f"Picture {i}."},
                ],
            }
        )
    data = str(tmp_path / "ds")
    wdsvlm.write_dataset(write_jsonl(str(tmp_path / "in.jsonl"), records), data, progress=False)
    loader = wdsvlm.Loader(data, processor=tiny_processor("qwen2_vl"), max_length=512, batch_size=1)
    keys = [k for batch in loader for row in batch["sample_keys"] for k in row]
    stats = loader.stats()
    assert list(stats["skipped"]) == ["unusable_image"]  # counted once in each pass read
    assert set(stats["skipped_examples"]["unusable_image"]) == {"data-000000.tar/000000005"}
    assert keys and all(not k.endswith("000005") for k in keys)


def test_a_chat_template_that_cannot_take_content_lists_is_refused_at_once():
    processor = tiny_processor("qwen2_vl")
    string_only = (
        "{% for m in messages %}{{ '<|im_start|>' + m['content'] + '<|im_end|>' }}{% endfor %}"
    )
    with pytest.raises(TemplateError, match="cannot render content lists"):
        wdsvlm.Loader(EXAMPLE, processor=processor, chat_template=string_only)


def test_a_processor_setting_that_changes_the_tokens_changes_the_resume_fingerprint():
    from wdsvlm.pipeline import Tokenize

    processor = tiny_processor("smolvlm")
    before = Tokenize(family=family_of(processor)).fingerprint()
    processor.image_seq_len *= 4
    assert Tokenize(family=family_of(processor)).fingerprint() != before


def test_tiling_settings_given_with_a_processor_are_refused_not_ignored():
    with pytest.raises(ValueError, match="tile_size, tokens_per_tile set together with processor="):
        wdsvlm.Loader(
            EXAMPLE, processor=tiny_processor("qwen2_vl"), tile_size=128, tokens_per_tile=16
        )


def test_llava_onevision_packs_samples_of_one_and_of_several_images_as_alone(samples):
    # An image alone is cut into anyres crops, each of several is one view: a packed batch
    # holding both kinds must give the model what the processor gives each sample alone.
    processor = tiny_processor("llava_onevision")
    model = tiny_model("llava_onevision", processor).eval()
    batches = _batches(processor, 4)
    batch = next(b for b in batches if (b["batch_num_images"] > 1).any())
    assert (batch["batch_num_images"] == 1).any()
    inputs = wdsvlm.model_inputs(batch)
    with torch.no_grad():
        packed = model(**inputs).logits
        pixel_at, kinds = 0, set()
        for r, start, stop, key in _spans(batch):
            ref = alone(processor, samples[key])
            assert torch.equal(batch["input_ids"][r, start:stop], ref["input_ids"][0]), key
            if "pixel_values" in ref:
                expected = reference_pixels("llava_onevision", ref)
                mine = inputs["pixel_values"][pixel_at : pixel_at + len(expected)]
                assert torch.equal(mine, expected), key
                pixel_at += len(expected)
                kinds.add(len(ref["image_sizes"]) > 1)
            logits = model(**ref, use_cache=False).logits[0]
            torch.testing.assert_close(packed[r, start:stop], logits, rtol=0, atol=1e-5)
    assert kinds == {True, False} and pixel_at == len(inputs["pixel_values"])
