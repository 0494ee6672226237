"""Video records as people have them: LLaVA-Video's ``<image>`` standing for a video,
``messages`` with video parts, videos and images in one record; markers placed or refused."""

from __future__ import annotations

import numpy as np
import pytest

from wdsvlm.errors import InputError
from wdsvlm.families.hf_processor import content_items
from wdsvlm.format.conversation import conversation_of, place_images


def placed(record: dict, images: int, videos: int) -> list[str]:
    messages = conversation_of(record, "r.jsonl line 1")
    place_images(messages, images, "r.jsonl line 1", n_videos=videos)
    return [m["content"] for m in messages]


def llava(question: str) -> dict:
    return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "A."}]}


def test_llava_videos_image_marker_stands_for_its_video():
    assert placed(llava("<image>\nWhat happens?"), 0, 1) == ["<video>\nWhat happens?", "A."]


def test_markers_a_text_lacks_go_first_videos_before_images():
    assert placed(llava("What happens?"), 1, 2)[0] == "<video><video><image>\nWhat happens?"
    assert placed(llava("<image> then?"), 1, 1)[0] == "<video>\n<image> then?"


def test_video_parts_of_messages_are_video_markers_in_place():
    record = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image"},
                    {"type": "video"},
                    {"type": "text", "text": "Same?"},
                ],
            },
            {"role": "assistant", "content": "No."},
        ]
    }
    assert placed(record, 1, 1)[0] == "<image><video>Same?"
    assert content_items("<image><video>Same?") == [
        {"type": "image"},
        {"type": "video"},
        {"type": "text", "text": "Same?"},
    ]


@pytest.mark.parametrize(
    "question, images, videos, reason",
    [
        ("<video><video> twice", 0, 1, "video_count_mismatch"),
        ("<video> and <image>", 2, 1, "image_count_mismatch"),
    ],
)
def test_markers_of_a_kind_that_do_not_match_its_count_are_refused(
    question, images, videos, reason
):
    with pytest.raises(InputError) as caught:
        placed(llava(question), images, videos)
    assert caught.value.reason == reason and "r.jsonl line 1" in str(caught.value)


@pytest.fixture
def video_input(tmp_path):
    """LLaVA-Video records (a video each, ``<image>`` standing for it), one with two videos,
    one with a video and an image, and a text-only one; their files beside them."""
    from wdsvlm.testing.videos import SPECS, make_video

    from .conftest import make_image, write_jsonl

    for spec in SPECS[:3]:
        (tmp_path / f"{spec.name}.mp4").write_bytes(make_video(spec))
    make_image(str(tmp_path / "a.jpg"), (64, 48), "JPEG")

    def llava_video(i, video, question="<image>\nWhat happens?", **more):
        convo = [{"from": "human", "value": question}, {"from": "gpt", "value": f"Answer {i}."}]
        return {"id": f"v{i}", "video": video, "conversations": convo, **more}

    records = [
        llava_video(0, "fps24.mp4"),
        llava_video(1, ["fps25.mp4", "fps2997.mp4"], "<video> then <video>: same?"),
        llava_video(2, "fps25.mp4", "<image> and <video>?", image="a.jpg"),
        {
            "id": "t3",
            "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}],
        },
    ]
    return write_jsonl(str(tmp_path / "videos.jsonl"), records), tmp_path


def test_video_records_are_written_as_they_are_with_what_planning_needs(video_input, tmp_path):
    import json
    import tarfile

    from wdsvlm import load_index, write_dataset
    from wdsvlm.format.videos import probe_video

    path, folder = video_input
    out = str(tmp_path / "out")
    write_dataset(path, out, progress=False)
    index = load_index(out)
    (shard,) = index["shards"]
    with tarfile.open(f"{out}/{shard['name']}") as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    names = sorted(members)
    keys = sorted({n.split(".", 1)[0] for n in names})
    assert [n.split(".", 1)[1] for n in names if not n.endswith(".json")] == [
        "0.mp4",  # sample 0
        "0.mp4",  # sample 1: two videos
        "1.mp4",
        "0.jpg",  # sample 2: numbered in the order of the markers, the image first here
        "1.mp4",
    ]
    assert members[f"{keys[0]}.0.mp4"] == (folder / "fps24.mp4").read_bytes()  # as it was
    doc = json.loads(members[f"{keys[0]}.json"])
    assert doc["messages"][0]["content"] == "<video>\nWhat happens?"
    entries = shard["entries"]
    assert [len(e.get("videos", [])) for e in entries] == [1, 2, 1, 0]
    assert entries[1]["videos"][1] == probe_video((folder / "fps2997.mp4").read_bytes()).as_dict()
    assert entries[2]["images"] == [[64, 48]] and "videos" not in entries[3]
    totals = index["totals"]
    assert totals["videos"] == 4 and totals["images"] == 1 and totals["text_only"] == 1
    assert shard["sums"]["videos"] == 4 and shard["sums"]["text_only"] == 1


