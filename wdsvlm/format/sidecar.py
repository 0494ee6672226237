"""Per-shard sample metadata beside each shard (index version 2): ``NAME.idx``.

The root ``index.json`` of a version-2 dataset has one entry per shard; what each sample
needs (its key, byte offset and size in the tar, image sizes, characters per turn) lives in
the shard's sidecar, read only by whoever reads that shard.

A sidecar is a numpy ``.npz`` archive (uncompressed) of flat arrays: ``offset``, ``size``
(int64, per sample), ``key_end`` (int64, per sample, into ``key_bytes``: the keys' UTF-8
bytes back to back), ``image_count`` (int32, per sample) with ``image_size`` (int32
``[images, 2]``: width, height), ``turn_count`` (int32, per sample) with ``chars`` (int32, per
turn), and for a shard that holds videos ``video_count`` (int32, per sample) with
``video_info`` (the UTF-8 JSON list of what the index records of each video,
``format.videos.VideoInfo``), and for a shard that holds documents or captions ``kind``
(uint8, per sample, ``documents.KINDS.index``) with ``element_count`` (int32, per sample) and
``elements`` (int32, per element: a text's characters, ``-1`` for an image). It loads in one
read and maps into numpy without a Python object per sample; numpy is already a dependency,
and any language with a zip and ``.npy`` reader can read it. A 1000-sample shard's sidecar is
about 40 kB. ``Entries`` gives the samples as the index entries of version 1 (``{"key",
"offset", "size", "images", "chars"}``, ``videos`` for a sample that has any, ``kind`` and
``elements`` for a document or caption), made when asked for.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import numpy as np

from ..errors import ShardFormatError

log = logging.getLogger("wdsvlm.sidecar")

SIDECAR_SUFFIX = ".idx"
_ARRAYS = ("offset", "size", "key_bytes", "key_end", "image_count", "image_size", "turn_count")
_KIND_ARRAYS = ("kind", "element_count", "elements")  # a shard of documents or captions
_CACHED = 256  # sidecars kept per process (least recently used out first)
_RECHECK = 1.0  # seconds: a LazyEntries stats its cached local sidecar again after that long


def sidecar_name(shard_name: str) -> str:
    """``data-000000.tar`` -> ``data-000000.idx``."""
    stem = shard_name[: -len(".tar")] if shard_name.endswith(".tar") else shard_name
    return stem + SIDECAR_SUFFIX


def pack_entries(entries: Sequence[Mapping[str, Any]]) -> bytes:
    """The sidecar bytes of a shard's index entries (version-1 form)."""
    keys = [e["key"].encode("utf-8") for e in entries]
    images = [size for e in entries for size in e.get("images", [])]
    chars = [c for e in entries for c in e.get("chars", [])]
    arrays = {
        "offset": np.asarray([e["offset"] for e in entries], dtype=np.int64),
        "size": np.asarray([e["size"] for e in entries], dtype=np.int64),
        "key_bytes": np.frombuffer(b"".join(keys), dtype=np.uint8),
        "key_end": np.cumsum([len(k) for k in keys], dtype=np.int64),
        "image_count": np.asarray([len(e.get("images", [])) for e in entries], dtype=np.int32),
        "image_size": np.asarray(images, dtype=np.int32).reshape(-1, 2),
        "turn_count": np.asarray([len(e.get("chars", [])) for e in entries], dtype=np.int32),
        "chars": np.asarray(chars, dtype=np.int32),
    }
    videos = [v for e in entries for v in e.get("videos", [])]
    if videos:  # only where there are: a shard of images is as before
        arrays["video_count"] = np.asarray([len(e.get("videos", [])) for e in entries], np.int32)
        text = json.dumps(videos, separators=(",", ":")).encode("utf-8")
        arrays["video_info"] = np.frombuffer(text, dtype=np.uint8)
    if any(e.get("kind") for e in entries):  # only where there are: conversations as before
        arrays["kind"] = np.asarray([e.get("kind", 0) for e in entries], dtype=np.uint8)
        arrays["element_count"] = np.asarray(
            [len(e.get("elements", [])) for e in entries], dtype=np.int32
        )
        arrays["elements"] = np.asarray(
            [n for e in entries for n in e.get("elements", [])], dtype=np.int32
        )
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


