"""Pictures of a dataset: a contact sheet of samples (Pillow), histograms of sizes and the
batch picture of naive batching beside wdsvlm's packing (matplotlib, ``pip install
'wdsvlm[plots]'``). Every picture has a fixed size in pixels, given below."""

from __future__ import annotations

import io
import itertools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont, ImageOps

from ..format.images import BAD_IMAGE_ERRORS, to_rgb
from .samples import IMAGE, SUPERVISED, TEXT, SampleView

SHEET_WIDTH, SHEET_ROW = 1200, 220  # contact sheet: SHEET_WIDTH x (SHEET_ROW * samples)
HISTOGRAM_SIZE = (1000, 420)  # tokens.png, tiles.png
BATCH_PICTURE_SIZE = (1400, 800)  # batches.png
_DPI = 100

# batch picture cell values: 0 not allocated, 1 padding, then each kind in two shades that
# alternate between neighbouring samples of a row
_COLOURS = [
    "#ffffff",  # not part of the batch tensor
    "#b0b0b0",  # padding
    "#4c72b0",  # text
    "#dd8452",  # image tokens
    "#55a868",  # supervised (answer) tokens
    "#8eaad8",
    "#f0b890",
    "#98d0a4",
]
_KIND_COLOUR = {TEXT: 2, IMAGE: 3, SUPERVISED: 4}


def pyplot():
    """matplotlib.pyplot on the Agg backend, or an ImportError that says how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(
            "the stats pictures need matplotlib: pip install 'wdsvlm[plots]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _font(size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the small bitmap font only
        return ImageFont.load_default()


def _wrapped(text: str, font, width: float) -> list[str]:
    """``text`` broken into lines no wider than ``width`` pixels (long words are cut)."""
    lines = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split(" "):
            candidate = f"{line} {word}" if line else word
            if font.getlength(candidate) <= width:
                line = candidate
                continue
            if line:
                lines.append(line)
            while font.getlength(word) > width:  # a word wider than the column
                cut = max(1, int(len(word) * width / font.getlength(word)))
                lines.append(word[:cut])
                word = word[cut:]
            line = word
        lines.append(line)
    return lines


def _thumbnail(data: bytes, box: tuple[int, int]) -> Image.Image | None:
    """The image as displayed (EXIF orientation, RGB on white) within ``box``, or None when it
    does not decode."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.draft("RGB", (max(box), max(box)))  # JPEGs: decode at a reduced size
            thumb = to_rgb(ImageOps.exif_transpose(img))
            thumb.thumbnail(box)
            return thumb
    except BAD_IMAGE_ERRORS:
        return None