@pytest.mark.parametrize(
    "kind, reason, words",
    [
        ("missing", "missing_video", ["nope.mp4", "not found"]),
        ("truncated", "unreadable_video", ["truncated.mp4", "not a decodable video", "cut short"]),
        ("no-video-stream", "unreadable_video", ["no-video-stream.mp4", "no video stream"]),
        ("unknown-codec", "unreadable_video", ["unknown-codec.mp4", "no codec"]),
    ],
)
def test_a_bad_video_is_refused_naming_file_line_and_id_or_skipped(
    video_input, tmp_path, kind, reason, words
):
    import json

    from wdsvlm import BadInputError, write_dataset
    from wdsvlm.testing.videos import bad_videos

    path, folder = video_input
    name = "nope.mp4" if kind == "missing" else f"{kind}.mp4"
    if kind != "missing":
        (folder / name).write_bytes(bad_videos()[kind])
    bad = {
        "id": "bad",
        "video": name,
        "conversations": [
            {"from": "human", "value": "<image>\nQ?"},
            {"from": "gpt", "value": "A."},
        ],
    }
    with open(path, "a") as f:
        f.write(json.dumps(bad) + "\n")
    out = str(tmp_path / "out")
    with pytest.raises(BadInputError) as err:
        write_dataset(path, out, progress=False)
    for word in ["videos.jsonl line 5", "'bad'", *words]:
        assert word in str(err.value)
    summary = write_dataset(path, out, skip_bad=True, progress=False)
    assert summary.samples == 4 and summary.skipped == {reason: 1}


def test_a_samples_videos_are_not_taken_for_its_images():
    from wdsvlm.format.images import image_members
    from wdsvlm.format.videos import video_members

    sample = {"json": b"", "0.jpg": b"", "1.mp4": b"", "2.PNG": b"", "10.webm": b"", "11.mov": b""}
    assert image_members(sample) == ["0.jpg", "2.PNG"]
    assert video_members(sample) == ["1.mp4", "10.webm", "11.mov"]


def test_a_samples_videos_count_in_its_vision_units_and_a_cut_keeps_only_whole_ones():
    import numpy as np

    from wdsvlm.pipeline.pack import truncate_at_answer, vision_units

    ids = np.arange(40)
    labels = np.full(40, -100)
    labels[10:12] = ids[10:12]  # answer 1 ends at 12
    labels[30:32] = ids[30:32]  # answer 2 ends at 32
    sample = {
        "input_ids": ids,
        "labels": labels,
        "num_tokens": 40,
        "image_tiles": [4],
        "image_at": [2],
        "video_units": [16, 8],
        "video_at": [5, 20],  # the second video's tokens come after answer 1
        "0.jpg": b"i",
        "1.mp4": b"v",
        "2.mp4": b"w",
        "__meta__": {"images": [[8, 8]], "videos": [{"frames": 1}, {"frames": 2}]},
    }
    assert vision_units(sample) == 4 + 16 + 8
    cut = truncate_at_answer(sample, 20)
    assert cut["num_tokens"] == 12 and vision_units(cut) == 4 + 16
    assert cut["video_units"] == [16] and cut["video_at"] == [5]
    assert "1.mp4" in cut and "2.mp4" not in cut and cut["__meta__"]["videos"] == [{"frames": 1}]
    assert sample["__meta__"]["videos"] == [{"frames": 1}, {"frames": 2}]  # the original kept


