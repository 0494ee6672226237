"""Video files: what the index records of one, and the frames decoded from it, against
transformers' own ``load_video`` (PyAV) and a sequential decode (clips with B-frames, open
GOPs, leading frames an edit list hides, a variable rate, a rotation); bad videos refused by
reason."""

from __future__ import annotations

import io

import numpy as np
import pytest

from wdsvlm.format.videos import UnreadableVideo, VideoInfo, decode_frames, probe_video
from wdsvlm.testing.videos import SPECS, bad_videos, frame_pixels, hide_start, make_video


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
        ("truncated-before-index", "not a video of the containers wdsvlm opens"),
        ("no-frames", "not a video of the containers wdsvlm opens"),
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


def sequential(data: bytes) -> list[np.ndarray]:
    """Every frame a plain decode from the start gives, in order (``load_video``'s frames)."""
    import av

    with av.open(io.BytesIO(data), format="mp4") as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


CLIPS = [
    (spec.name, encoding, hidden)
    for spec in SPECS
    for encoding in ("plain", "bframes", "open-gop")
    for hidden in (0, 1, 2)
    if spec.name != "fps60" or encoding == "open-gop"  # the slowest to encode: one of them
]


@pytest.mark.parametrize("name, encoding, hidden", CLIPS)
def test_every_frame_asked_is_the_sequential_decodes_frame_of_that_number(name, encoding, hidden):
    """B-frames, open GOPs, ``hidden`` leading frames behind an edit list (a cut with
    ``-c copy``), a variable rate, a rotation: the index counts the frames a sequential decode
    gives, and the frames ``i, j, ...`` are its frames ``i, j, ...`` bit for bit, whatever
    else is asked in the same call."""
    spec = next(s for s in SPECS if s.name == name)
    data = make_video(spec, encoding=encoding)
    if hidden:
        data = hide_start(data, hidden)
    frames = sequential(data)
    info = probe_video(data, "mp4")
    assert info.frames == len(frames) == spec.frames - hidden
    assert info.duration == pytest.approx(len(frames) / info.fps)
    n = info.frames
    rng = np.random.default_rng(len(CLIPS))
    for indices in (
        range(n),  # every frame
        [0, 12, 20, 30],
        [11, 13],
        [n - 1, 0, n // 2],  # any order, a frame from the end first
        [5, 5, 11],  # one frame twice
        rng.choice(n, min(n, 6), replace=False),
    ):
        indices = [int(i) for i in indices if i < n]
        got = decode_frames(data, indices, info)
        for row, i in enumerate(indices):
            assert np.array_equal(got[row], frames[i]), (name, encoding, hidden, indices, i)


def test_a_cut_clip_with_one_frame_before_zero_gives_the_frames_a_sequential_decode_numbers():
    """A clip remuxed with its first frame before time 0: frames 0, 12, 20, 30 are the
    clip's pictures 1, 13, 21, 31 (each frame shows its picture's number as a bar)."""
    spec = SPECS[0]
    data = hide_start(make_video(spec), 1)
    info = probe_video(data, "mp4")
    assert info.frames == 47

    def picture(pixels: np.ndarray) -> int:
        errors = [
            np.abs(pixels.astype(int) - frame_pixels(k, spec.width, spec.height)).mean()
            for k in range(spec.frames)
        ]
        return int(np.argmin(errors))

    got = decode_frames(data, [0, 12, 20, 30], info)
    assert [picture(p) for p in got] == [1, 13, 21, 31]
    assert [picture(p) for p in decode_frames(data, [11, 13], info)] == [12, 14]
