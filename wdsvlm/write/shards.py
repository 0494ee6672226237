"""The writer's shards: a record checked into a sample, samples cut into shards, a shard
written.

Checking reads a record's images and videos and keeps only what planning needs (the JSON
bytes, and per file its reference, what the index records of it and its stored size), never
their bytes. A sample's images and videos are its members ``0.jpg``, ``1.mp4``, ... numbered
in the order of their markers in the conversation (a document's or caption's: in element
order, checked in ``document_check``, its unavailable images dropped). The cut is a pure
function of the samples' sizes, so any number of workers gives the same shards; a shard's
images are read again when it is written, and a tar member's bytes are known before it is.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ..errors import InputError, StorageError
from ..format.builder import publish_sidecar, sample_entry
from ..format.containers import MAX_VIDEO_PIXELS, check_pixels
from ..format.conversation import media_order
from ..format.images import UnreadableImage, probe_image, stored_bytes
from ..format.index import sample_key, shard_name
from ..format.members import media_name
from ..format.tarball import HashingTarWriter, member_bytes, tar_bytes
from ..format.videos import (
    VIDEO_EXTENSIONS,
    UnreadableVideo,
    frames_info,
    frames_meta,
    frames_video,
    probe_video,
)
from ..storage.fs import join, publish_file, read_bytes, staging_file
from .document_check import check_document, image_data
from .inputs import Frames
from .parquet import Embedded


def check_record(
    record: dict | InputError,
    storage_options: Mapping[str, Any] | None = None,
    max_video_pixels: int = MAX_VIDEO_PIXELS,
) -> dict | InputError:
    """Read and check a record's images; return the sample to write, or the InputError.

    The sample holds no image bytes, only what shard planning needs: the JSON bytes and,
    per image, its path, extension, stored size and displayed size.
    """
    if isinstance(record, InputError):
        return record
    if "kind" in record:  # a document or caption: its images dropped, not refused
        return check_document(record, storage_options)
    where = record["where"]
    images = []
    embedded = record.get("data") or [None] * len(record["images"])
    for path, data in zip(record["images"], embedded, strict=True):
        if data is None:
            data = _read(path, where, "image", storage_options)
            if isinstance(data, InputError):
                return data
        try:
            info = probe_image(data)
        except UnreadableImage as e:
            return InputError(
                where, "unreadable_image", f"{_image_name(path)} is not a decodable image: {e}"
            )
        size = len(stored_bytes(data, info)) if info.reencoded else len(data)
        images.append((path, info, size))
    videos = []
    for video in record.get("videos", []):  # a file or URL, Frames, or embedded in Parquet
        checked = _check_video(video, where, storage_options, max_video_pixels)
        if isinstance(checked, InputError):
            return checked
        videos.append(checked)
    doc = {"id": record["id"], "source": record["source"], "messages": record["messages"]}
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return {
        "where": where,
        "json": text,
        "source": record["source"],
        "images": images,
        "videos": videos,
        "media": media_order(record["messages"], len(images), len(videos)),
        "chars": [len(m["content"]) for m in record["messages"]],
    }


def _check_video(
    video: Any, where: str, storage_options, max_video_pixels: int = MAX_VIDEO_PIXELS
) -> tuple | InputError:
    """``(reference, what the index records, stored size)`` of a record's video, or why it
    cannot be written."""
    if isinstance(video, Frames):
        sizes, size, codecs = [], member_bytes(len(frames_meta(video.fps))), set()
        for n, path in enumerate(video.files):
            data = _read(path, where, "image", storage_options)
            if isinstance(data, InputError):
                reason = data.reason.replace("_image", "_video")
                return InputError(where, reason, f"frame {n} of {video}: {data.message}")
            try:
                image = probe_image(data)
            except UnreadableImage as e:
                return InputError(
                    where, "unreadable_video", f"frame {n} of {video} is not a decodable image: {e}"
                )
            sizes.append((image.width, image.height))
            codecs.add(image.ext)
            size += member_bytes(len(stored_bytes(data, image)) if image.reencoded else len(data))
        try:
            info = frames_info(sizes, video.fps, "+".join(sorted(codecs)))
            check_pixels(info.frames, info.width, info.height, max_video_pixels)
        except UnreadableVideo as e:
            return InputError(where, "unreadable_video", f"{video}: {e}")
        return video, info, tar_bytes(size)
    data = _read(video, where, "video", storage_options)
    if isinstance(data, InputError):
        return data
    try:
        info = probe_video(data, _video_ext(video), max_video_pixels)
    except UnreadableVideo as e:
        return InputError(
            where, "unreadable_video", f"{_video_name(video)} is not a decodable video: {e}"
        )
    return video, info, len(data)


def video_bytes(video: Any, storage_options=None) -> bytes:
    """The bytes the shard holds for a video: its file's, or a tar of its frames' files."""
    if isinstance(video, Frames):
        files = []
        for path in video.files:
            data = read_bytes(path, storage_options)
            image = probe_image(data)
            files.append((stored_bytes(data, image), image.ext))
        return frames_video(files, video.fps)
    return image_bytes(video, storage_options)


def _read(path: Any, where: str, kind: str, storage_options) -> bytes | InputError:
    """The bytes of a record's image or video file, or why they cannot be read."""
    name = _image_name(path) if kind == "image" else _video_name(path)
    try:
        return image_bytes(path, storage_options)
    except FileNotFoundError:
        return InputError(where, f"missing_{kind}", f"{name} not found")
    except (OSError, StorageError) as e:
        return InputError(where, f"unreadable_{kind}", f"{name} cannot be read: {e}")


