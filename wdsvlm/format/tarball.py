"""The tar layout of a shard: written by hand with fixed metadata, so sizes are known ahead
and offsets and the sha256 come out while writing; and read back one sample at a time."""

from __future__ import annotations

import hashlib
import io
import tarfile
from typing import BinaryIO

BLOCK = tarfile.BLOCKSIZE  # 512
RECORD = tarfile.RECORDSIZE  # 10240: tar files end padded to a whole record
END_OF_ARCHIVE = 2 * BLOCK


def padded(size: int) -> int:
    """``size`` rounded up to whole blocks."""
    return -(-size // BLOCK) * BLOCK


def member_bytes(size: int) -> int:
    """Bytes a member of ``size`` data bytes takes: its header and its padded data."""
    return BLOCK + padded(size)


def tar_bytes(members_bytes: int) -> int:
    """Size of a tar file whose members take ``members_bytes``: plus the end-of-archive
    blocks, padded to a whole record as tar files are."""
    return -(-(members_bytes + END_OF_ARCHIVE) // RECORD) * RECORD


def header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0  # fixed metadata: the same input gives byte-identical shards
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


class HashingTarWriter:
    """Appends tar members to a file, counting bytes and hashing as it goes."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.digest = hashlib.sha256()
        self.offset = 0

    def put(self, data: bytes) -> None:
        self.f.write(data)
        self.digest.update(data)
        self.offset += len(data)

    def member(self, name: str, data: bytes) -> None:
        self.put(header(name, len(data)))
        self.put(data)
        self.put(b"\0" * (padded(len(data)) - len(data)))

    def close(self) -> None:
        self.put(b"\0" * END_OF_ARCHIVE)
        self.put(b"\0" * (-self.offset % RECORD))


def tar_members(chunk: bytes) -> dict[str, bytes]:
    """The members of a complete little tar (one sample's byte range), by name."""
    members = {}
    with tarfile.open(fileobj=io.BytesIO(chunk), mode="r:") as tar:
        for info in tar:
            if not info.isfile():
                continue
            data = tar.extractfile(info).read()
            if len(data) != info.size:
                raise tarfile.ReadError(f"member {info.name} is cut short")
            members[info.name] = data
    return members