def _frames_record(folder, name: str, count: int, fps, **more) -> dict:
    from wdsvlm.testing.videos import SPECS, frame_files

    files = []
    for i, data in enumerate(frame_files(SPECS[0], count)):
        (folder / f"{name}{i:03d}.jpg").write_bytes(data)
        files.append(f"{name}{i:03d}.jpg")
    convo = [{"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "A."}]
    return {"id": name, "video": files, "fps": fps, "conversations": convo, **more}


def test_a_video_given_as_its_frames_is_stored_as_they_are_with_its_frame_rate(tmp_path):
    """``"video": ["f000.jpg", ...]`` with the record's ``fps``: one video, its frame files
    stored as they are in one member (a tar of them), its frames and rate in the index."""
    import json
    import tarfile

    from wdsvlm import load_index, write_dataset
    from wdsvlm.format.tarball import tar_members
    from wdsvlm.format.videos import VideoInfo, decode_frames

    from .conftest import write_jsonl

    records = [_frames_record(tmp_path, "f", 7, 2.5)]
    out = str(tmp_path / "out")
    write_dataset(write_jsonl(str(tmp_path / "in.jsonl"), records), out, progress=False)
    (shard,) = load_index(out)["shards"]
    with tarfile.open(f"{out}/{shard['name']}") as tar:
        members = {m.name.split(".", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers()}
    assert sorted(members) == ["0.frames", "json"]
    stored = tar_members(members["0.frames"])
    assert sorted(stored) == [*(f"{i:06d}.jpg" for i in range(7)), "meta.json"]
    assert json.loads(stored["meta.json"]) == {"fps": 2.5}  # the rate travels with the frames
    assert [stored[f"{i:06d}.jpg"] for i in range(7)] == [
        (tmp_path / f"f{i:03d}.jpg").read_bytes() for i in range(7)
    ]
    meta = shard["entries"][0]["videos"][0]
    assert (meta["ext"], meta["frames"], meta["fps"], meta["duration"]) == ("frames", 7, 2.5, 2.8)
    assert (meta["width"], meta["height"], meta["codec"]) == (320, 240, "jpg")
    # the frames asked for, decoded as images are, in the order asked
    from PIL import Image

    got = decode_frames(members["0.frames"], [5, 0, 5], VideoInfo.from_dict(meta))
    for row, i in zip(got, [5, 0, 5], strict=True):
        assert np.array_equal(row, np.asarray(Image.open(tmp_path / f"f{i:03d}.jpg")))
    # indexed again from the shard alone (wdsvlm index, a scan): the same record, rate included
    from wdsvlm.format.tarscan import scan_index

    (scanned,) = scan_index([f"{out}/{shard['name']}"])["shards"]
    assert scanned["entries"][0]["videos"] == [meta]


@pytest.mark.parametrize(
    "change, words",
    [
        ({"fps": None}, ["frame rate is needed", "fps"]),
        ({"fps": [2, 3]}, ["2 frame rates (fps) for 1 videos"]),
        ({"video": ["f000.jpg", "clip.mp4"]}, ["image files only"]),
        ({"other": "f001.jpg"}, ["frame 1 is 16x16, frame 0 is 320x240"]),
        ({"other": "f002.jpg", "text": True}, ["frame 2", "not a decodable image"]),
        (
            {"other": "f001.jpg", "gone": True},
            ["frame 1 of", "f001.jpg not found", "missing_video"],
        ),
        ({"fps": float("nan")}, ["frame rate is needed", "nan"]),
    ],
)
def test_bad_frames_are_refused_naming_the_record_and_the_frame(tmp_path, change, words):
    from wdsvlm import BadInputError, write_dataset

    from .conftest import make_image, write_jsonl

    record = _frames_record(tmp_path, "f", 3, 2)
    if "other" in change:
        if change.get("gone"):
            (tmp_path / change["other"]).unlink()
        elif change.get("text"):
            (tmp_path / change["other"]).write_bytes(b"not a picture")
        else:
            make_image(str(tmp_path / change["other"]), (16, 16), "JPEG")
    record |= {k: v for k, v in change.items() if k in ("fps", "video")}
    if "video" in change:
        record["conversations"][0]["value"] = "<video><video>\nQ?"
    path = write_jsonl(str(tmp_path / "in.jsonl"), [record])
    with pytest.raises(BadInputError) as err:
        write_dataset(path, str(tmp_path / "out"), progress=False)
    for word in ["in.jsonl line 1", "'f'", *words]:
        assert word in str(err.value), str(err.value)


def test_parquet_rows_with_embedded_videos_are_written_as_they_are(videos, tmp_path):
    """A Hub Parquet file whose ``videos`` column holds lists of ``{bytes, path}`` structs (as
    the datasets library's Video feature stores them), null in a text-only row."""
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    from wdsvlm import load_index, write_dataset

    one, two = videos["fps25"][1], videos["vfr"][1]
    convo = [{"from": "human", "value": "<video>\nQ?"}, {"from": "gpt", "value": "A."}]
    two_convo = [{"from": "human", "value": "<video><video>\nQ?"}, {"from": "gpt", "value": "A."}]
    text = [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]
    table = pa.table(
        {
            "id": ["a", "b", "c"],
            "videos": [
                [{"bytes": one, "path": "a.mp4"}],
                [{"bytes": two, "path": "b.mp4"}, {"bytes": one, "path": "a.mp4"}],
                None,  # a text-only row
            ],
            "conversations": [convo, two_convo, text],
        }
    )
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet")
    out = str(tmp_path / "out")
    write_dataset(str(tmp_path / "train-00000-of-00001.parquet"), out, progress=False)
    (shard,) = load_index(out)["shards"]
    with tarfile.open(f"{out}/{shard['name']}") as tar:
        stored = [tar.extractfile(m).read() for m in tar.getmembers() if ".json" not in m.name]
    assert stored == [one, two, one]  # each row's list, item by item
    from wdsvlm.format.videos import probe_video

    metas = [[m for m in e.get("videos", [])] for e in shard["entries"]]
    assert metas == [
        [probe_video(one).as_dict()],
        [probe_video(two).as_dict(), probe_video(one).as_dict()],
        [],
    ]
    assert metas[0][0]["ext"] == "mp4"  # named by the container