def _video_ext(video: Any) -> str | None:
    """The member extension of a video file: its own, lower case (None where it has none
    wdsvlm knows, or it is embedded: the container's)."""
    if isinstance(video, Embedded):
        return None
    ext = os.path.splitext(str(video))[1].lstrip(".").lower()
    return ext if ext in VIDEO_EXTENSIONS else None


def _video_name(video: Any) -> str:
    return f"video {video}" if isinstance(video, Embedded) else f"video file {video}"


def sample_tar_bytes(sample: dict) -> int:
    """Bytes a sample takes in a tar: a header and the padded data per member."""
    files = [*sample["images"], *sample.get("videos", [])]
    return member_bytes(len(sample["json"])) + sum(member_bytes(size) for _, _, size in files)


def plan_shards(
    samples: Iterable[dict], samples_per_shard: int, max_shard_bytes: int
) -> Iterator[tuple[int, int, list[dict]]]:
    """Cut samples into shards, in order, as they come: ``(shard number, first sample
    number, samples)`` for each shard once it is full (only the open shard is held)."""
    current: list[dict] = []
    current_bytes = 0
    first = shards = 0
    for number, sample in enumerate(samples):
        size = sample_tar_bytes(sample)
        if current and (
            len(current) >= samples_per_shard or tar_bytes(current_bytes + size) > max_shard_bytes
        ):
            yield shards, first, current
            shards += 1
            current, current_bytes, first = [], 0, number
        current.append(sample)
        current_bytes += size
    if current:
        yield shards, first, current


def write_shard(
    plan: tuple[int, int, list[dict]],
    output: str,
    prefix: str,
    storage_options: Mapping[str, Any] | None = None,
    prefixes: int | None = None,
) -> dict:
    """Write one planned shard and its sidecar (the samples' entries), in its prefix folder
    where the shards are spread over ``prefixes`` folders; return its entry in the root
    index."""
    number, first, samples = plan
    name = shard_name(prefix, number, prefixes)
    url = join(output, name)
    tmp = staging_file(url, storage_options)
    try:
        with open(tmp, "wb") as f:
            tar = HashingTarWriter(f)
            entries = [
                _write_sample(tar, sample_key(first + i), s, storage_options)
                for i, s in enumerate(samples)
            ]
            tar.close()
    except BaseException:
        os.unlink(tmp)
        raise
    publish_file(tmp, url, storage_options)
    digest = tar.digest.hexdigest()
    return publish_sidecar(output, name, entries, tar.offset, digest, storage_options)


def _write_sample(tar: HashingTarWriter, key: str, sample: dict, storage_options) -> dict:
    """Append one sample's members; return its index entry."""
    start = tar.offset
    tar.member(f"{key}.json", sample["json"])
    files = {"image": iter(sample["images"]), "video": iter(sample.get("videos", []))}
    for n, kind in enumerate(sample.get("media") or ["image"] * len(sample["images"])):
        path, info, size = next(files[kind])
        if kind == "image":
            data = stored_bytes(image_bytes(path, storage_options), info)
        else:
            data = video_bytes(path, storage_options)
        if len(data) != size:
            name = _image_name(path) if kind == "image" else _video_name(path)
            raise InputError(sample["where"], f"changed_{kind}", f"{name} changed while writing")
        tar.member(f"{key}.{media_name(n, info.ext)}", data)  # as the reader finds it
    sizes = [(info.width, info.height) for _, info, _ in sample["images"]]
    videos = [info.as_dict() for _, info, _ in sample.get("videos", [])]
    kind, elements = sample.get("kind", "conversation"), sample.get("elements", ())
    return sample_entry(
        key, start, tar.offset - start, sizes, sample["chars"], videos, kind, elements
    )


def _image_name(image: str | Embedded) -> str:
    return f"image {image}" if isinstance(image, Embedded) else f"image file {image}"


def image_bytes(image: str | Embedded, storage_options=None) -> bytes:
    """An image's bytes: from its file or URL, or from the Parquet row (or img2dataset's tar)
    that holds it."""
    return image_data(image, storage_options)