class Entries(Sequence):
    """A shard's samples from its sidecar: ``entries[i]`` is the index entry of sample ``i``
    (made when asked for), the arrays are ``offset``, ``size``, ... as stored."""

    def __init__(self, data: bytes, where: str):
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as archive:
                arrays = {name: archive[name] for name in (*_ARRAYS, "chars")}
                videos = archive["video_info"] if "video_info" in archive else None
                video_count = archive["video_count"] if "video_count" in archive else None
                kinds = {n: archive[n] for n in _KIND_ARRAYS if n in archive}
        except Exception as e:  # noqa: BLE001 - any damage: named with the file
            raise ShardFormatError(f"{where}: not a readable wdsvlm sidecar ({e})") from None
        n = len(arrays["offset"])
        for name in ("size", "key_end", "image_count", "turn_count"):
            if len(arrays[name]) != n:
                raise ShardFormatError(
                    f"{where}: its {name} has {len(arrays[name])} of {n} samples"
                )
        if arrays["image_count"].sum() != len(arrays["image_size"]) or arrays[
            "turn_count"
        ].sum() != len(arrays["chars"]):
            raise ShardFormatError(f"{where}: its image or turn counts do not add up")
        self.videos: list | None = None  # what the index records of each video, in order
        self._video_start = None
        if video_count is not None and videos is not None:
            try:
                self.videos = json.loads(videos.tobytes().decode("utf-8"))
            except ValueError as e:
                raise ShardFormatError(f"{where}: its video_info is not JSON ({e})") from None
            if len(video_count) != n or video_count.sum() != len(self.videos):
                raise ShardFormatError(f"{where}: its video counts do not add up")
            self._video_start = np.concatenate([[0], np.cumsum(video_count)])
        self.kind = self._elements = self._element_start = None  # all conversations
        if kinds:
            if len(kinds) != len(_KIND_ARRAYS) or len(kinds["kind"]) != n:
                raise ShardFormatError(f"{where}: its kind arrays do not cover its samples")
            count = kinds["element_count"]
            if len(count) != n or count.sum() != len(kinds["elements"]):
                raise ShardFormatError(f"{where}: its element counts do not add up")
            self.kind, self._elements = kinds["kind"], kinds["elements"]
            self._element_start = np.concatenate([[0], np.cumsum(count)])
        self.where = where
        self.offset, self.size = arrays["offset"], arrays["size"]
        self.image_count, self.image_size = arrays["image_count"], arrays["image_size"]
        self.turn_count, self.chars = arrays["turn_count"], arrays["chars"]
        self._key_bytes = arrays["key_bytes"].tobytes()
        self._key_end = arrays["key_end"]
        self._image_start = np.concatenate([[0], np.cumsum(self.image_count)])
        self._turn_start = np.concatenate([[0], np.cumsum(self.turn_count)])

    def __len__(self) -> int:
        return len(self.offset)

    def key(self, i: int) -> str:
        start = int(self._key_end[i - 1]) if i else 0
        return self._key_bytes[start : int(self._key_end[i])].decode("utf-8")

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of a shard of {len(self)}")
        a, b = int(self._image_start[i]), int(self._image_start[i + 1])
        c, d = int(self._turn_start[i]), int(self._turn_start[i + 1])
        entry = {
            "key": self.key(i),
            "offset": int(self.offset[i]),
            "size": int(self.size[i]),
            "images": self.image_size[a:b].tolist(),
            "chars": self.chars[c:d].tolist(),
        }
        if self._video_start is not None and self._video_start[i + 1] > self._video_start[i]:
            entry["videos"] = self.videos[int(self._video_start[i]) : int(self._video_start[i + 1])]
        if self.kind is not None and self.kind[i]:
            e, f = int(self._element_start[i]), int(self._element_start[i + 1])
            entry["kind"] = int(self.kind[i])
            entry["elements"] = self._elements[e:f].tolist()
        return entry

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))


_cache: OrderedDict[tuple, tuple[Entries, str | None, tuple | None]] = OrderedDict()
"""(url, sha256) -> (the entries, the local file's path and ``_stat`` when it was read; None
for a remote one)."""
_cache_lock = threading.Lock()
_uncopied: set[str] = set()
"""The node folders where this process found that no copy of a sidecar could be kept."""


