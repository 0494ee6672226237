"""Untrusted video bytes: opened only with the demuxer their extension names (a concat script
or a playlist stored as ``.mp4`` reaches no file), refused before a frame is decoded where
their headers state too many pixels, and decoded with the threads the settings give."""

from __future__ import annotations

import errno
import faulthandler
import gc
import io
import os
import signal
import sys
import tarfile
import threading
import time
from fractions import Fraction

import pytest

import wdsvlm
from wdsvlm.errors import BadInputError
from wdsvlm.format.containers import DEMUXERS, VideoTooLarge
from wdsvlm.format.members import VIDEO_EXTENSIONS
from wdsvlm.format.videos import FRAMES, UnreadableVideo, decode_frames, probe_video
from wdsvlm.testing.qwen import qwen_processor
from wdsvlm.testing.videos import SPECS, VideoSpec, make_video, scripts, stated_size

from .conftest import run_process, write_jsonl

SETTINGS = {"max_length": 1024, "batch_size": 2, "shuffle_buffer": 4, "pack_window": 8}
SMALL = VideoSpec("small", Fraction(25), 0.48, 64, 64)  # 12 frames
SENTINELS = ("secret.mp4", "sub/secret.mp4", "frame0.png", "sub/frame1.png", "sub/segment.ts")


def video_dataset(tmp_path, spec: VideoSpec, samples: int) -> str:
    """A dataset of ``samples`` records asking about one clip of ``spec``: its folder."""
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "clip.mp4").write_bytes(make_video(spec))
    convo = [{"from": "human", "value": "<video> what?"}, {"from": "gpt", "value": "A bar."}]
    records = [{"id": f"v{i}", "video": "clip.mp4", "conversations": convo} for i in range(samples)]
    data = str(tmp_path / "out")
    wdsvlm.write_dataset(write_jsonl(str(folder / "in.jsonl"), records), data, progress=False)
    return data


class Sentinels:
    """Named pipes at ``SENTINELS`` under ``folder``, watched: a process that opens one for
    reading blocks until a writer comes, so the watcher sees every opening (none is missed,
    however short), records it, and lets the reader go on with an empty file."""

    def __init__(self, folder):
        self.folder = folder
        self.paths = [os.path.join(folder, name) for name in SENTINELS]
        for path in self.paths:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.mkfifo(path)
        self.opened: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self):
        while not self._stop.is_set():
            for path in self.paths:
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                except OSError as e:
                    if e.errno != errno.ENXIO:  # ENXIO: no reader has it open
                        raise
                    continue
                self.opened.append(os.path.relpath(path, self.folder))
                os.close(fd)
            time.sleep(0.005)

    def close(self):
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture
def sentinels(tmp_path, monkeypatch):
    """The reading process's working directory, with sentinel files in it and a subfolder."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    watched = Sentinels(str(cwd))
    yield watched
    watched.close()


def hostile() -> dict[str, bytes]:
    return scripts("sub/secret.mp4", ("frame0.png", "sub/frame1.png"), "sub/segment.ts")


def test_every_stored_video_extension_has_its_own_demuxer():
    assert set(DEMUXERS) | {FRAMES} == set(VIDEO_EXTENSIONS)
    assert probe_video(make_video(SPECS[1]), "mp4").frames == 12
    with pytest.raises(UnreadableVideo, match="videos are opened only as mp4, mov"):
        probe_video(make_video(SPECS[1]), "m3u8")


def test_scripts_and_playlists_stored_as_mp4_are_refused_at_write_and_open_no_file(
    tmp_path, sentinels
):
    folder = tmp_path / "in"
    folder.mkdir()
    records = []
    for name, body in hostile().items():
        (folder / f"{name}.mp4").write_bytes(body)
        convo = [{"from": "human", "value": "<video> what?"}, {"from": "gpt", "value": "No."}]
        records.append({"id": name, "video": f"{name}.mp4", "conversations": convo})
    text = [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hi."}]
    records.append({"id": "text", "conversations": text})
    summary = wdsvlm.write_dataset(
        write_jsonl(str(folder / "in.jsonl"), records),
        str(tmp_path / "out"),
        skip_bad=True,
        progress=False,
    )
    assert sentinels.opened == []
    assert summary.samples == 1 and summary.skipped == {"unreadable_video": 3}
    for body in hostile().values():
        with pytest.raises(UnreadableVideo, match="not a .mp4 video FFmpeg can open"):
            probe_video(body, "mp4")
        with pytest.raises(UnreadableVideo, match="not a video of the containers wdsvlm opens"):
            probe_video(body)
    assert sentinels.opened == []


def test_scripts_and_playlists_in_place_of_a_video_are_undecodable_at_load_and_open_no_file(
    tmp_path, sentinels
):
    data = video_dataset(tmp_path, SPECS[0], 3)
    # each video member's bytes replaced by a script of the same length: the index says
    # a video of 48 frames, the shard holds a concat script or a playlist stored as KEY.0.mp4
    (shard,) = [n for n in os.listdir(data) if n.endswith(".tar")]
    path = os.path.join(data, shard)
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.name.endswith(".0.mp4")]
    with open(path, "r+b") as f:
        for member, body in zip(members, hostile().values(), strict=True):
            assert len(body) < member.size
            f.seek(member.offset_data)
            f.write(body + b"#" + b" " * (member.size - len(body) - 2) + b"\n")
    loader = wdsvlm.Loader(data, processor=qwen_processor("qwen2_vl"), **SETTINGS)
    batches = list(loader)
    stats = loader.stats()
    assert stats["skipped"]["undecodable_video"] >= 3, stats
    assert not any(len(b["video_pixels"]) for b in batches)
    assert sentinels.opened == []


def test_a_header_forged_to_16000_pixels_square_is_refused_before_a_frame_is_decoded():
    small = make_video(SMALL)
    forged = stated_size(small, 16000)
    with pytest.raises(VideoTooLarge, match="16000x16000, over Pillow's bound"):
        probe_video(forged, "mp4")
    info = probe_video(small, "mp4")
    assert (info.frames, info.width, info.height) == (12, 64, 64)
    with pytest.raises(VideoTooLarge, match=r"12 frames of 64x64 are 49152 pixels, over"):
        probe_video(small, "mp4", max_pixels=49151)
    # at load time, from the bytes' own headers: the index may say otherwise
    with pytest.raises(VideoTooLarge, match="16000x16000"):
        decode_frames(forged, [0], info)
    with pytest.raises(VideoTooLarge, match="max_video_pixels"):
        decode_frames(small, [0], info, max_pixels=49151)


PEAK = """
import resource, sys
from wdsvlm.format.videos import UnreadableVideo, decode_frames, probe_video, VideoInfo
from wdsvlm.testing.videos import VideoSpec, make_video, stated_size
small = make_video(VideoSpec("small", 25, 0.48, 64, 64))
data = stated_size(small, 16000) if sys.argv[2] == "forged" else small
info = probe_video(small, "mp4")  # the index of the small one: the bytes say otherwise
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    probe_video(data, "mp4") if sys.argv[1] == "write" else decode_frames(data, [0, 11], info)
except UnreadableVideo as e:
    print(type(e).__name__, e, file=sys.stderr)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.processes
