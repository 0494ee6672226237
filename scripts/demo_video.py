"""Video, end to end on this machine (``make demo-video``): write a small LLaVA-Video style
dataset, look at it, and train a tiny Qwen2.5-VL on it for one pass.

    python scripts/demo_video.py [--out demo_out/video] [--max-length 2048]

The videos are made here (``wdsvlm.testing.videos``: 24 to 60 fps, a rotated and a
variable-frame-rate one), with an image sample, a text-only one, a sample of two videos and
one given as its frames. The model is tiny and random, built from its config; the processor is
Qwen2.5-VL's with its real video processor (2 frames a second). Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def write_corpus(out: str) -> str:
    """The dataset, written from records whose files are made under ``out``."""
    from PIL import Image

    import wdsvlm
    from wdsvlm.testing.videos import SPECS, frame_files, make_video

    files = os.path.join(out, "files")
    os.makedirs(files, exist_ok=True)
    for spec in SPECS:
        with open(os.path.join(files, f"{spec.name}.mp4"), "wb") as f:
            f.write(make_video(spec))
    frames = []
    for i, data in enumerate(frame_files(SPECS[0], 8)):
        frames.append(f"frames/{i:03d}.jpg")
        os.makedirs(os.path.join(files, "frames"), exist_ok=True)
        with open(os.path.join(files, frames[-1]), "wb") as f:
            f.write(data)
    Image.new("RGB", (96, 64), (200, 40, 40)).save(os.path.join(files, "red.jpg"))

    def turn(question: str, answer: str) -> list[dict]:
        return [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]

    records = [
        {
            "id": s.name,
            "video": f"{s.name}.mp4",
            "conversations": turn("<image>\nWhat moves?", "A bar."),
        }
        for s in SPECS
    ]
    records += [
        {
            "id": "two",
            "video": ["fps24.mp4", "vfr.mp4"],
            "conversations": turn("<video> or <video>?", "Both."),
        },
        {
            "id": "frames",
            "video": frames,
            "fps": 4,
            "conversations": turn("<video>\nAnd?", "A bar."),
        },
        {"id": "image", "image": "red.jpg", "conversations": turn("<image>\nColour?", "Red.")},
        {"id": "text", "conversations": turn("Hello?", "Hi.")},
    ]
    with open(os.path.join(files, "in.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    data = os.path.join(out, "data")
    summary = wdsvlm.write_dataset(
        os.path.join(files, "in.jsonl"), data, samples_per_shard=4, overwrite=True, progress=False
    )
    print(f"wrote {summary.samples} samples in {summary.shards} shards to {data}")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="demo_out/video")
    parser.add_argument("--max-length", type=int, default=2048)
    args = parser.parse_args(argv)

    import torch

    import wdsvlm
    from wdsvlm.testing.tiny import tiny_model
    from wdsvlm.tools.samples import inspect_samples

    data = write_corpus(args.out)
    processor = wdsvlm.testing.qwen.qwen_processor("qwen2_5_vl")
    views = inspect_samples(data, n=3, processor=processor)
    print("\n\n".join(view.describe() for view in views))

    from wdsvlm.tools.pictures import contact_sheet

    sheet = os.path.join(args.out, "sheet.png")
    contact_sheet(inspect_samples(data, n=12, processor=processor), sheet)
    print(f"contact sheet: {sheet}")

    torch.manual_seed(0)
    model = tiny_model("qwen2_5_vl", processor)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = wdsvlm.Loader(
        data, processor=processor, max_length=args.max_length, batch_size=2, shuffle_buffer=4
    )
    for step, batch in enumerate(loader):
        inputs = wdsvlm.model_inputs(batch)
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        videos = len(inputs.get("video_grid_thw", ()))
        print(
            f"step {step}: loss {loss.item():.3f}, {videos} videos, "
            f"{int(batch['attention_mask'].sum())} tokens"
        )
    stats = loader.stats()
    print(f"fill {stats['fill']:.3f}, dropped {stats['dropped']}, skipped {stats['skipped']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
