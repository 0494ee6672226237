"""wdsvlm: WebDataset shards in, dense packed batches out, for vision-language-model training.

The writer side (``write_dataset``, ``load_index``, ...) imports no torch; the pipeline stages
(``Plan``, ``ReadSamples``, ``Shuffle``, ``DecodeImages``, ``Tokenize``, ...) are imported on
first use.
"""

from importlib import import_module

from .errors import (
    BadInputError,
    DatasetExistsError,
    InputError,
    ObjectNotFoundError,
    ShardFormatError,
    StorageError,
    TemplateError,
    TooManyFailuresError,
    WdsvlmError,
)
from .index import load_index, verify_dataset
from .write import WriteOptions, WriteSummary, write_dataset

__version__ = "0.1.0"

_LAZY = {
    "Plan": "plan",
    "Source": "mixture",
    "WorkerConfig": "plan",
    "ReadSamples": "read",
    "Shuffle": "shuffle",
    "DecodeImages": "images",
    "ImageConfig": "images",
    "Tokenize": "tokenize",
    "SkipStats": "stats",
    "Pack": "pack",
    "Packer": "pack",
    "Collate": "collate",
    "block_causal_mask": "collate",
    "Loader": "loader",
    "model_inputs": "processors",
    "family_of": "processors",
    "LoaderSettings": "settings",
    "ReadPolicy": "storage",
    "ShardCache": "cache",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'wdsvlm' has no attribute {name!r}")


__all__ = [
    "BadInputError",
    "DatasetExistsError",
    "InputError",
    "ObjectNotFoundError",
    "ShardFormatError",
    "StorageError",
    "TemplateError",
    "TooManyFailuresError",
    "WdsvlmError",
    "WriteOptions",
    "WriteSummary",
    "load_index",
    "verify_dataset",
    "write_dataset",
    *_LAZY,
]
