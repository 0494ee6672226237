"""``wdsvlm index``: the index of WebDataset tars that exist already, without rewriting them.

Each tar is read once, sequentially (in parallel over tars). Per sample the index records its
byte range, its images' displayed sizes (read from the image headers, EXIF orientation applied,
no decode) and the characters per turn of its conversation, in the layout the tars hold
(``layouts``: wdsvlm's own, captions, conversations). The root ``index.json`` records the
layout, so the Loader, ``inspect`` and ``stats`` read these tars as they read wdsvlm's own.

The index and the shards' sidecars go beside the tars, or to ``output`` when the tars' place
is read-only; then the index names where the tars are (``shard_root``). Bad samples are
counted by reason and listed in ``index-skipped.jsonl``; without ``skip_bad`` they stop the
run with no ``index.json`` written. ``index.json`` is written last.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import tarfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..errors import DatasetExistsError, ShardFormatError, StorageError, WdsvlmError
from ..format.images import UnreadableImage, image_size
from ..format.index import FORMAT, INDEX_NAME, VERSION, dumps_index, shard_summary, sidecar_entry
from ..format.layouts import LAYOUTS, BadSample, Layout, detect, image_suffixes, split_name
from ..format.sidecar import pack_entries, sidecar_name
from ..format.tarball import BLOCK, padded
from ..progress import progress
from ..storage.fs import exists, filesystem, join, list_names, publish_bytes, remove

log = logging.getLogger("wdsvlm.tarindex")

INDEX_SKIPPED_NAME = "index-skipped.jsonl"
_DETECT_SAMPLES = 16  # samples of the first tar that ``auto`` looks at


class BadSamplesError(WdsvlmError):
    """``wdsvlm index`` found bad samples and was not asked to skip them."""

    def __init__(self, bad: list[dict], total: int, shown: int = 10):
        lines = [f"{b['shard']} key {b['key']}: {b['reason']}: {b['message']}" for b in bad]
        more = f"\n  ... and {len(bad) - shown} more" if len(bad) > shown else ""
        super().__init__(
            f"{len(bad)} of {total} samples are bad; no index.json was written (pass "
            "--skip-bad / skip_bad=True to index the rest; they are listed in "
            f"{INDEX_SKIPPED_NAME}):\n  " + "\n  ".join(lines[:shown]) + more
        )
        self.bad = bad


@dataclass
class IndexSummary:
    """What ``index_tars`` found."""

    output: str
    layout: str
    detected: str | None = None
    shards: int = 0
    samples: int = 0
    images: int = 0
    bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def __str__(self) -> str:
        found = f" (detected: {self.detected})" if self.detected else ""
        line = (
            f"indexed {self.samples} samples ({self.images} images) in {self.shards} shards, "
            f"{self.bytes / 1e6:.1f} MB, layout {self.layout}{found}, in {self.seconds:.1f} s; "
            f"index at {join(self.output, INDEX_NAME)}; "
        )
        if not self.skipped:
            return line + "skipped none"
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(self.skipped.items()))
        return line + f"skipped {sum(self.skipped.values())} ({reasons}), see {INDEX_SKIPPED_NAME}"


def tar_urls(source: str | Sequence[str], storage_options=None) -> tuple[str, list[str]]:
    """``(the tars' folder, their URLs)``: every ``.tar`` in a folder or URL prefix (sorted),
    or a brace pattern or list of tar URLs (in their order)."""
    import braceexpand

    if isinstance(source, str) and not source.endswith(".tar"):
        names = sorted(n for n in list_names(source, storage_options) if n.endswith(".tar"))
        if not names:
            raise FileNotFoundError(f"no .tar files in {source}")
        return source.rstrip("/"), [join(source, n) for n in names]
    patterns = [source] if isinstance(source, str) else list(source)
    urls = [u for p in patterns for u in braceexpand.braceexpand(p)]
    if not urls:
        raise ValueError(f"no tar URLs in {source!r}")
    folders = {u.rsplit("/", 1)[0] if "/" in u else "." for u in urls}
    if len(folders) > 1:
        raise ValueError(f"the tars of one index must lie in one folder; found {sorted(folders)}")
    return folders.pop(), urls


def index_tars(
    source: str | Sequence[str],
    *,
    output: str | None = None,
    format: str = "auto",
    prompts: Sequence[str] | None = None,
    prompt_seed: int = 0,
    workers: int = 1,
    skip_bad: bool = False,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    show_progress: bool = True,
) -> IndexSummary:
    """Index the WebDataset tars of ``source`` (a folder or URL prefix, a brace pattern or a
    list of tar URLs) where they are, or into ``output``; see the module. ``format`` is a
    layout of ``layouts.LAYOUTS`` or ``auto``; ``prompts`` and ``prompt_seed`` set the
    captions layout's prompts."""
    if format not in ("auto", *LAYOUTS):
        raise ValueError(f"format must be auto or one of {', '.join(LAYOUTS)}, not {format!r}")
    started = time.perf_counter()
    folder, urls = tar_urls(source, storage_options)
    output = (output or folder).rstrip("/")
    index_url = join(output, INDEX_NAME)
    if exists(index_url, storage_options):
        if not overwrite:
            raise DatasetExistsError(
                f"{index_url} exists; pass --overwrite / overwrite=True to index the tars again"
            )
        remove(index_url, storage_options)  # its sidecars are rewritten: no reader may pair them
    detected = None
    name = format
    if format == "auto":
        name, detected = detect(list(_first_samples(urls[0], storage_options)))
        log.info("%s: layout %s (%s)", urls[0], name, detected)
    settings = {"prompts": tuple(prompts)} if prompts else {}
    layout = Layout(name, seed=prompt_seed, **settings)
    names = [u[len(folder) + 1 :] if u.startswith(folder + "/") else u for u in urls]
    scan = partial(_scan_and_publish, layout=layout, output=output, options=storage_options)
    results: list[dict] = []
    from ..write.writer import _pool

    with _pool(min(workers, len(urls))) as pool:
        jobs = zip(urls, names, strict=True)
        mapped = map(scan, jobs) if pool is None else pool.imap(scan, jobs)
        bar = progress(
            mapped, enabled=show_progress, total=len(urls), desc="indexing", unit=" tars"
        )
        results = list(bar)
    bad = [b for r in results for b in r.pop("bad")]
    samples = sum(r["samples"] for r in results)
    skipped_url = join(output, INDEX_SKIPPED_NAME)
    if bad:
        lines = (json.dumps(b, ensure_ascii=False) for b in bad)
        publish_bytes(("\n".join(lines) + "\n").encode("utf-8"), skipped_url, storage_options)
    else:
        remove(skipped_url, storage_options)
    if (bad and not skip_bad) or not samples:
        for r in results:  # no index, no sidecars of it
            remove(join(output, r["sidecar"]["name"]), storage_options)
        if bad:
            raise BadSamplesError(bad, samples + len(bad))
        raise ValueError(f"no samples in the tars of {source}: nothing to index")
    skipped = Counter(b["reason"] for b in bad)
    totals = {k: sum(r.pop(k) for r in results) for k in ("images", "multi_image")}
    index = {
        "format": FORMAT,
        "version": VERSION,
        "layout": layout.to_dict(),
        "shards": results,
        "totals": {
            "shards": len(results),
            "samples": samples,
            "bytes": sum(r["bytes"] for r in results),
            "images": totals["images"],
            "text_only": sum(r["sums"]["text_only"] for r in results),
            "multi_image": totals["multi_image"],
            "turns": sum(r["sums"]["turns"] for r in results),
            "chars": sum(r["sums"]["chars"] for r in results),
            "sources": {layout.name: samples},
            "skipped": dict(sorted(skipped.items())),
        },
    }
    if output != folder:  # absolute: the index may be read from anywhere
        index["shard_root"] = folder if "://" in folder else os.path.abspath(folder)
    publish_bytes(dumps_index(index), index_url, storage_options)
    if bad:
        log.warning(
            "skipped %d bad samples (%s); listed in %s", len(bad), dict(skipped), skipped_url
        )
    return IndexSummary(
        output=output,
        layout=layout.name,
        detected=detected,
        shards=len(results),
        samples=samples,
        images=totals["images"],
        bytes=index["totals"]["bytes"],
        skipped=dict(skipped),
        seconds=time.perf_counter() - started,
    )


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


def _first_samples(url: str, storage_options) -> Iterator[dict[str, bytes]]:
    fs, path = filesystem(url, storage_options)
    try:
        with fs.open(path, "rb") as f, tarfile.open(fileobj=f, mode="r|") as tar:
            for _, _, _, members, _ in itertools.islice(_groups(tar), _DETECT_SAMPLES):
                yield members
    except FileNotFoundError:
        raise FileNotFoundError(f"{url}: tar not found") from None
    except tarfile.TarError as e:
        raise ShardFormatError(f"{url}: not a tar file ({e})") from None


def scan_tar(url: str, layout: Layout, storage_options=None) -> dict:
    """Read one tar once: its samples' index entries, its bad samples, bytes and sha256."""
    fs, path = filesystem(url, storage_options)
    shard = url.rsplit("/", 1)[-1]
    seen: set[str] = set()

    def bad_sample(key: str, reason: str, message: str) -> dict:
        return {"shard": shard, "key": key, "reason": reason, "message": message}

    outcomes: list[tuple[str, dict]] = []  # per sample, in order: its entry, or why it is bad
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
                    outcomes.append(("bad", bad_sample(key, "truncated_tar", trouble)))
                    cut = True
                    break
                if key in seen:
                    why = bad_sample(key, "duplicate_key", "the key appears twice in the tar")
                    outcomes.append(("bad", why))
                    continue
                seen.add(key)
                if "" in members:  # the reader could not tell it from another key's
                    message = f"member {key} has no suffix (webdataset names KEY.SUFFIX)"
                    outcomes.append(("bad", bad_sample(key, "bad_member", message)))
                    continue
                try:
                    entry = _entry(key, members, layout)
                except BadSample as e:
                    outcomes.append(("bad", bad_sample(key, e.reason, str(e))))
                    continue
                outcomes.append(("entry", {**entry, "offset": start, "size": end - start}))
            reader.rest()
            stop = tar.offset  # where tarfile stopped: the end-of-archive blocks, or not
            if not cut and (reader.count < stop + 2 * BLOCK or reader.last_nonzero >= stop):
                # no end-of-archive blocks: the tar is cut, or a header there does not parse;
                # the last sample may lack members that came after
                if outcomes:
                    key = outcomes[-1][1]["key"]
                    message = f"the tar stops at byte {stop} without its end, inside or after it"
                    outcomes[-1] = ("bad", bad_sample(key, "truncated_tar", message))
                if reader.last_nonzero >= stop + BLOCK:
                    message = (
                        f"{reader.count - stop} bytes from byte {stop} on do not read as tar "
                        "members (a corrupt header, or tars joined); nothing there is indexed"
                    )
                    outcomes.append(
                        ("bad", bad_sample(f"(from byte {stop})", "corrupt_tar", message))
                    )
    except FileNotFoundError:
        raise StorageError(f"{url}: tar not found") from None
    return {
        "entries": [o for kind, o in outcomes if kind == "entry"],
        "bad": [o for kind, o in outcomes if kind == "bad"],
        "bytes": reader.count,
        "sha256": reader.digest.hexdigest(),
    }


def _entry(key: str, members: Mapping[str, bytes], layout: Layout) -> dict:
    """A sample's index entry (without its byte range) from its members."""
    images = image_suffixes(list(members))
    if layout.native:
        if any(not re.fullmatch(r"\d+\..+", s) for s in images):
            raise BadSample("bad_layout", "a wdsvlm sample's images are numbered (0.jpg)")
        try:
            chars = [len(m["content"]) for m in json.loads(members["json"])["messages"]]
        except (KeyError, TypeError, ValueError) as e:
            raise BadSample("invalid_json", f"no wdsvlm json member with messages ({e})") from None
    else:
        chars = [len(m["content"]) for m in layout.messages(key, members, len(images))]
    sizes = []
    for suffix in images:
        try:
            sizes.append(list(image_size(members[suffix])))
        except UnreadableImage as e:
            raise BadSample("unreadable_image", f"image {suffix}: {e}") from None
    return {"key": key, "images": sizes, "chars": chars}


def _scan_and_publish(job: tuple[str, str], layout: Layout, output: str, options) -> dict:
    """Scan one tar and publish its sidecar; return its root-index entry (with its bad
    samples under ``bad`` and counts for the totals)."""
    url, name = job
    scanned = scan_tar(url, layout, options)
    entries = scanned["entries"]
    data = pack_entries(entries)
    side = sidecar_name(name)
    publish_bytes(data, join(output, side), options)
    return {
        "name": name,
        "samples": len(entries),
        "bytes": scanned["bytes"],
        "sha256": scanned["sha256"],
        "sidecar": sidecar_entry(side, data),
        **shard_summary(entries),
        "bad": scanned["bad"],
        "images": sum(len(e["images"]) for e in entries),
        "multi_image": sum(len(e["images"]) > 1 for e in entries),
    }
