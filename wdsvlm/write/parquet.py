"""Parquet input as the Hugging Face Hub publishes it: rows read a batch at a time, and the
images embedded in them read again, alone, when their shard is written."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import fsspec

from ..format.conversation import detect_format

BATCH_ROWS = 64  # rows read at a time, whatever the file's size


def is_parquet(path: str) -> bool:
    return path.lower().endswith((".parquet", ".pq"))


def iter_parquet(
    path: str, storage_options=None, groups: Sequence[int] | None = None, first_row: int = 0
) -> Iterator[tuple[str, Any, tuple]]:
    """``(where, row as a dict, (path, row group, row in it))`` for each row of a Parquet
    file (of its row ``groups``, the first of them starting at row ``first_row``), read
    ``BATCH_ROWS`` rows at a time."""
    with open_parquet(path, storage_options) as parquet:
        row = first_row
        for group in range(parquet.num_row_groups) if groups is None else groups:
            i = 0  # row in the group
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=[group]):
                for raw in batch.to_pylist():
                    yield f"{path} row {row}", raw, (path, group, i)
                    row += 1
                    i += 1


@contextmanager
def open_parquet(path: str, storage_options=None):
    """A ``pyarrow.parquet.ParquetFile`` of ``path`` (local or any fsspec URL), its errors
    named with the file."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            f"{path}: Parquet input needs pyarrow: pip install 'wdsvlm[parquet]'"
        ) from None
    try:
        f = fsspec.open(path, "rb", **(storage_options or {})).open()
    except FileNotFoundError:
        raise FileNotFoundError(f"input file {path} not found") from None
    with f:
        try:
            parquet = pq.ParquetFile(f)
        except Exception as e:  # noqa: BLE001 - pyarrow's errors: named with the file
            raise ValueError(f"{path} is not a readable Parquet file: {e}") from None
        yield parquet


def parquet_format(parquet, path: str) -> str:
    """A Parquet file's format from its columns (no row read): OBELICS's ``texts`` are
    strings (Cauldron's are turns), MMC4 has ``text_list`` and ``image_info``."""
    import pyarrow as pa

    schema = parquet.schema_arrow
    if "text_list" in schema.names and "image_info" in schema.names:
        return "mmc4"
    if "texts" in schema.names and "images" in schema.names:
        texts = schema.field("texts").type
        if pa.types.is_list(texts) and pa.types.is_string(texts.value_type):
            return "obelics"
    return detect_format({name: None for name in schema.names}, path)


@dataclass(frozen=True)
class Embedded:
    """An image embedded in a Parquet input: row ``row`` of row group ``group`` of ``path``,
    its ``column`` (item ``item`` of it when the column holds a list). The writer reads the
    bytes again from there when it writes the shard, so no image bytes wait in memory."""

    path: str
    group: int
    row: int
    column: str
    item: int | None

    def __str__(self) -> str:
        item = "" if self.item is None else f"[{self.item}]"
        return f"{self.path} row group {self.group} row {self.row} {self.column}{item}"

    def read(self, storage_options: Mapping[str, Any] | None = None) -> bytes:
        value = _row_group_column(self.path, self.group, self.column, storage_options)[self.row]
        if self.item is not None:  # this image of the row's list, not the whole row
            value = value.values[self.item]
        if value.type.num_fields == 0:  # a plain binary column (img2dataset's jpg)
            return value.as_py()
        return value["bytes"].as_py()


_groups: OrderedDict[tuple, Any] = OrderedDict()  # the last row groups read, per process


def _row_group_column(path: str, group: int, column: str, storage_options) -> list:
    key = (path, group, column)
    if key in _groups:
        _groups.move_to_end(key)
        return _groups[key]
    with open_parquet(path, storage_options) as parquet:
        values = parquet.read_row_group(group, columns=[column])[column]
    _groups[key] = values  # Arrow's buffers: no Python object per image until asked for
    while len(_groups) > 2:
        _groups.popitem(last=False)
    return values
