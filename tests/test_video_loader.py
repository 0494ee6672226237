"""Video samples through the Loader's guarantees: every sample once per pass over ranks and
workers, an exact resume, and a video that does not decode at load time skipped and counted
by name with nothing else changed."""

from __future__ import annotations

import json
import os
import tarfile

import pytest

import wdsvlm
from wdsvlm.testing.qwen import qwen_processor
from wdsvlm.testing.videos import SPECS, make_video

from .conftest import make_image, write_jsonl
from .test_ddp import digest

SETTINGS = {"max_length": 1024, "batch_size": 2, "shuffle_buffer": 4, "pack_window": 8}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """30 samples in 6 shards: videos of every test kind, two-video, video-and-image, image
    and text-only samples."""
    folder = tmp_path_factory.mktemp("video-corpus")
    for spec in SPECS:
        (folder / f"{spec.name}.mp4").write_bytes(make_video(spec))
    make_image(str(folder / "a.jpg"), (96, 64), "JPEG")

    def turn(question, answer):
        return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]

    records = []
    for copy in range(3):
        for spec in SPECS:
            convo = turn("<image>\\nWhat moves?", f"Bar {copy}.")
            records.append(
                {"id": f"{spec.name}-{copy}", "video": f"{spec.name}.mp4", "conversations": convo}
            )
        records += [
            {"id": f"t{copy}", "conversations": turn("Hello?", "Hi.")},
            {"id": f"i{copy}", "image": "a.jpg", "conversations": turn("<image>\\nIt?", "A ball.")},
            {
                "id": f"vv{copy}",
                "video": ["fps24.mp4", "vfr.mp4"],
                "conversations": turn("<video> or <video>?", "Both."),
            },
            {
                "id": f"vi{copy}",
                "video": "fps60.mp4",
                "image": "a.jpg",
                "conversations": turn("<video> vs <image>?", "Same."),
            },
        ]
    out = str(folder / "out")
    wdsvlm.write_dataset(
        write_jsonl(str(folder / "in.jsonl"), records), out, samples_per_shard=5, progress=False
    )
    return out, len(records)


@pytest.mark.processes
def test_two_ranks_of_two_workers_read_every_video_sample_once_and_resume_exactly(corpus):
    data, total = corpus
    processor = qwen_processor("qwen2_5_vl")
    seen = []
    for rank in range(2):
        options = {**SETTINGS, "num_workers": 2, "rank": rank, "world_size": 2}
        loader = wdsvlm.Loader(data, processor=processor, **options)
        batches = list(loader)
        loader.close()
        for batch in batches:
            for keys, passes in zip(batch["sample_keys"], batch["sample_passes"], strict=True):
                seen += [k for k, p in zip(keys, passes, strict=True) if p == 0]
        # a state saved mid-epoch resumes to the same batches, bit for bit
        part = wdsvlm.Loader(data, processor=processor, **options)
        it = iter(part)
        for _ in range(2):
            next(it)
        state = part.state_dict()
        part.close()
        resumed = wdsvlm.Loader(data, processor=processor, **options)
        resumed.load_state_dict(state)
        rest = list(resumed)
        resumed.close()
        assert [digest(b) for b in rest] == [digest(b) for b in batches[2:]], rank
        assert any(len(b["video_pixels"]) for b in batches)
    assert len(seen) == total and len(set(seen)) == total


