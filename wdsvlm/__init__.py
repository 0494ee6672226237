"""wdsvlm: WebDataset shards in, dense packed batches out, for vision-language-model training."""

from .errors import (
    BadInputError,
    DatasetExistsError,
    InputError,
    ShardFormatError,
    StorageError,
    WdsvlmError,
)
from .index import load_index, verify_dataset
from .write import WriteOptions, WriteSummary, write_dataset

__version__ = "0.1.0"

__all__ = [
    "BadInputError",
    "DatasetExistsError",
    "InputError",
    "ShardFormatError",
    "StorageError",
    "WdsvlmError",
    "WriteOptions",
    "WriteSummary",
    "load_index",
    "verify_dataset",
    "write_dataset",
]
