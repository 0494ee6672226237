"""Video files: what the index records of one, and the frames decoded from it, against
transformers' own ``load_video`` (PyAV); bad videos refused by reason."""

from __future__ import annotations

import numpy as np
import pytest

from wdsvlm.format.videos import UnreadableVideo, VideoInfo, decode_frames, probe_video
from wdsvlm.testing.videos import SPECS, bad_videos, make_video


def load(path, indices):
    from transformers.video_utils import load_video

    return load_video(path, backend="pyav", sample_indices_fn=lambda metadata, **_: indices)


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_the_index_records_what_load_video_reads_without_decoding_it(videos, name):
    spec, data, path = videos[name]
    info = probe_video(data)
    _, metadata = load(path, np.array([0]))
    assert info.frames == metadata.total_num_frames == spec.frames
    assert info.fps == metadata.fps and info.duration == pytest.approx(metadata.duration, abs=1e-12)
    size = (info.width, info.height)
    assert size == (metadata.width, metadata.height) == (spec.width, spec.height)
    assert info.rotation == spec.rotation and info.codec == "h264"
    assert info.keyframes[0] == (0, 0) and len(info.keyframes) == -(-spec.frames // 12)
    assert VideoInfo.from_dict(info.as_dict()) == info  # through the index's JSON


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_the_frames_decoded_from_their_keyframes_are_load_videos_bit_for_bit(videos, name):
    spec, data, path = videos[name]
    info = probe_video(data)
    n = info.frames
    for indices in (
        np.arange(n),  # every frame
        np.linspace(0, n - 1, 4).astype(int),  # a few, far apart
        np.array([n - 1]),  # the last alone: a seek past every keyframe but one
        np.array(sorted({1, 11, 12, 13, n // 2, n - 2} & set(range(n)))),  # around a keyframe
    ):
        expected, _ = load(path, indices)
        got = decode_frames(data, indices, info)
        assert got.dtype == np.uint8 and got.shape == (len(indices), spec.height, spec.width, 3)
        assert np.array_equal(got, expected), (name, indices)


@pytest.mark.parametrize(
    "kind, reason",
    [
        ("truncated", "frame 36 of its stream is cut short"),
        ("truncated-before-index", "not a video container FFmpeg can open"),
        ("no-frames", "not a video container FFmpeg can open"),
        ("no-video-stream", "no video stream"),
        ("unknown-codec", "no codec FFmpeg can decode"),
    ],
)
def test_a_bad_video_is_refused_with_its_reason(kind, reason):
    with pytest.raises(UnreadableVideo, match=reason):
        probe_video(bad_videos()[kind])


def test_a_video_whose_frames_end_early_is_refused_when_decoded(videos):
    _, data, _ = videos["fps24"]
    info = probe_video(data)
    short = make_video(SPECS[0], faststart=True)
    short = short[: len(short) // 2]  # the index says 48 frames; about half are there
    with pytest.raises(UnreadableVideo, match="fewer frames than the index's 48"):
        decode_frames(short, [0, 47], info)
    with pytest.raises(ValueError, match="frames 0..48 asked of a video of 48"):
        decode_frames(data, [0, 48], info)