def test_a_video_that_does_not_decode_when_read_is_skipped_and_counted_by_name(corpus, tmp_path):
    data, total = corpus
    broken = str(tmp_path / "broken")
    os.makedirs(broken)
    target = None
    for name in os.listdir(data):
        with open(os.path.join(data, name), "rb") as f:
            body = bytearray(f.read())
        if name.endswith(".tar") and target is None:
            with tarfile.open(os.path.join(data, name)) as tar:
                member = next(m for m in tar.getmembers() if m.name.endswith(".mp4"))
            # the container's index is at the end of the file: zeroed, it cannot be opened
            end = member.offset_data + member.size
            body[end - 2000 : end] = bytes(2000)
            target = f"{name}/{member.name.split('.')[0]}"
        with open(os.path.join(broken, name), "wb") as f:
            f.write(body)
    processor = qwen_processor("qwen2_vl")

    def epoch(path):
        """What the first pass gave of each sample, the times each came, and the stats."""
        loader = wdsvlm.Loader(path, processor=processor, **SETTINGS)
        first, times = {}, {}
        for batch in loader:
            for r, keys in enumerate(batch["sample_keys"]):
                for k, p in zip(keys, batch["sample_passes"][r], strict=True):
                    times[k] = times.get(k, 0) + 1
                    if p == 0:
                        first[k] = batch["input_ids"][r]
        return first, times, loader.stats()

    good, times, _ = epoch(data)
    bad, _, stats = epoch(broken)
    # skipped each time it came (the epoch's last batches are of the next pass), by its name
    assert stats["skipped"]["undecodable_video"] == times[target], stats["skipped"]
    assert target in json.dumps(stats), stats
    assert set(good) - set(bad) == {target}


@pytest.mark.parametrize("family", ["smolvlm", "llava_onevision", "tiling"])
def test_a_family_that_cannot_take_a_samples_videos_skips_it_by_name_and_reads_the_rest(
    corpus, family, caplog
):
    """The default tiling takes no video; LLaVA-OneVision takes it only when its video
    processor samples a fixed number of frames (the model stacks a batch's videos); SmolVLM
    takes videos or images in a sample, not both (its processor's output drops the images'
    pixels then)."""
    from wdsvlm.testing.tiny import tiny_processor

    from .conftest import EXAMPLE

    data, total = corpus
    if family == "tiling":
        options = {"tokenizer": os.path.join(EXAMPLE, "tokenizer"), "tile_size": 32}
        options |= {"max_image_side": 64, "tokens_per_tile": 4}
    else:
        processor = tiny_processor(family)
        if family == "llava_onevision":
            processor.video_processor.do_sample_frames = False  # as its class has it
        options = {"processor": processor}
    loader = wdsvlm.Loader(data, **{**SETTINGS, "max_length": 2048}, **options)
    kinds = set()
    for batch in loader:
        for keys, passes in zip(batch["sample_keys"], batch["sample_passes"], strict=True):
            kinds |= {k for k, p in zip(keys, passes, strict=True) if p == 0}
    stats = loader.stats()
    skipped = 3 if family == "smolvlm" else 6 * 3 + 2 * 3  # video and image / any video
    assert len(kinds) == total - skipped
    assert stats["skipped"]["video_not_supported"] >= skipped, stats["skipped"]
    why = {"smolvlm": "not both", "llava_onevision": "num_frames", "tiling": "images only"}
    assert why[family] in caplog.text


