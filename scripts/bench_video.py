"""Benchmark: video samples through the Loader against the per-sample path a user would write.

    python scripts/bench_video.py [--copies 2] [--out /tmp/wdsvlm-video-bench]
    python scripts/bench_video.py --threads [--rounds 2]

The corpus: the test videos of ``wdsvlm.testing.videos`` (24, 25, 29.97, 30 and 60 fps, a
rotated and a variable-frame-rate one, 0.5 to 3 s) and one 30 s 720p clip, each as a
LLaVA-Video record, ``--copies`` times, written with ``wdsvlm write``. Processor: the tiny
Qwen2.5-VL processor with its real video processor (2 frames a second, 4 to 16 frames).

- **Loader**: ``wdsvlm.Loader(processor=...)`` with 0 workers, one pass, each batch through
  ``wdsvlm.model_inputs`` (the normalisation counted), packed rows of ``--max-length``.
- **Per sample**: for each record, transformers' ``load_video(path, backend="pyav")`` (every
  frame decoded) and the processor on the frames (which samples them itself), then batches of
  ``--batch-size`` samples padded to the longest.

Both give the same tokens and pixels per sample (``tests/test_video_families.py`` proves it).
Printed: samples/s of each and their ratio, measured side by side in one run; the seconds a
sampled frame takes to decode, ``decode_frames`` (from the keyframe before it) against
``load_video`` (the whole stream); and the peak memory of decoding the 30 s clip's sampled
frames (a fresh process) against the bytes of those frames.

With ``--threads``, only FFmpeg's decode threads are compared on the 30 s 720p clip: one
thread (the Loader's default, ``video_threads=1``) against FFmpeg's own count
(``video_threads=0``: a thread per core and one more), each in a fresh process, decoding the
frames the processor samples and then 64 frames spread over the clip; printed: the seconds
and the peak memory growth of each, rounds alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def corpus(out: str, copies: int) -> tuple[str, list[dict]]:
    """The written dataset and the records, their video files under ``out``."""
    import wdsvlm
    from wdsvlm.testing.videos import BIG, SPECS, make_video

    os.makedirs(out, exist_ok=True)
    records = []
    for spec in (*SPECS, BIG):
        path = os.path.join(out, f"{spec.name}.mp4")
        if not os.path.exists(path):
            with open(path, "wb") as f:
                f.write(make_video(spec))
        for copy in range(copies):
            convo = [
                {"from": "human", "value": "<image>\nWhat moves?"},
                {"from": "gpt", "value": f"A bar, {copy}."},
            ]
            records.append({"id": f"{spec.name}-{copy}", "video": path, "conversations": convo})
    with open(os.path.join(out, "in.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    data = os.path.join(out, "data")
    wdsvlm.write_dataset(os.path.join(out, "in.jsonl"), data, overwrite=True, progress=False)
    return data, records


def loader_pass(data: str, processor, args) -> tuple[int, float]:
    import wdsvlm

    loader = wdsvlm.Loader(
        data, processor=processor, max_length=args.max_length, batch_size=2, shuffle_buffer=4
    )
    started, samples = time.perf_counter(), 0
    for batch in loader:
        wdsvlm.model_inputs(batch)
        samples += sum(p == 0 for row in batch["sample_passes"] for p in row)
    return samples, time.perf_counter() - started


def per_sample_pass(records: list[dict], processor, args) -> tuple[int, float]:
    import torch
    from transformers.video_utils import load_video

    started, batch = time.perf_counter(), []
    for record in records:
        frames, metadata = load_video(record["video"], backend="pyav")
        convo = [
            {
                "role": "user",
                "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A bar."}]},
        ]
        text = processor.apply_chat_template(convo, tokenize=False)
        out = processor(
            text=[text], videos=[frames], video_metadata=[metadata], return_tensors="pt"
        )
        batch.append(out)
        if len(batch) == args.batch_size or record is records[-1]:
            longest = max(len(b["input_ids"][0]) for b in batch)
            ids = torch.full((len(batch), longest), 0)
            for i, b in enumerate(batch):
                ids[i, : len(b["input_ids"][0])] = b["input_ids"][0]
            torch.cat([b["pixel_values_videos"] for b in batch])
            batch = []
    return len(records), time.perf_counter() - started


def decode_seconds(path: str, processor) -> tuple[float, float, int]:
    """Seconds per sampled frame: decode_frames, then load_video of the whole stream."""
    from transformers.video_utils import load_video

    from wdsvlm.families.qwen_video import QwenVideo
    from wdsvlm.format.videos import decode_frames, probe_video

    data = open(path, "rb").read()
    info = probe_video(data)
    indices = QwenVideo(processor, "qwen2_5_vl").frames(info)
    started = time.perf_counter()
    decode_frames(data, indices, info)
    mine = time.perf_counter() - started
    started = time.perf_counter()
    load_video(path, backend="pyav")
    theirs = time.perf_counter() - started
    return mine / len(indices), theirs / len(indices), len(indices)


def peak_child(path: str, indices: list[int], threads: int = 1) -> None:
    """In a fresh process (no torch, so the high-water mark starts low): the peak memory
    growth and the seconds of decoding the frames ``indices`` of ``path`` with ``threads``."""
    from wdsvlm.format.videos import decode_frames, probe_video

    data = open(path, "rb").read()
    info = probe_video(data)
    with open("/proc/self/clear_refs", "w") as f:  # Linux: the high-water mark starts again here
        f.write("5")
    before = _status_bytes("VmHWM")
    started = time.perf_counter()
    frames = decode_frames(data, indices, info, threads=threads)
    seconds = time.perf_counter() - started
    after = _status_bytes("VmHWM")
    print(json.dumps({"growth": after - before, "pixels": frames.nbytes, "seconds": seconds}))


def _child(spec: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--peak", spec], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare_threads(out: str, rounds: int) -> None:
    """FFmpeg's decode threads, 1 against its own count, on the 30 s 720p clip."""
    from wdsvlm.families.qwen_video import QwenVideo
    from wdsvlm.format.videos import probe_video
    from wdsvlm.testing.qwen import qwen_processor
    from wdsvlm.testing.videos import BIG, make_video

    os.makedirs(out, exist_ok=True)
    big = os.path.join(out, f"{BIG.name}.mp4")
    if not os.path.exists(big):
        with open(big, "wb") as f:
            f.write(make_video(BIG))
    with open(big, "rb") as f:
        info = probe_video(f.read())
    sampled = QwenVideo(qwen_processor("qwen2_5_vl"), "qwen2_5_vl").frames(info)
    dense = list(range(0, info.frames, info.frames // 64))[:64]  # 64 frames, spread
    for name, indices in (("sampled", list(sampled)), ("64 spread", dense)):
        for r in range(rounds):
            for threads in (1, 0):
                got = _child(f"{big}:{','.join(map(str, indices))}:{threads}")
                print(
                    f"round {r}, {len(indices)} frames ({name}), video_threads={threads}: "
                    f"{got['seconds']:.3f} s, peak growth {got['growth'] / 2**20:.0f} MB "
                    f"({got['pixels'] / 2**20:.0f} MB of frames)"
                )


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default="/tmp/wdsvlm-video-bench")
    parser.add_argument("--threads", action="store_true", help="compare decode threads only")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--peak", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak:
        path, indices, threads = args.peak.rsplit(":", 2)
        return peak_child(path, [int(i) for i in indices.split(",")], int(threads))
    if args.threads:
        return compare_threads(args.out, args.rounds)
    from wdsvlm.testing.qwen import qwen_processor

    processor = qwen_processor("qwen2_5_vl")
    data, records = corpus(args.out, args.copies)
    rounds = []
    for _ in range(2):  # A B A B: the same machine noise on both
        rounds.append(
            (loader_pass(data, processor, args), per_sample_pass(records, processor, args))
        )
    for (n, mine), (m, theirs) in rounds:
        print(
            f"Loader {n / mine:7.1f} samples/s   per sample {m / theirs:7.1f} samples/s   "
            f"ratio {(n / mine) / (m / theirs):.2f}x"
        )
    big = os.path.join(args.out, "fps30-720p-30s.mp4")
    mine, theirs, frames = decode_seconds(big, processor)
    print(
        f"30 s 720p, {frames} sampled frames: decode_frames {mine * 1000:.1f} ms a frame, "
        f"load_video {theirs * 1000:.1f} ms a sampled frame ({theirs / mine:.1f}x)"
    )
    from wdsvlm.families.qwen_video import QwenVideo
    from wdsvlm.format.videos import probe_video

    with open(big, "rb") as f:
        indices = QwenVideo(processor, "qwen2_5_vl").frames(probe_video(f.read()))
    peak = _child(f"{big}:{','.join(map(str, indices))}:1")
    print(
        f"peak memory decoding them: {peak['growth'] / 2**20:.0f} MB for "
        f"{peak['pixels'] / 2**20:.0f} MB of frames ({peak['growth'] / peak['pixels']:.2f}x)"
    )


if __name__ == "__main__":
    main()
