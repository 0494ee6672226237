"""Read: spans of the plan in, samples (tar members by name) out.

Each span is one ranged read of a shard through fsspec; the samples inside it are cut out by
their index offsets. Nothing stays open between spans. A sample whose bytes are cut short (a
truncated shard) or do not parse as tar members of its key is skipped and counted.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator, Mapping
from typing import Any

from .errors import StorageError
from .stats import SkipStats
from .storage import filesystem
from .tarball import tar_members


class ReadSamples:
    """Pipeline stage: plan spans -> samples.

    A sample is ``{"__key__", "__shard__", "__url__", "__meta__" (its index entry),
    "__epoch__", "__worker__", "__pos__" (its place in the worker's reading order of the
    epoch), "json": bytes, "0.jpg": bytes, ...}``: member names without
    the key, as webdataset names them.
    """

    def __init__(
        self,
        storage_options: Mapping[str, Any] | None = None,
        *,
        stats: SkipStats | None = None,
    ):
        self.storage_options = dict(storage_options or {})
        self.stats = stats if stats is not None else SkipStats()

    def __call__(self, spans: Iterator[dict]) -> Iterator[dict]:
        for span in spans:
            fs, path = filesystem(span["url"], self.storage_options)
            try:
                data = fs.cat_file(path, start=span["start"], end=span["stop"])
            except OSError as e:  # a missing or unreadable shard is a fault, not a bad sample
                raise StorageError(
                    f"{span['url']}: cannot read bytes {span['start']}-{span['stop']} "
                    f"(shard {span['shard']}): {type(e).__name__}: {e}"
                ) from e
            positions = span.get("positions") or [None] * len(span["entries"])
            for entry, position in zip(span["entries"], positions, strict=True):
                sample = {
                    "__key__": entry["key"],
                    "__shard__": span["shard"],
                    "__url__": span["url"],
                    "__meta__": entry,
                    "__epoch__": span["epoch"],
                    "__worker__": span["worker"],
                    "__pos__": position,
                }
                begin = entry["offset"] - span["start"]
                chunk = data[begin : begin + entry["size"]]
                if len(chunk) < entry["size"]:
                    self.stats.skip(
                        "read",
                        "truncated_tar",
                        sample,
                        f"{span['url']} ends before byte {entry['offset'] + entry['size']}",
                    )
                    continue
                try:
                    members = tar_members(chunk)
                except tarfile.TarError as e:
                    self.stats.skip("read", "corrupt_tar", sample, f"bad tar data: {e}")
                    continue
                prefix = entry["key"] + "."
                if not members or any(not name.startswith(prefix) for name in members):
                    self.stats.skip(
                        "read",
                        "corrupt_tar",
                        sample,
                        f"members {sorted(members)} at offset {entry['offset']} are not all "
                        f"of key {entry['key']}: the index does not match the shard",
                    )
                    continue
                self.stats.ok("read")
                for name, value in members.items():
                    sample[name[len(prefix) :]] = value
                yield sample