def test_llava_video_tars_made_elsewhere_are_indexed_in_place_and_loaded(tmp_path):
    """Tars as LLaVA-Video style datasets ship them (KEY.mp4 beside KEY.json whose <image>
    stands for the video): ``wdsvlm index`` recognises the videos, the Loader reads them."""
    import io

    from wdsvlm.write.tarindex import index_tars

    shards = tmp_path / "tars"
    shards.mkdir()
    with tarfile.open(shards / "clips-000000.tar", "w") as tar:
        for i, spec in enumerate(SPECS[:4]):
            convo = [
                {"from": "human", "value": "<image>\\nWhat moves?"},
                {"from": "gpt", "value": f"Bar {i}."},
            ]
            for suffix, data in (
                ("mp4", make_video(spec)),
                ("json", json.dumps({"id": spec.name, "conversations": convo}).encode()),
            ):
                info = tarfile.TarInfo(f"{i:06d}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    index_tars(str(shards), format="conversations", show_progress=False)
    index = wdsvlm.load_index(str(shards))
    assert index["totals"]["videos"] == 4
    processor = qwen_processor("qwen3_vl")
    loader = wdsvlm.Loader(str(shards), processor=processor, **SETTINGS)
    keys = [
        k
        for b in loader
        for row, passes in zip(b["sample_keys"], b["sample_passes"], strict=True)
        for k, p in zip(row, passes, strict=True)
        if p == 0
    ]
    assert sorted(keys) == [f"clips-000000.tar/{i:06d}" for i in range(4)]
    assert sum(loader.stats()["skipped"].values()) == 0


def test_a_video_processor_with_other_settings_cannot_resume_a_video_datasets_state(corpus):
    from .conftest import EXAMPLE

    data, _ = corpus
    loader = wdsvlm.Loader(data, processor=qwen_processor("qwen2_vl"), **SETTINGS)
    next(iter(loader))
    state = loader.state_dict()
    loader.close()
    other = qwen_processor("qwen2_vl")
    other.video_processor.fps = 1  # other frames, other tokens
    with pytest.raises(ValueError, match="cannot resume.*tokenizer"):
        wdsvlm.Loader(data, processor=other, **SETTINGS).load_state_dict(state)
    # a dataset of images only keeps its fingerprint whatever the video settings
    images = wdsvlm.Loader(EXAMPLE, processor=qwen_processor("qwen2_vl"), **SETTINGS)
    next(iter(images))
    state = images.state_dict()
    images.close()
    wdsvlm.Loader(EXAMPLE, processor=other, **SETTINGS).load_state_dict(state)


@pytest.mark.parametrize(
    "budget, reason",
    [
        ({"max_tiles_per_pack": 200}, "too_many_vision_units"),
        ({"max_length": 160}, "too_many_tokens"),
    ],
)
def test_a_video_over_a_budget_is_dropped_whole_and_counted_by_name(corpus, budget, reason):
    """A video sample whose patches pass the pack's vision budget, or whose tokens pass
    ``max_length`` (truncation on: no cut may keep part of a video), is dropped and counted
    with its key; no batch holds more than the budgets, and every other sample comes."""
    from wdsvlm.families.qwen_video import QwenVideo
    from wdsvlm.format.videos import VideoInfo

    data, total = corpus
    processor = qwen_processor("qwen2_vl")
    video = QwenVideo(processor, "qwen2_vl")
    options = {**SETTINGS, "truncate": True, **budget}
    loader = wdsvlm.Loader(data, processor=processor, **options)
    seen = set()
    for batch in loader:
        for r, (keys, passes) in enumerate(
            zip(batch["sample_keys"], batch["sample_passes"], strict=True)
        ):
            seen |= {k for k, p in zip(keys, passes, strict=True) if p == 0}
            assert batch["attention_mask"][r].sum() <= options["max_length"]
        if "max_tiles_per_pack" in budget and "video_units" in batch:
            assert int(batch["video_units"].sum()) <= 200 * options["batch_size"]
    stats = loader.stats()
    dropped = set(stats["dropped_examples"][reason])  # up to 10 named per reason and worker
    index = {}
    for shard in wdsvlm.load_index(data)["shards"]:
        index |= {f"{shard['name']}/{e['key']}": e for e in shard["entries"]}
    missing = set(index) - seen
    assert dropped and dropped <= missing and stats["dropped"][reason] >= len(missing)
    for name, entry in index.items():
        infos = [VideoInfo.from_dict(m) for m in entry.get("videos", [])]
        units = sum(video.cost(info) for info in infos)
        tokens = sum(len(video.token_ids(info)) for info in infos)
        if name in missing:  # a sample with a video, over the budget (most of it its video's)
            assert units > 200 if reason == "too_many_vision_units" else tokens > 160 // 2, name
        elif reason == "too_many_vision_units":
            assert units <= 200, name


def test_inspect_shows_each_videos_frames_sampled_and_tokens_and_draws_them(corpus, tmp_path):
    from PIL import Image

    from wdsvlm.families.qwen_video import QwenVideo
    from wdsvlm.format.videos import VideoInfo
    from wdsvlm.tools.cli import main
    from wdsvlm.tools.samples import inspect_samples

    data, _ = corpus
    processor = qwen_processor("qwen3_vl")
    video = QwenVideo(processor, "qwen3_vl")
    views = inspect_samples(data, n=10, processor=processor)
    two = next(v for v in views if len(v.videos) == 2)  # the two-video sample
    for shown in two.videos:
        info = VideoInfo.from_dict(shown.info.as_dict())
        assert shown.sampled and shown.frames == video.frames(info).tolist()
        assert shown.tokens == len(video.token_ids(info))
        assert f"{len(shown.frames)} frames sampled" in shown.describe()
    assert two.tokens["image"] == sum(
        int((video.token_ids(v.info) == video.video_token_id).sum()) for v in two.videos
    )
    # without a processor: a few evenly spaced frames, and the way to see the sampled ones
    plain = inspect_samples(data, n=10)
    assert "pass --processor" in next(v for v in plain if v.videos).describe()
    out = str(tmp_path / "sheet.png")
    assert main(["inspect", data, "-n", "10", "--processor", "tiny:qwen2_vl", "--out", out]) == 0
    assert Image.open(out).size == (1200, 2200)


def test_stats_with_a_processor_counts_videos_their_patches_and_tokens(corpus):
    from wdsvlm.families.qwen_video import QwenVideo
    from wdsvlm.format.videos import VideoInfo
    from wdsvlm.tools.dataset_stats import dataset_stats

    data, total = corpus
    processor = qwen_processor("qwen2_5_vl")
    video = QwenVideo(processor, "qwen2_5_vl")
    found = dataset_stats(
        data, processor=processor, max_length=1024, max_tiles_per_pack=300, show_progress=False
    )
    infos = [
        VideoInfo.from_dict(m)
        for shard in wdsvlm.load_index(data)["shards"]
        for e in shard["entries"]
        for m in e.get("videos", [])
    ]
    assert found.samples == total
    assert found.videos == {
        "videos": len(infos),
        "units": sum(video.cost(i) for i in infos),
        "tokens": sum(len(video.token_ids(i)) for i in infos),
    }
    assert found.dropped["too_many_vision_units"] > 0
    assert "videos" in found.table() and found.as_dict()["videos"]["videos"] == len(infos)


def test_a_video_its_processor_cannot_sample_is_skipped_by_name(tmp_path):
    """LLaVA-OneVision's video processor samples num_frames (4 here) of every video: a video
    of 3 frames cannot be sampled, and is skipped and counted with its key when read; the
    Loader is built and the other samples come."""
    from wdsvlm.testing.tiny import tiny_processor
    from wdsvlm.testing.videos import frame_files

    from .conftest import write_jsonl

    files = []
    for i, data in enumerate(frame_files(SPECS[0], 3)):
        (tmp_path / f"f{i}.jpg").write_bytes(data)
        files.append(f"f{i}.jpg")
    convo = [{"from": "human", "value": "<video>\\nQ?"}, {"from": "gpt", "value": "A."}]
    text = [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]
    records = [
        {"id": "short", "video": files, "fps": 3, "conversations": convo},
        {"id": "text", "conversations": text},
    ]
    out = str(tmp_path / "out")
    wdsvlm.write_dataset(write_jsonl(str(tmp_path / "in.jsonl"), records), out, progress=False)
    loader = wdsvlm.Loader(out, processor=tiny_processor("llava_onevision"), **SETTINGS)
    keys = {k for batch in loader for row in batch["sample_keys"] for k in row}
    stats = loader.stats()
    assert keys == {"data-000000.tar/000000001"}
    assert stats["skipped"]["unsampleable_video"] >= 1
    assert "data-000000.tar/000000000" in stats["skipped_examples"]["unsampleable_video"]
    from wdsvlm.tools.samples import inspect_samples

    (view, _) = inspect_samples(out, processor=tiny_processor("llava_onevision"))
    assert "cannot sample it" in view.describe()