def _video_thumbnail(video: Any, box: tuple[int, int]) -> Image.Image | None:
    """Up to 4 of a video's frames shown (of those sampled, evenly spaced), as stored, in a
    2x2 grid within ``box``, or None when they do not decode."""
    from ..format.videos import UnreadableVideo, decode_frames

    frames = video.frames
    if len(frames) > 4:
        frames = [frames[round(k * (len(frames) - 1) / 3)] for k in range(4)]
    try:
        pixels = decode_frames(video.data, frames, video.info)
    except (UnreadableVideo, ValueError):
        return None
    cell = (max(1, box[0] // 2), max(1, box[1] // 2))
    grid = Image.new("RGB", (cell[0] * 2, cell[1] * 2), "white")
    for k, frame in enumerate(pixels):
        picture = Image.fromarray(frame)
        picture.thumbnail(cell)
        grid.paste(picture, ((k % 2) * cell[0], (k // 2) * cell[1]))
    grid.thumbnail(box)
    return grid


def contact_sheet(views: Sequence[SampleView], path: str) -> tuple[int, int]:
    """Each sample in one row of ``SHEET_ROW`` pixels: its images and videos (up to 4 of the
    frames sampled of each), then its key and turns.
    Writes a PNG of ``SHEET_WIDTH x SHEET_ROW * len(views)`` pixels; returns that size."""
    size = (SHEET_WIDTH, SHEET_ROW * max(len(views), 1))
    sheet = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(sheet)
    font, bold = _font(14), _font(15)
    pictures_width, pad, line_height = 440, 10, 18
    text_x = pictures_width + 2 * pad
    text_width = SHEET_WIDTH - text_x - pad
    for row, view in enumerate(views):
        top = row * SHEET_ROW
        if row:
            draw.line([(0, top), (SHEET_WIDTH, top)], fill="#cccccc")
        shown = [("image", data) for data in view.images]
        shown = (shown + [("video", video) for video in view.videos])[:3]
        if shown:
            box_w = (pictures_width - pad * (len(shown) - 1)) // len(shown)
            x = pad
            for kind, item in shown:
                box = (box_w, SHEET_ROW - 2 * pad)
                thumb = _thumbnail(item, box) if kind == "image" else _video_thumbnail(item, box)
                if thumb is None:
                    draw.text((x, top + pad), f"(unreadable {kind})", fill="#c44e52", font=font)
                else:
                    y = top + (SHEET_ROW - thumb.height) // 2
                    sheet.paste(thumb, (x + (box_w - thumb.width) // 2, y))
                x += box_w + pad
        else:
            draw.text((pad, top + pad), "(text only)", fill="#888888", font=font)
        title = f"{view.key}  ({view.shard})  {len(view.images)} image(s)"
        if view.videos:
            title += f", {len(view.videos)} video(s)"
        if view.tokens:
            title += f", {view.tokens['total']} tokens"
        if len(view.images) + len(view.videos) > len(shown):
            title += f", {len(view.images) + len(view.videos) - len(shown)} not shown"
        lines = [(title, bold, "black")]
        if view.problem:
            lines.append((f"PROBLEM: {view.problem}", font, "#c44e52"))
        if view.document is not None:  # a document's text, each image marked in its place
            text = f"{view.document.kind}: {view.document.text()}"
            lines += [(line, font, "#1f3f7f") for line in _wrapped(text, font, text_width)]
        for m in view.messages:
            colour = "#1f5f2f" if m["role"] == "assistant" else "#1f3f7f"
            for line in _wrapped(f"{m['role']}: {m['content']}", font, text_width):
                lines.append((line, font, colour))
        fits = (SHEET_ROW - 2 * pad) // line_height
        if len(lines) > fits:
            lines = lines[: fits - 1] + [("...", font, "#888888")]
        for i, (line, face, colour) in enumerate(lines):
            draw.text((text_x, top + pad + i * line_height), line, fill=colour, font=face)
    sheet.save(path, format="PNG")
    return size


def _save(fig, path: str, rect=(0, 0, 1, 1)) -> None:
    """Write ``fig`` as a PNG of exactly its size in pixels, then free it."""
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=_DPI)
    pyplot().close(fig)


def histograms(tokens: np.ndarray, tiles: np.ndarray, max_length: int, folder: str) -> list[str]:
    """``tokens.png`` (tokens per sample, ``max_length`` marked) and ``tiles.png`` (tiles per
    sample) in ``folder``, each ``HISTOGRAM_SIZE`` pixels; returns their paths."""
    plt = pyplot()
    paths = []
    figsize = (HISTOGRAM_SIZE[0] / _DPI, HISTOGRAM_SIZE[1] / _DPI)

    fig, ax = plt.subplots(figsize=figsize, dpi=_DPI)
    over = int((tokens > max_length).sum())
    ax.hist(tokens, bins=50, color=_COLOURS[2])
    ax.axvline(max_length, color="#c44e52", linestyle="--")
    ax.text(
        max_length,
        ax.get_ylim()[1] * 0.95,
        f"max_length {max_length} \n{over} samples over ",
        color="#c44e52",
        va="top",
        ha="right",
    )
    ax.set(
        xlabel="tokens per sample (image tokens included)",
        ylabel="samples",
        title=f"Tokens per sample ({len(tokens)} samples)",
    )
    paths.append(os.path.join(folder, "tokens.png"))
    _save(fig, paths[-1])

    fig, ax = plt.subplots(figsize=figsize, dpi=_DPI)
    top = int(tiles.max()) if len(tiles) else 0
    counts = np.bincount(tiles, minlength=top + 1) if len(tiles) else np.zeros(1)
    ax.bar(np.arange(len(counts)), counts, color=_COLOURS[3], width=0.8)
    ax.set(
        xlabel="image tiles per sample (thumbnails included)",
        ylabel="samples",
        title=f"Tiles per sample ({int(tiles.sum())} tiles in {len(tiles)} samples)",
    )
    paths.append(os.path.join(folder, "tiles.png"))
    _save(fig, paths[-1])
    return paths


def document_histograms(documents: dict, folder: str) -> str:
    """``documents.png`` in ``folder`` (``HISTOGRAM_SIZE`` pixels): documents by their
    pieces (left) and by their images (right), from ``stats``'s figures of the documents and
    captions read (``document_stats.DocumentTally.as_dict``); returns its path."""
    plt = pyplot()
    figsize = (HISTOGRAM_SIZE[0] / _DPI, HISTOGRAM_SIZE[1] / _DPI)
    fig, axes = plt.subplots(1, 2, figsize=figsize, dpi=_DPI)
    count = documents["documents"] + documents["captions"]
    for ax, name, what, colour in (
        (axes[0], "pieces_per_document", "pieces", _COLOURS[2]),
        (axes[1], "images_per_document", "images", _COLOURS[3]),
    ):
        counts = {int(k): n for k, n in documents[name]["counts"].items()}
        ax.bar(list(counts), list(counts.values()), color=colour, width=0.8)
        ax.yaxis.get_major_locator().set_params(integer=True)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set(
            xlabel=f"{what} per document",
            ylabel="documents",
            title=f"{what.capitalize()} per document ({count} documents)",
        )
    path = os.path.join(folder, "documents.png")
    _save(fig, path)
    return path


def _row(kinds: np.ndarray, shade: int) -> np.ndarray:
    out = np.empty(len(kinds), dtype=np.uint8)
    for kind, colour in _KIND_COLOUR.items():
        out[kinds == kind] = colour + 3 * shade
    return out


def batch_grids(
    kinds: Sequence[np.ndarray], max_length: int, batch_size: int, rows: int = 8
) -> tuple[np.ndarray, np.ndarray, dict]:
    """The cells of the batch picture: the samples of wdsvlm's first ``rows`` packs of the
    given samples (those that fit), packed, and the same samples in naive batches of
    ``batch_size`` (in their reading order, padded to each batch's longest). Returns the
    naive grid (one row per sample), the packed grid and the facts for the titles."""
    from ..pipeline.packer import Packer

    fitting = [k for k in kinds if len(k) <= max_length]
    packer = Packer(max_length, window=max(len(fitting), 1))
    for i, k in enumerate(fitting):
        packer.push(i, len(k), 0)
    packs = list(itertools.islice(packer.drain(), rows))
    chosen = sorted(i for pack in packs for i in pack)

    packed = np.full((max(len(packs), 1), max_length), 1, dtype=np.uint8)
    for r, pack in enumerate(packs):
        at = 0
        for shade, i in enumerate(pack):
            k = fitting[i]
            packed[r, at : at + len(k)] = _row(k, shade % 2)
            at += len(k)
    naive = np.zeros((max(len(chosen), 1), max_length), dtype=np.uint8)
    naive_cells = 0
    for start in range(0, len(chosen), batch_size):
        batch = chosen[start : start + batch_size]
        longest = max(len(fitting[i]) for i in batch)
        naive_cells += longest * len(batch)
        for r, i in enumerate(batch, start=start):
            k = fitting[i]
            naive[r, :longest] = 1
            naive[r, : len(k)] = _row(k, 0)
    real = sum(len(fitting[i]) for i in chosen)
    facts = {
        "samples": len(chosen),
        "naive_batches": -(-len(chosen) // batch_size),
        "naive_padding": 1 - real / naive_cells if naive_cells else 0.0,
        "rows": len(packs),
        "packed_padding": 1 - real / (len(packs) * max_length) if packs else 0.0,
    }
    return naive, packed, facts


def batch_picture(
    kinds: Sequence[np.ndarray], max_length: int, batch_size: int, path: str, rows: int = 8
) -> dict:
    """Naive batches (left) beside wdsvlm's packed rows (right) of the same samples: rows are
    sequences, columns token positions; text, image, supervised tokens and padding in their
    own colours, on one scale. A PNG of ``BATCH_PICTURE_SIZE`` pixels; returns the facts."""
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    plt = pyplot()
    naive, packed, facts = batch_grids(kinds, max_length, batch_size, rows)
    cmap = ListedColormap(_COLOURS)
    norm = BoundaryNorm(np.arange(len(_COLOURS) + 1) - 0.5, len(_COLOURS))
    figsize = (BATCH_PICTURE_SIZE[0] / _DPI, BATCH_PICTURE_SIZE[1] / _DPI)
    fig, (left, right) = plt.subplots(1, 2, figsize=figsize, dpi=_DPI, sharey=True)
    height = len(naive)
    for ax, grid, title in (
        (
            left,
            naive,
            f"naive: {facts['samples']} samples in {facts['naive_batches']} batches of "
            f"{batch_size},\neach padded to its longest: {facts['naive_padding']:.1%} padding",
        ),
        (
            right,
            packed,
            f"wdsvlm: the same samples packed in {facts['rows']} rows of {max_length}:\n"
            f"{facts['packed_padding']:.1%} padding",
        ),
    ):
        ax.imshow(
            grid,
            cmap=cmap,
            norm=norm,
            aspect="auto",
            interpolation="nearest",
            extent=(0, max_length, len(grid), 0),
        )
        ax.set_xlim(0, max_length)
        ax.set_ylim(height, 0)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("token position")
    left.set_ylabel("sequence (row of the batch tensor)")
    legend = [
        Patch(color=_COLOURS[2], label="text (prompt, template)"),
        Patch(color=_COLOURS[3], label="image tokens"),
        Patch(color=_COLOURS[4], label="supervised (answer) tokens"),
        Patch(color=_COLOURS[1], label="padding"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=4, frameon=False)
    _save(fig, path, rect=(0, 0.05, 1, 1))
    return facts
