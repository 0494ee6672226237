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
from .format.index import load_index, verify_dataset
from .write.writer import WriteOptions, WriteSummary, write_dataset

__version__ = "0.1.0"

_LAZY = {
    "Plan": "pipeline.plan",
    "Source": "pipeline.sources",
    "WorkerConfig": "pipeline.plan",
    "ReadSamples": "pipeline.read",
    "Shuffle": "pipeline.shuffle",
    "DecodeImages": "pipeline.images",
    "ImageConfig": "pipeline.images",
    "Tokenize": "pipeline.tokenize",
    "SkipStats": "pipeline.stats",
    "Pack": "pipeline.pack",
    "Packer": "pipeline.packer",
    "Collate": "pipeline.collate",
    "block_causal_mask": "pipeline.collate",
    "Loader": "loader.loader",
    "model_inputs": "families.processors",
    "family_of": "families.processors",
    "LoaderSettings": "loader.settings",
    "ReadPolicy": "storage.fs",
    "ShardCache": "storage.cache",
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