counting: ContextVar = ContextVar("wdsvlm_sidecar_counts", default=None)
"""Where this thread's reads of sidecars from a store are counted (a
``storage.fs.RequestCounts``), if anywhere: the read stage sets it while the plan makes a span."""


class LazyEntries(Sequence):
    """A version-2 shard's entries, read from its sidecar when first asked for (then kept in
    a per-process cache of the last ``_CACHED`` sidecars). Its length is the root index's
    sample count, known without reading; a pickled copy carries the address, not the data.

    The sidecar is checked against what the index records of it (``sidecar_bytes``,
    ``sha256``) when it is read: the bytes read are counted and hashed, once. A sidecar on a
    local file system that is in the cache is checked again (one ``stat``: its inode, size
    and modification time) when a ``LazyEntries`` is first used, and again once ``_RECHECK``
    seconds have passed: a row of a shard table (version 3) makes a new one each time it is
    asked for (each span of a plan), a version-2 index keeps one per shard. A dataset rewritten
    in place under a Loader that keeps its sidecars is so found before its new shards are read
    with the old offsets. ``shard``: the shard's name, for the errors.

    A sidecar on a store (S3, GCS, HTTP, the Hub) whose size and sha256 the index records is
    read from this node's copy (``storage.node.node_copy``): fetched into the node folder
    (``ReadPolicy.node_dir``) as ``sidecars/<sha256>.idx`` by the first process of the node
    that asks for it, checked against that size and sha256, then read from local disk by every
    process of the node; the copies take at most ``ReadPolicy.node_bytes`` (the Loader's
    ``local_bytes``), the least recently used removed first. A dataset rewritten in place
    names new digests, so new copies. The fetch is counted in ``counting`` (a request), a read
    of the node's copy is not."""

    def __init__(
        self,
        url: str,
        samples: int,
        storage_options: Mapping[str, Any] | None = None,
        policy: Any = None,
        sha256: str | None = None,
        sidecar_bytes: int | None = None,
        shard: str | None = None,
    ):
        self.url = url
        self.samples = samples
        self.sha256 = sha256  # with the URL, the cache key: a rewritten dataset is read anew
        self.sidecar_bytes = sidecar_bytes
        self.shard = shard
        self.storage_options = dict(storage_options or {})
        self.policy = policy
        self._checked = -_RECHECK  # when (time.monotonic) its cached sidecar was last checked

    def __len__(self) -> int:
        return self.samples

    def __getstate__(self):
        return {**self.__dict__, "_checked": -_RECHECK}

    def loaded(self) -> Entries:
        key = (self.url, self.sha256)
        with _cache_lock:
            cached = _cache.get(key)
            if cached is not None:
                _cache.move_to_end(key)
        if cached is not None:
            entries, path, stat = cached
            now = time.monotonic()
            if now - self._checked < _RECHECK or stat is None or _stat(path) == stat:
                self._checked = now
                return entries
            with _cache_lock:  # changed on disk since it was read: read and check it again
                _cache.pop(key, None)
        from ..storage.fs import filesystem, is_local, read_bytes, read_range

        fs, path = filesystem(self.url, self.storage_options)
        local = is_local(fs)
        counts = counting.get()
        cap = 0 if local else self._node_cap()
        try:
            stat = _stat(path) if local else None
            entries = self._from_node(cap, counts) if cap else None
            if entries is None:
                if counts is None or "://" not in self.url:
                    data = read_bytes(self.url, self.storage_options, self.policy)
                else:  # as read_bytes reads it, counted
                    options, policy = self.storage_options, self.policy
                    data = read_range(self.url, 0, None, options, policy, None, counts)
                entries = Entries(data, self.url)
                self._check(data)
        except FileNotFoundError:
            raise ShardFormatError(
                f"{self.url}: the shard's sidecar is missing (it keeps the shard's sample offsets)"
            ) from None
        if len(entries) != self.samples:
            raise ShardFormatError(
                f"{self.url}: {len(entries)} samples, but the index says {self.samples}"
            )
        if local and _stat(path) != stat:
            stat = None  # replaced while it was read: not kept as checked by its stat
        with _cache_lock:
            _cache[key] = (entries, path if local else None, stat)
            while len(_cache) > _CACHED:
                _cache.popitem(last=False)
        self._checked = time.monotonic()
        return entries

    def _node_cap(self) -> int:
        """The bytes this node's copies of sidecars may take (the read policy's
        ``node_bytes``), or 0 where this one is read from the store by each process: a sidecar
        its index records no size and sha256 of (nothing to name and check a copy by), or one
        larger than the cap."""
        from ..storage.node import LOCAL_BYTES

        if not self.sha256 or self.sidecar_bytes is None:
            return 0
        cap = getattr(self.policy, "node_bytes", None)
        cap = LOCAL_BYTES if cap is None else cap
        return cap if self.sidecar_bytes <= cap else 0

    def _from_node(self, cap: int, counts: Any) -> Entries | None:
        """The entries from this node's copy (``<node folder>/sidecars/<sha256>.idx``), read
        from local disk; fetched (and counted in ``counts``) where the node has none, where
        another process removed it to make room before it was read, or where it is damaged.
        None where the node's folder takes no copy (not a folder, not writable, full): the
        sidecar is then read from the store, with a warning once a process."""
        from ..errors import ObjectNotFoundError
        from ..storage.folders import node_folder
        from ..storage.node import SIDECARS, WrongCopyError, node_copy

        node = node_folder(getattr(self.policy, "node_dir", None), make=False)
        folder = os.path.join(node, SIDECARS)
        where = (self.url, self.sha256, self.sidecar_bytes, folder, SIDECAR_SUFFIX)
        options, policy, wrong, damage = self.storage_options, self.policy, None, None
        for _ in range(3):
            try:
                path = node_copy(*where, options, policy, wrong, cap, counts)
            except WrongCopyError as e:  # the store's is not the one the index records
                raise self._unlike(*e.found[-1]) from None
            except OSError as e:
                if isinstance(e, ObjectNotFoundError):
                    raise  # not on the store: the sidecar is missing
                if folder not in _uncopied:
                    _uncopied.add(folder)
                    log.warning(
                        "%s: the node's copies of sidecars cannot be kept there (%s): this "
                        "process reads them from the store (free the node's disk, or give "
                        "the Loader another local_dir, or local_bytes=0)",
                        folder,
                        e,
                    )
                return None
            try:
                with open(path, "rb") as f:
                    wrong, data = os.fstat(f.fileno()).st_ino, f.read()
            except FileNotFoundError:
                wrong = None  # removed to make room meanwhile: fetched again
                continue
            try:
                entries = Entries(data, path)
                self._check(data)
                return entries
            except ShardFormatError as e:
                log.warning("%s: this node's copy is damaged (%s); fetching it anew", path, e)
                damage = e
        raise ShardFormatError(
            f"shard {self.shard or '?'}: its sidecar's copy in {folder} is damaged even fetched "
            f"anew ({damage}): check the node's disk, or give the Loader another local_dir"
        )

    def _check(self, data: bytes) -> None:
        """The sidecar read is the one the index records: its size, and its sha256."""
        size = len(data)
        digest = hashlib.sha256(data).hexdigest() if self.sha256 else None
        if (self.sidecar_bytes is None or size == self.sidecar_bytes) and digest == self.sha256:
            return
        raise self._unlike(size, digest)

    def _unlike(self, size: int, digest: str | None) -> ShardFormatError:
        said = "" if self.sidecar_bytes is None else f"{self.sidecar_bytes} bytes, "
        return ShardFormatError(
            f"shard {self.shard or '?'}: its sidecar {self.url} is {size} bytes, sha256 "
            f"{(digest or '?')[:12]}..., but the index this Loader read records {said}sha256 "
            f"{(self.sha256 or '?')[:12]}...: the dataset was rewritten in place since the "
            "Loader was built (build a new Loader to read it as it is now), or the sidecar "
            "was changed (`wdsvlm verify`)"
        )

    def __getitem__(self, i):
        return self.loaded()[i]

    def __iter__(self) -> Iterator[dict]:
        return iter(self.loaded())


def _stat(path: str | None) -> tuple | None:
    """What tells a local file replaced or rewritten: its inode, size and modification time."""
    try:
        s = os.stat(path)
    except OSError:
        return None
    return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns)
