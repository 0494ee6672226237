"""Video in the Qwen2/2.5/3-VL family against the real processors with their real video
processors: the frames sampled, the tokens (Qwen3-VL's timestamps included), the grid, the
seconds per temporal patch and the pixels, planned from the index alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from wdsvlm.families.qwen_video import QwenVideo
from wdsvlm.format.videos import decode_frames, probe_video
from wdsvlm.testing.qwen import qwen_processor
from wdsvlm.testing.videos import SPECS, frame_files

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
MESSAGES = [
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "A bar."}]},
]


def processor_output(processor, path):
    """What a user gets: every frame by transformers' load_video, then the processor, which
    samples them itself."""
    from transformers.video_utils import load_video

    frames, metadata = load_video(path, backend="pyav")
    text = processor.apply_chat_template(MESSAGES, tokenize=False)
    return processor(text=[text], videos=[frames], video_metadata=[metadata], return_tensors="pt")


@pytest.mark.parametrize("cap", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_a_video_planned_from_the_index_is_the_processors_bit_for_bit(videos, family, name, cap):
    _, data, path = videos[name]
    processor = qwen_processor(family)
    # cap_pixels_per_frame: each frame's share of a whole-video budget (max_video_tokens small
    # enough here that the cap binds)
    processor.video_processor.cap_pixels_per_frame = cap
    processor.video_processor.max_video_tokens = 40 if family != "qwen3_vl" else 12
    expected = processor_output(processor, path)
    info = probe_video(data)
    video = QwenVideo(processor, family)

    grid = video.grid(info)
    assert expected["video_grid_thw"].tolist() == [list(grid)]
    if family == "qwen2_5_vl":
        seconds = torch.tensor([video.second_per_grid(info)], dtype=torch.float32)  # fractional
        assert torch.equal(expected["second_per_grid_ts"], seconds)

    # the text: the template's one video token becomes the video's ids
    text = processor.apply_chat_template(MESSAGES, tokenize=False)
    template = processor.tokenizer(text, add_special_tokens=False)["input_ids"]
    at = template.index(video.video_token_id)
    ids = template[:at] + video.token_ids(info).tolist() + template[at + 1 :]
    assert expected["input_ids"][0].tolist() == ids

    # the pixels: the sampled frames decoded from their keyframes, shipped uint8, normalised
    indices = video.frames(info)
    units = torch.empty(
        (video.cost(info), video.temporal, 3, video.patch_size, video.patch_size), dtype=torch.uint8
    )
    video.units(decode_frames(data, indices, info), info, units)
    vp = processor.video_processor
    flat = units.reshape(-1, 3, video.patch_size, video.patch_size)
    normalised = vp.rescale_and_normalize(
        flat, True, vp.rescale_factor, True, vp.image_mean, vp.image_std
    )
    got = (
        normalised.reshape(units.shape)
        .transpose(1, 2)
        .reshape(expected["pixel_values_videos"].shape)
    )
    assert torch.equal(got, expected["pixel_values_videos"])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_rotary_positions_of_a_video_sample_are_the_models_get_rope_index(videos, family):
    from wdsvlm.families.qwen import mrope_positions
    from wdsvlm.testing.qwen import qwen_model_config

    processor = qwen_processor(family)
    config, model_class = qwen_model_config(family, processor)
    if family == "qwen2_5_vl":
        config.vision_config.tokens_per_second = 2  # as published; the class default is 4
    model = model_class(config).model
    video = QwenVideo(processor, family)
    ip = processor.image_processor
    for name in ("fps2997", "vfr", "fps25"):
        _, data, path = videos[name]
        expected = processor_output(processor, path)
        info = probe_video(data)
        tokens_per_second = getattr(config.vision_config, "tokens_per_second", 1)
        ids = expected["input_ids"][0].numpy()
        got = mrope_positions(
            ids,
            [],
            processor.image_token_id,
            ip.merge_size,
            videos=video.runs(info, tokens_per_second),
            video_token_id=video.video_token_id,
        )
        options = {"video_grid_thw": expected["video_grid_thw"]}
        if family == "qwen2_5_vl":
            options["second_per_grid_ts"] = expected["second_per_grid_ts"]
        positions, _ = model.get_rope_index(
            expected["input_ids"], mm_token_type_ids=expected["mm_token_type_ids"], **options
        )
        assert np.array_equal(got, positions[:, 0].numpy()), (family, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenize_gives_a_mixed_samples_ids_as_the_processor_with_answers_alone_supervised(
    videos, family
):
    import json

    from PIL import Image
    from transformers.video_utils import load_video

    from wdsvlm.families.registry import family_of
    from wdsvlm.pipeline.tokenize import IGNORE_INDEX, Tokenize

    processor = qwen_processor(family)
    stage = Tokenize(family=family_of(processor))
    (_, first, first_path), (_, second, second_path) = videos["fps2997"], videos["vfr"]
    stored = [
        {"role": "user", "content": "<video>\nAnd <image> with <video>: what moves?"},
        {"role": "assistant", "content": "A bar."},
        {"role": "user", "content": "Sure?"},
        {"role": "assistant", "content": "Yes."},
    ]
    meta = {"images": [[64, 48]], "videos": [probe_video(d).as_dict() for d in (first, second)]}
    sample = {"json": json.dumps({"messages": stored}).encode(), "__meta__": meta, "__key__": "k"}
    (out,) = stage.encode([sample])

    loaded = [load_video(p, backend="pyav") for p in (first_path, second_path)]
    text = processor.apply_chat_template(stage.family.chat_messages(stored), tokenize=False)
    expected = processor(
        text=[text],
        images=[Image.new("RGB", (64, 48))],
        videos=[frames for frames, _ in loaded],
        video_metadata=[metadata for _, metadata in loaded],
        return_tensors="np",
    )
    assert out["input_ids"].tolist() == expected["input_ids"][0].tolist()
    supervised = out["labels"] != IGNORE_INDEX
    assert (
        processor.tokenizer.decode(out["input_ids"][supervised]) == "A bar.<|im_end|>Yes.<|im_end|>"
    )
    video = QwenVideo(processor, family)
    assert out["video_units"] == [video.cost(probe_video(d)) for d in (first, second)]
    ids = out["input_ids"]
    for at in out["video_at"]:  # where each video's ids start: its tokens (Qwen3-VL: its time)
        if family == "qwen3_vl":
            assert processor.tokenizer.decode(ids[at : at + 2]).startswith("<")
        else:
            start = processor.tokenizer.convert_tokens_to_ids("<|vision_start|>")
            assert ids[at] == video.video_token_id and ids[at - 1] == start


@pytest.fixture(scope="module")
def video_dataset(tmp_path_factory, videos):
    """A corpus of text-only, image, video, two-video and video-and-image samples, written."""
    from wdsvlm import write_dataset

    from .conftest import make_image, write_jsonl

    folder = tmp_path_factory.mktemp("corpus")
    for name, (_, data, _) in videos.items():
        (folder / f"{name}.mp4").write_bytes(data)
    make_image(str(folder / "a.jpg"), (96, 64), "JPEG")
    frames = []  # a video given as its frames, at 6 frames a second
    for i, data in enumerate(frame_files(SPECS[1], 9)):
        (folder / f"f{i:03d}.jpg").write_bytes(data)
        frames.append(f"f{i:03d}.jpg")

    def turn(question, answer):
        return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]

    records = [
        {"id": "fr", "video": frames, "fps": 6, "conversations": turn("<video>\nAnd?", "Frames.")}
    ]
    for i, name in enumerate(videos):
        records.append(
            {
                "id": f"v{i}",
                "video": f"{name}.mp4",
                "conversations": turn("<image>\nWhat moves?", f"Bar {i}."),
            }
        )
    records += [
        {"id": "t", "conversations": turn("Hello?", "Hi.")},
        {"id": "i", "image": "a.jpg", "conversations": turn("<image>\nWhat is it?", "A ball.")},
        {
            "id": "vv",
            "video": ["fps24.mp4", "vfr.mp4"],
            "conversations": turn("<video> or <video>?", "Both."),
        },
        {
            "id": "vv2",  # two videos of different lengths
            "video": ["fps25.mp4", "fps24.mp4"],
            "conversations": turn("<video> and <video>?", "Two."),
        },
        {
            "id": "vi",
            "video": "fps60.mp4",
            "image": "a.jpg",
            "conversations": turn("<video> vs <image>?", "Same."),
        },
    ]
    out = str(folder / "out")
    write_dataset(write_jsonl(str(folder / "in.jsonl"), records), out, progress=False)
    return out, folder


def alone_video(processor, folder, record_messages, images, video_names, fps=None):
    """The processor on one record alone: its videos loaded by transformers' load_video, or
    its frames by load_image with their frame rate."""
    from PIL import Image
    from transformers.image_utils import load_image
    from transformers.video_utils import load_video

    from wdsvlm.families.hf_processor import conversation

    text = processor.apply_chat_template(conversation(record_messages), tokenize=False)
    if video_names and video_names[0].endswith(".jpg"):  # one video, given as its frames
        frames = np.stack([np.asarray(load_image(str(folder / n))) for n in video_names])
        metadata = {"total_num_frames": len(frames), "fps": fps, "duration": len(frames) / fps}
        loaded = [(frames, metadata)]
    else:
        loaded = [load_video(str(folder / n), backend="pyav") for n in video_names]
    return processor(
        text=[text],
        images=[Image.open(folder / n).convert("RGB") for n in images] or None,
        videos=[f for f, _ in loaded] or None,
        video_metadata=[m for _, m in loaded] or None,
        return_tensors="pt",
    )


@pytest.mark.parametrize("family", [*FAMILIES, "llava_onevision", "smolvlm"])
def test_packed_video_batches_hold_what_the_processor_makes_and_give_the_logits_alone(
    video_dataset, family
):
    import json

    import wdsvlm
    from wdsvlm.testing.tiny import tiny_model, tiny_processor

    from .test_families import dataset_samples

    out, folder = video_dataset
    stored = dataset_samples(out)
    records = {r["id"]: r for r in map(json.loads, open(folder / "in.jsonl"))}
    processor = tiny_processor(family)
    model = tiny_model(family, processor).eval()
    loader = wdsvlm.Loader(
        out, processor=processor, max_length=1024, batch_size=2, shuffle_buffer=4
    )
    seen = []
    for batch in loader:
        inputs = wdsvlm.model_inputs(batch)
        with torch.no_grad():
            packed = model(**inputs).logits
        at = grid = 0
        for r, keys in enumerate(batch["sample_keys"]):
            positions = batch["position_ids"]  # [3, rows, L] for mRoPE, else [rows, L]
            row = positions[0, r] if positions.dim() == 3 else positions[r]
            starts = torch.nonzero(row == 0).flatten().tolist()
            for key, start, stop in zip(keys, starts, starts[1:] + [1024], strict=False):
                doc = json.loads(stored[key]["json"])
                record = records[doc["id"]]
                videos = record.get("video", [])
                videos = videos if isinstance(videos, list) else [videos]
                images = [record["image"]] if "image" in record else []
                ref = alone_video(
                    processor, folder, doc["messages"], images, videos, record.get("fps")
                )
                assert torch.equal(batch["input_ids"][r, start:stop], ref["input_ids"][0]), key
                if family == "smolvlm":  # frames are images to it: one stream, in text order
                    # the processor's [videos, frames, ...] (or [1, tiles, ...]), less its
                    # all-zero padding frames, as the model drops them
                    theirs = ref["pixel_values"].flatten(0, 1) if "pixel_values" in ref else None
                    if theirs is not None:
                        theirs = theirs[(theirs != 0).flatten(1).any(1)]
                    n = 0 if theirs is None else len(theirs)
                    mine = inputs["pixel_values"][0, at : at + n]
                    assert n == 0 or torch.equal(mine, theirs), key
                    at += n
                elif videos:
                    n = len(ref["pixel_values_videos"])
                    mine = inputs["pixel_values_videos"][at : at + n]
                    assert torch.equal(mine, ref["pixel_values_videos"]), key
                    k = len(ref.get("video_grid_thw", ()))
                    if k:
                        assert torch.equal(
                            inputs["video_grid_thw"][grid : grid + k], ref["video_grid_thw"]
                        )
                    if family == "qwen2_5_vl":
                        got = inputs["second_per_grid_ts"][grid : grid + k]
                        assert torch.equal(got, ref["second_per_grid_ts"]), key
                    at, grid = at + n, grid + k
                with torch.no_grad():
                    logits = model(**ref, use_cache=False).logits[0]
                torch.testing.assert_close(packed[r, start:stop], logits, rtol=0, atol=1e-5)
                if batch["sample_passes"][r][keys.index(key)] == 0:
                    seen.append(doc["id"])
        if family == "smolvlm":
            assert at == (inputs["pixel_values"].shape[1] if "pixel_values" in inputs else 0)
        else:
            assert at == len(inputs.get("pixel_values_videos", ()))
    expected = set(records)
    if family == "smolvlm":  # its processor takes images or videos in a sample, not both
        expected -= {"vi"}
        assert loader.stats()["skipped"]["video_not_supported"] >= 1
    assert sorted(seen) == sorted(expected)  # every sample once in the first pass


def test_llava_onevision_refuses_a_batch_whose_videos_differ_in_frames():
    from wdsvlm.families.llava_onevision import LlavaOnevisionFamily

    batch = {"video_units": torch.tensor([4, 5])}
    with pytest.raises(ValueError, match=r"same number of frames.*\[4, 5\].*num_frames"):
        LlavaOnevisionFamily.video_model_fields(batch, torch.zeros(9, 3, 8, 8), lambda u: u)
    fields = LlavaOnevisionFamily.video_model_fields(
        {"video_units": torch.tensor([4, 4])}, torch.zeros(8, 3, 8, 8), lambda u: u
    )
    assert fields["pixel_values_videos"].shape == (2, 4, 3, 8, 8)


def test_smolvlm_whose_frames_and_tiles_differ_in_size_takes_images_only():
    from wdsvlm.families.registry import family_of
    from wdsvlm.testing.tiny import tiny_processor

    processor = tiny_processor("smolvlm")
    assert family_of(processor).video is not None
    side = processor.image_processor.max_image_size["longest_edge"]
    processor.video_processor.max_image_size = {"longest_edge": side * 2}
    family = family_of(processor)
    assert family.video is None and "one size" in family.no_video
    assert family.image_cost(64, 48) >= 1  # its images as before