@pytest.mark.parametrize("step", ["write", "load"])
def test_a_forged_16000_pixels_square_video_costs_a_process_no_more_than_a_small_one(step):
    """Peak memory of a fresh process probing (writing) or decoding (loading) the forged
    clip, over what it held before, against the same for the small clip it was made of."""
    grew = {}
    for kind in ("small", "forged"):
        done = run_process([sys.executable, "-c", PEAK, step, kind], timeout=120)
        assert done.returncode == 0, done.stderr
        grew[kind] = int(done.stdout.split()[-1])
        if kind == "forged":
            assert "VideoTooLarge" in done.stderr and "16000x16000" in done.stderr
    assert grew["forged"] <= grew["small"] + 20, grew  # MB


def decoder_threads() -> int:
    """This process's threads that FFmpeg's decoders started (named ``av:CODEC:...``)."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().startswith("av:")
        except (FileNotFoundError, ProcessLookupError):  # ended meanwhile
            pass
    return count


def test_ffmpeg_decodes_with_the_threads_the_settings_give(videos):
    """FFmpeg's decoder threads alive while a video decodes: none with one thread (the
    default: the worker's own), FFmpeg's own count with 0 (a core each and one more)."""
    spec, data, _ = videos["fps2997"]
    info = probe_video(data, "mp4")
    most = {}
    for threads in (1, 0):
        seen, stop = [0], threading.Event()

        def watch(seen=seen, stop=stop):
            while not stop.is_set():
                seen.append(decoder_threads())
                time.sleep(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        for _ in range(3):
            decode_frames(data, range(info.frames), info, threads=threads)
        stop.set()
        watcher.join()
        most[threads] = max(seen)
    assert most == {1: 0, 0: (os.cpu_count() or 1) + 1}, most
    assert decoder_threads() == 0  # every container closed, its threads ended


def test_the_loader_refuses_a_bad_video_setting():
    with pytest.raises(ValueError, match="max_video_pixels must be a whole number"):
        wdsvlm.Loader("unused", max_video_pixels=0)
    with pytest.raises(ValueError, match="video_threads must be a whole number of at least 0"):
        wdsvlm.Loader("unused", video_threads=-1)


def test_a_video_over_max_video_pixels_is_skipped_at_load_as_video_too_large(tmp_path):
    data = video_dataset(tmp_path, SPECS[1], 2)
    processor = qwen_processor("qwen2_vl")
    for cap, skipped in ((12 * 160 * 120, 0), (12 * 160 * 120 - 1, 2)):
        loader = wdsvlm.Loader(data, processor=processor, max_video_pixels=cap, **SETTINGS)
        list(loader)
        assert loader.stats()["skipped"].get("video_too_large", 0) >= skipped, cap
        assert skipped or "video_too_large" not in loader.stats()["skipped"]
    with pytest.raises(BadInputError, match="230400 pixels, over max_video_pixels"):
        wdsvlm.write_dataset(
            str(tmp_path / "in" / "in.jsonl"),
            str(tmp_path / "again"),
            progress=False,
            max_video_pixels=12 * 160 * 120 - 1,
        )


def _collect_and_exit() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hang prints its stacks
    gc.collect()


@pytest.mark.processes
def test_a_process_forked_after_videos_were_read_or_refused_collects_its_garbage_and_ends():
    """Every container wdsvlm opens is closed before the call returns, on every path (frames
    decoded, a stream that breaks off mid-decode, a header refused), its FFmpeg threads ended:
    a process forked right after (as DataLoader workers are with
    ``multiprocessing_context="fork"``) frees its garbage and ends."""
    import multiprocessing

    data = make_video(SPECS[2], faststart=True)
    info = probe_video(data, "mp4")
    gc.disable()  # nothing freed behind the test's back
    try:
        decode_frames(data, range(0, info.frames, 7), info, threads=0)
        with pytest.raises(UnreadableVideo, match="fewer frames than the index's"):
            decode_frames(data[: len(data) // 2], [0, info.frames - 1], info, threads=0)
        with pytest.raises(VideoTooLarge):
            decode_frames(stated_size(make_video(SMALL), 16000), [0], info, threads=0)
        assert decoder_threads() == 0
        child = multiprocessing.get_context("fork").Process(target=_collect_and_exit)
        child.start()
        child.join(timeout=60)
        if child.is_alive():
            os.kill(child.pid, signal.SIGUSR1)
            time.sleep(1)
            child.kill()
            pytest.fail("a process forked after decoding did not end in 60 s (stacks above)")
        assert child.exitcode == 0
    finally:
        gc.enable()


def encoded(fmt: str, codec: str) -> bytes:
    """12 frames of ``SPECS[1]`` in container ``fmt`` (FFmpeg's muxer name), as ``codec``."""
    import av

    from wdsvlm.testing.videos import frame_pixels

    spec, out = SPECS[1], io.BytesIO()
    with av.open(out, "w", format=fmt) as container:
        stream = container.add_stream(codec, rate=25)
        stream.width, stream.height, stream.pix_fmt = spec.width, spec.height, "yuv420p"
        for i in range(12):
            frame = av.VideoFrame.from_ndarray(
                frame_pixels(i, spec.width, spec.height), format="rgb24"
            )
            frame.pts = i
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


@pytest.mark.parametrize(
    "ext, fmt, codec, unnamed",
    [
        ("mov", "mov", "libx264", "mp4"),
        ("m4v", "mp4", "libx264", "mp4"),
        ("mkv", "matroska", "libx264", "mkv"),
        ("webm", "webm", "libvpx-vp9", "mkv"),
        ("avi", "avi", "mpeg4", "avi"),
    ],
)
def test_each_allowed_container_opens_as_its_extension_names_it_and_no_other(
    ext, fmt, codec, unnamed
):
    data = encoded(fmt, codec)
    info = probe_video(data, ext)
    assert (info.ext, info.frames) == (ext, 12)
    assert decode_frames(data, [0, 11], info).shape == (2, 120, 160, 3)
    assert probe_video(data).ext == unnamed  # bytes without a name: stored as what opened them
    other = "avi" if DEMUXERS[ext] != "avi" else "mkv"
    with pytest.raises(UnreadableVideo, match=f"not a .{other} video FFmpeg can open"):
        probe_video(data, other)  # named as another container than its bytes hold


def test_wdsvlm_index_refuses_a_video_over_its_max_video_pixels_by_sample(tmp_path):
    data = video_dataset(tmp_path, SMALL, 3)  # 12 frames of 64x64: 49,152 pixels
    index = wdsvlm.index_tars
    taken = index(data, output=str(tmp_path / "a"), show_progress=False, max_video_pixels=49_152)
    assert (taken.samples, taken.skipped) == (3, {})
    with pytest.raises(
        BadInputError, match=r"000000002: video 0.mp4: .* max_video_pixels \(49151\)"
    ):
        index(data, output=str(tmp_path / "b"), show_progress=False, max_video_pixels=49_151)
