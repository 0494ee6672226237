"""Reading a WebDataset tar once, in order, into its samples' index entries.

Members group into samples by key as webdataset groups them (``layouts.split_name``: a run
of members of one key, in tar order). Per sample the entry records its byte range, its
images' displayed sizes (read from the image headers, EXIF orientation applied, no decode)
and the characters per turn of its conversation in the tars' ``layouts.Layout``, or for a
document or caption its kind and elements, from the members the reader will get (a layout of
documents makes them first: MINT-1T's decodes its TIFF frames, and the images it leaves out
are returned as ``dropped``). A sample
that makes no entry is an ``InputError`` naming the shard and the key: a duplicate key, a
member without a suffix, a sample its layout refuses, a tar that ends inside it or without
its end-of-archive blocks. ``wdsvlm index`` writes what it finds as an index; ``scan_index``
keeps it in memory for wdsvlm's own tars met without one.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import tarfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError, ShardFormatError, StorageError
from ..storage.fs import filesystem
from .builder import sample_entry
from .containers import MAX_VIDEO_PIXELS
from .conversation import check_markers
from .documents import check_elements, element_numbers, kind_of
from .images import UnreadableImage, image_size
from .index import FORMAT
from .layouts import BadSample, Layout, split_name
from .members import media_members
from .tarball import BLOCK, padded
from .videos import FRAMES, UnreadableVideo, probe_frames, probe_video


class _HashingReader:
    """A read-only file that hashes and counts what is read through it."""

    def __init__(self, f):
        self.f = f
        self.digest = hashlib.sha256()
        self.count = 0
        self.last_nonzero = -1  # the offset of the last byte read that is not zero

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.digest.update(data)
        kept = len(data.rstrip(b"\0"))
        if kept:
            self.last_nonzero = self.count + kept - 1
        self.count += len(data)
        return data

    def rest(self) -> None:
        """Read to the end (for the size and the hash)."""
        while self.read(1 << 20):
            pass


def _groups(tar: tarfile.TarFile) -> Iterator[tuple[str, int, int, dict[str, bytes], str | None]]:
    """``(key, offset, end, members by suffix, trouble)`` per run of members of one key, in
    tar order; ``trouble`` says what cut the run short (a truncated tar)."""
    key, start, end, members = None, 0, 0, {}
    while True:
        try:
            info = tar.next()
        except tarfile.TarError as e:
            if key is not None:
                yield key, start, end, members, f"the tar is cut short ({e})"
            return
        if info is None:
            break
        if not info.isfile():
            continue
        k, suffix = split_name(info.name)
        if k != key:
            if key is not None:
                yield key, start, end, members, None
            key, start, members = k, info.offset, {}
        try:
            data = tar.extractfile(info).read()
        except (tarfile.TarError, OSError) as e:
            data, err = b"", e
        else:
            err = None
        if err is not None or len(data) != info.size:
            yield key, start, end, members, f"member {info.name} is cut short ({err or 'EOF'})"
            return
        members[suffix] = data
        end = info.offset_data + padded(info.size)
    if key is not None:
        yield key, start, end, members, None


def first_samples(url: str, count: int, storage_options=None) -> Iterator[dict[str, bytes]]:
    """The members (by suffix) of the first ``count`` samples of the tar at ``url``."""
    fs, path = filesystem(url, storage_options)
    try:
        with fs.open(path, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tar:
            for _, _, _, members, _ in itertools.islice(_groups(tar), count):
                yield members
    except FileNotFoundError:
        raise FileNotFoundError(f"{url}: tar not found") from None
    except tarfile.TarError as e:
        raise ShardFormatError(f"{url}: not a tar file ({e})") from None


def scan_tar(
    url: str,
    layout: Layout,
    storage_options=None,
    max_video_pixels: int = MAX_VIDEO_PIXELS,
    name: str | None = None,
) -> dict:
    """Read one tar once: its samples' index ``entries``, its ``bad`` samples (an
    ``InputError`` each, naming the shard by ``name``, its path in the dataset: its file name
    if not given; a video over ``max_video_pixels`` is one), its ``bytes`` and ``sha256``."""
    fs, path = filesystem(url, storage_options)
    shard = name or url.rsplit("/", 1)[-1]
    seen: set[str] = set()

    def bad_sample(key: str, reason: str, message: str) -> InputError:
        return InputError(f"{shard} key {key}", reason, message, {"shard": shard, "key": key})

    outcomes: list[dict | InputError] = []  # per sample, in order: its entry, or why it is bad
    dropped: list[dict] = []  # images left out of the documents kept
    try:
        with fs.open(path, "rb") as f:
            reader = _HashingReader(f)
            try:
                tar = tarfile.open(fileobj=reader, mode="r|")
            except tarfile.TarError as e:
                raise ShardFormatError(f"{url}: not a tar file ({e})") from None
            cut = False
            for key, start, end, members, trouble in _groups(tar):
                if trouble is not None:
                    outcomes.append(bad_sample(key, "truncated_tar", trouble))
                    cut = True
                    break
                if key in seen:
                    message = "the key appears twice in the tar"
                    outcomes.append(bad_sample(key, "duplicate_key", message))
                    continue
                seen.add(key)
                if "" in members:  # the reader could not tell it from another key's
                    message = f"member {key} has no suffix (webdataset names KEY.SUFFIX)"
                    outcomes.append(bad_sample(key, "bad_member", message))
                    continue
                try:
                    found = _contents(key, members, layout, max_video_pixels)
                except BadSample as e:
                    outcomes.append(bad_sample(key, e.reason, str(e)))
                    continue
                outcomes.append(sample_entry(key, start, end - start, *found.entry))
                dropped += [
                    {"shard": shard, "key": key, "reason": reason, "message": message}
                    for reason, message in found.dropped
                ]
            reader.rest()
            stop = tar.offset  # where tarfile stopped: the end-of-archive blocks, or not
            if not cut and (reader.count < stop + 2 * BLOCK or reader.last_nonzero >= stop):
                # no end-of-archive blocks: the tar is cut, or a header there does not parse;
                # the last sample may lack members that came after
                if outcomes:
                    last = outcomes[-1]
                    key = last.fields["key"] if isinstance(last, InputError) else last["key"]
                    message = f"the tar stops at byte {stop} without its end, inside or after it"
                    outcomes[-1] = bad_sample(key, "truncated_tar", message)
                if reader.last_nonzero >= stop + BLOCK:
                    message = (
                        f"{reader.count - stop} bytes from byte {stop} on do not read as tar "
                        "members (a corrupt header, or tars joined); nothing there is indexed"
                    )
                    outcomes.append(bad_sample(f"(from byte {stop})", "corrupt_tar", message))
    except FileNotFoundError:
        raise StorageError(f"{url}: tar not found") from None
    return {
        "entries": [o for o in outcomes if not isinstance(o, InputError)],
        "bad": [o for o in outcomes if isinstance(o, InputError)],
        "dropped": dropped,
        "bytes": reader.count,
        "sha256": reader.digest.hexdigest(),
    }


@dataclass(frozen=True)
class _Found:
    """What a sample's index entry records (``entry``: ``sample_entry``'s arguments after
    its key and byte range), and the images its layout left out of its document."""

    entry: tuple
    dropped: list = field(default_factory=list)


def _contents(
    key: str, members: Mapping[str, bytes], layout: Layout, max_video_pixels: int
) -> _Found:
    """A sample's images' displayed sizes, its turns' (a document's: texts') characters,
    what the index records of its videos and, for a document or caption, its kind and
    elements, from its members."""
    if layout.kind != "conversation":  # indexed as the reader will get it
        made = layout.document(key, members)
        members, kind, elements, dropped = made.members, layout.kind, made.elements, made.dropped
    else:
        kind, elements, dropped = "conversation", [], []
    media = media_members(members)  # the reader's rule: bare (KEY.mp4) or numbered (KEY.0.mp4)
    images, videos = media.images, media.videos
    if layout.native:
        kind, chars, elements = _native(key, members, len(images), len(videos))
    elif kind != "conversation":
        chars = [len(e["text"]) for e in elements if "text" in e]
    else:
        chars = [len(m["content"]) for m in layout.messages(key, members, len(images), len(videos))]
    sizes = []
    for suffix in images:
        try:
            sizes.append(image_size(members[suffix]))
        except UnreadableImage as e:
            raise BadSample("unreadable_image", f"image {suffix}: {e}") from None
    infos = []
    for suffix in videos:
        ext = suffix.rsplit(".", 1)[-1].lower()
        try:
            probe = (
                probe_frames(members[suffix])
                if ext == FRAMES
                else probe_video(members[suffix], ext, max_video_pixels)
            )
            infos.append(probe.as_dict())
        except UnreadableVideo as e:
            raise BadSample("unreadable_video", f"video {suffix}: {e}") from None
    return _Found((sizes, chars, infos, kind, element_numbers(elements)), dropped)


def _native(key: str, members: Mapping[str, bytes], images: int, videos: int) -> tuple:
    """``(kind, characters per turn or text, elements)`` of a sample in wdsvlm's own layout,
    checked as the reader will read it."""
    try:
        record = json.loads(members["json"])
        kind = kind_of(record)
        if kind == "conversation":
            messages = record["messages"]
            chars = [len(m["content"]) for m in messages]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise BadSample("invalid_json", f"no wdsvlm json member with messages ({e})") from None
    try:  # as the reader will count them: placeholders of the kinds it has media of
        if kind != "conversation":
            elements = check_elements(record.get("elements"), images, key, kind)
            return kind, [len(e["text"]) for e in elements if "text" in e], elements
        check_markers(messages, images, videos, key)
    except InputError as e:
        raise BadSample(e.reason, e.message) from None
    return kind, chars, []


def scan_index(urls: list[str], storage_options: Mapping[str, Any] | None = None) -> dict:
    """Build the index of wdsvlm-format shards that have none, in memory, by reading them
    once (``scan_tar``). ``wdsvlm index`` writes one once, for any layout; this is for
    shards in wdsvlm's own layout met without it. A bad sample is a ``ShardFormatError``
    naming the shard and the sample."""
    shards = []
    for url in urls:
        try:
            scanned = scan_tar(url, Layout(), storage_options)
        except StorageError as e:
            raise ShardFormatError(str(e)) from None
        if scanned["bad"]:
            bad = scanned["bad"][0]
            raise ShardFormatError(
                f"{url}: cannot scan it for an index (key {bad.fields['key']}: {bad.reason}: "
                f"{bad.message}); index the tars with `wdsvlm index` (captions or "
                "conversations layouts too), or write the dataset with `wdsvlm write`"
            )
        shards.append(
            {
                "name": url.rsplit("/", 1)[-1],
                "samples": len(scanned["entries"]),
                "bytes": scanned["bytes"],
                "sha256": scanned["sha256"],
                "entries": scanned["entries"],
            }
        )
    samples = sum(s["samples"] for s in shards)
    return {
        "format": FORMAT,
        "version": 1,  # in memory: the entries in the index
        "shards": shards,
        "totals": {"shards": len(shards), "samples": samples},
    }
