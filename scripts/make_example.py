"""Make shards_example/: a small, real wdsvlm dataset and a tokenizer trained on its text.

    python scripts/make_example.py [--out shards_example] [--samples 320] [--seed 0]

Images are drawn with Pillow (shapes on plain or gradient backgrounds, varied sizes and aspect
ratios, JPEG and PNG, a few grey, palette, RGBA and EXIF-rotated ones). Texts talk about what
is drawn, in a realistic mix: short VQA answers, captions, long detailed descriptions, a few
multi-turn, multi-image and text-only samples. The records are written as one LLaVA JSON file
and one Cauldron JSONL file, then through `wdsvlm.write_dataset`, so this script also
exercises the writer end to end. A byte-level BPE tokenizer with a ChatML chat template is
trained on the texts and saved to OUT/tokenizer (loads offline with AutoTokenizer).
Everything is seeded: a rerun gives the same dataset.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile

from PIL import Image, ImageDraw

from wdsvlm import write_dataset

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (140, 60, 170),
    "orange": (245, 140, 30),
    "black": (20, 20, 20),
    "white": (250, 250, 250),
}
BACKGROUNDS = {"light gray": (215, 215, 215), "beige": (235, 225, 200), "sky blue": (170, 210, 240)}
SHAPES = ("circle", "square", "triangle")
ASPECTS = ((1, 1), (4, 3), (3, 4), (16, 9), (9, 16), (2, 1), (1, 3), (3, 2))
NUMBERS = ("zero", "one", "two", "three", "four", "five", "six", "seven")
SYSTEM = "You are a careful assistant that describes images precisely."

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<image>"]


def random_scene(rng: random.Random) -> dict:
    aw, ah = rng.choice(ASPECTS)
    long_side = int(
        rng.choice([rng.uniform(96, 400), rng.uniform(300, 900), rng.uniform(800, 1600)])
    )
    scale = long_side / max(aw, ah)
    width, height = max(32, int(aw * scale)), max(32, int(ah * scale))
    shapes = []
    for _ in range(rng.randint(1, 5)):
        size = rng.uniform(0.12, 0.35) * min(width, height)
        shapes.append(
            {
                "shape": rng.choice(SHAPES),
                "color": rng.choice([c for c in COLORS if c != "white"]),
                "x": rng.uniform(size, width - size),
                "y": rng.uniform(size, height - size),
                "size": size,
            }
        )
    return {
        "width": width,
        "height": height,
        "background": rng.choice(list(BACKGROUNDS)),
        "gradient": rng.random() < 0.4,
        "shapes": shapes,
    }


def draw(scene: dict) -> Image.Image:
    w, h = scene["width"], scene["height"]
    base = BACKGROUNDS[scene["background"]]
    img = Image.new("RGB", (w, h), base)
    d = ImageDraw.Draw(img)
    if scene["gradient"]:
        for y in range(h):
            t = y / max(1, h - 1)
            d.line([(0, y), (w, y)], fill=tuple(int(c * (1 - 0.35 * t)) for c in base))
    for s in scene["shapes"]:
        x, y, r, fill = s["x"], s["y"], s["size"], COLORS[s["color"]]
        if s["shape"] == "circle":
            d.ellipse([x - r, y - r, x + r, y + r], fill=fill)
        elif s["shape"] == "square":
            d.rectangle([x - r, y - r, x + r, y + r], fill=fill)
        else:
            d.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
    return img


def save_image(img: Image.Image, path_base: str, rng: random.Random, n: int) -> str:
    """Save as JPEG or PNG; a few as grey, palette, RGBA or EXIF-rotated, as real data has."""
    odd = n % 41
    if odd == 7:
        img = img.convert("L")
    elif odd == 13:
        img = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    elif odd == 19:
        img = img.convert("RGBA")
        img.putalpha(200)
    if img.mode in ("P", "RGBA") or rng.random() < 0.3:
        path = path_base + ".png"
        img.save(path, optimize=True)
    else:
        path = path_base + ".jpg"
        exif = None
        if odd == 29:  # stored on its side: the viewer turns it upright by the EXIF tag
            img = img.transpose(Image.Transpose.ROTATE_90)
            exif = Image.Exif()
            exif[0x0112] = 6
        img.save(path, quality=rng.choice([70, 80, 90]), exif=exif or b"")
    return path


def describe_shape(s: dict, scene: dict) -> str:
    horizontal = (
        "left"
        if s["x"] < scene["width"] / 3
        else "right"
        if s["x"] > 2 * scene["width"] / 3
        else "center"
    )
    vertical = (
        "top"
        if s["y"] < scene["height"] / 3
        else "bottom"
        if s["y"] > 2 * scene["height"] / 3
        else "middle"
    )
    size = "large" if s["size"] > 0.25 * min(scene["width"], scene["height"]) else "small"
    return f"a {size} {s['color']} {s['shape']} near the {vertical} {horizontal}"


def caption(scene: dict) -> str:
    parts = [describe_shape(s, scene) for s in scene["shapes"]]
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{listed[0].upper()}{listed[1:]} on a {scene['background']} background."


def vqa(scene: dict, rng: random.Random) -> tuple[str, str]:
    s = rng.choice(scene["shapes"])
    kind = rng.randrange(4)
    if kind == 0:
        shape = rng.choice(SHAPES)
        count = sum(x["shape"] == shape for x in scene["shapes"])
        return f"How many {shape}s are in the image?", NUMBERS[count].capitalize() + "."
    if kind == 1:
        return f"What color is the {s['shape']}?", s["color"].capitalize() + "."
    if kind == 2:
        color = rng.choice(list(COLORS))
        yes = any(x["color"] == color for x in scene["shapes"])
        return f"Is there anything {color} in the picture?", "Yes." if yes else "No."
    return "What is the background color?", scene["background"].capitalize() + "."


FILLER = [
    "The edges are crisp, which suggests the picture was drawn rather than photographed.",
    "There is no text, watermark or border anywhere in the frame.",
    "The composition leaves a good amount of empty space around the objects.",
    "Lighting is uniform, so no shadows fall from any of the shapes.",
    "Colors are saturated and flat, without texture or visible noise.",
    "Nothing overlaps in a way that hides another object completely.",
    "Such simple scenes are often used to test counting and spatial reasoning.",
    "The aspect ratio of the frame gives the arrangement a distinct feel.",
]


def detailed(scene: dict, rng: random.Random) -> str:
    lines = [
        f"The image is {scene['width']} by {scene['height']} pixels"
        f" with a {scene['background']} background"
        + (" that darkens slightly toward the bottom." if scene["gradient"] else ".")
    ]
    for i, s in enumerate(scene["shapes"], start=1):
        lines.append(
            f"Object {i} is {describe_shape(s, scene)}, about {int(2 * s['size'])} pixels across."
        )
    counts = {shape: sum(x["shape"] == shape for x in scene["shapes"]) for shape in SHAPES}
    lines.append(
        "In total there are " + ", ".join(f"{NUMBERS[n]} {k}s" for k, n in counts.items()) + "."
    )
    lines += rng.sample(FILLER, rng.randint(2, 6))
    return " ".join(lines)


def text_only(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if rng.random() < 0.5:
        return (
            f"What is {a} times {b}? Explain briefly.",
            f"{a} times {b} is {a * b}. One way to see it: "
            f"{a} times {b // 2 * 2} is {a * (b // 2 * 2)}"
            + (
                f", plus one more {a} gives {a * b}."
                if b % 2
                else ", and that is the whole product."
            ),
        )
    color, shape = rng.choice(list(COLORS)), rng.choice(SHAPES)
    return (
        f"Describe how you would draw a {color} {shape} with basic tools.",
        f"Start by marking the center, then outline the {shape} lightly in pencil. "
        f"Fill it evenly with {color} paint, working from the middle outward. "
        + " ".join(rng.sample(FILLER, 3)),
    )


def make_records(n: int, seed: int, image_dir: str) -> tuple[list[dict], list[dict], list[str]]:
    rng = random.Random(seed)
    llava, cauldron, corpus = [], [], []
    image_count = 0

    def new_image() -> tuple[str, dict]:
        nonlocal image_count
        scene = random_scene(rng)
        path = save_image(
            draw(scene), os.path.join(image_dir, f"img{image_count:04d}"), rng, image_count
        )
        image_count += 1
        return os.path.basename(path), scene

    for i in range(n):
        kind = rng.choices(
            ["vqa", "caption", "detailed", "multiturn", "multiimage", "text"],
            weights=[30, 20, 20, 10, 8, 12],
        )[0]
        images, turns = [], []
        if kind == "text":
            turns.append(text_only(rng))
        elif kind == "multiimage":
            pairs = [new_image() for _ in range(rng.randint(2, 3))]
            images = [p for p, _ in pairs]
            counts = [len(s["shapes"]) for _, s in pairs]
            best = counts.index(max(counts)) + 1
            question = "".join(f"Image {k + 1}: <image>\n" for k in range(len(pairs)))
            turns.append(
                (
                    question + "Which image shows the most shapes?",
                    f"Image {best}, with {NUMBERS[max(counts)]} shapes.",
                )
            )
        else:
            path, scene = new_image()
            images = [path]
            if kind == "vqa":
                turns.append(vqa(scene, rng))
            elif kind == "caption":
                turns.append(
                    (
                        rng.choice(
                            [
                                "Describe the image in one sentence.",
                                "Write a short caption.",
                                "What does this picture show?",
                            ]
                        ),
                        caption(scene),
                    )
                )
            elif kind == "detailed":
                turns.append(("Describe this image in detail.", detailed(scene, rng)))
            else:
                turns += [vqa(scene, rng) for _ in range(rng.randint(2, 4))]
                turns.append(("Now summarize the scene.", caption(scene)))
        system = SYSTEM if rng.random() < 0.2 else None
        chat = [("system", system)] if system else []
        chat += [
            (role, text)
            for pair in turns
            for role, text in zip(("user", "assistant"), pair, strict=True)
        ]
        corpus.append("".join(f"<|im_start|>{role}\n{text}<|im_end|>\n" for role, text in chat))
        if i % 4 == 3:  # a quarter in Cauldron form: no markers, images go to the first user turn
            turns = [
                (q.replace("<image>\n", "").replace("Image 1: ", "First image. "), a)
                for q, a in turns
            ]
            record = {
                "images": images,
                "texts": [
                    {"user": q, "assistant": a, "source": f"shapes_{kind}"} for q, a in turns
                ],
            }
            if system:
                record["system"] = system
            cauldron.append(record)
        else:
            conversations = [{"from": "system", "value": system}] if system else []
            for k, (q, a) in enumerate(turns):
                if k == 0 and images and "<image>" not in q:
                    q = "<image>\n" + q
                conversations += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
            record = {
                "id": f"shapes-{i:05d}",
                "source": f"shapes_{kind}",
                "conversations": conversations,
            }
            if images:
                record["image"] = images[0] if len(images) == 1 else images
            llava.append(record)
    return llava, cauldron, corpus


def train_tokenizer(corpus: list[str], out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>", "<image>"],
    )
    hf.chat_template = CHATML
    hf.model_max_length = 8192
    hf.save_pretrained(out_dir)
    # Name the class every transformers release knows (5.x calls it TokenizersBackend).
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="shards_example")
    parser.add_argument("--samples", type=int, default=320)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=4096)
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="wdsvlm-example-")
    try:
        image_dir = os.path.join(work, "images")
        os.makedirs(image_dir)
        llava, cauldron, corpus = make_records(args.samples, args.seed, image_dir)
        with open(os.path.join(work, "llava.json"), "w") as f:
            json.dump(llava, f, indent=1)
        with open(os.path.join(work, "cauldron.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in cauldron)
        summary = write_dataset(
            [os.path.join(work, "llava.json"), os.path.join(work, "cauldron.jsonl")],
            args.out,
            image_root=image_dir,
            samples_per_shard=80,
            max_shard_bytes=800_000,
            prefix="shapes",
            overwrite=True,
            progress=False,
        )
        print(summary)
        tokenizer_dir = os.path.join(args.out, "tokenizer")
        shutil.rmtree(tokenizer_dir, ignore_errors=True)
        train_tokenizer(corpus, tokenizer_dir, args.vocab_size)
        print(f"tokenizer: {tokenizer_dir}")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
