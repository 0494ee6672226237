"""wdsvlm: WebDataset shards in, dense packed batches out, for vision-language-model training.

Here is what a training script uses: the writer (``write_dataset``, ``index_tars``), the
dataset's index (``load_index``, ``verify_dataset``), the ``Loader``, its settings,
``Telemetry`` (what it measures) and ``RayWorkers`` (its workers on a Ray cluster), what a
training step calls on a batch (``model_inputs``, ``block_causal_mask``) and the errors worth
catching. The pipeline stages are in ``wdsvlm.pipeline``, the model families in
``wdsvlm.families``, every error in ``wdsvlm.errors``. Names are imported on first use: the
writer's side imports no torch.
"""

from .errors import (
    BadInputError,
    DatasetExistsError,
    ShardFormatError,
    StorageError,
    TooManyFailuresError,
    WdsvlmError,
)
from .lazy import lazy_exports
from .version import __version__ as __version__

_HOMES = {
    "write_dataset": ".write.writer",
    "WriteOptions": ".write.writer",
    "WriteSummary": ".write.writer",
    "index_tars": ".write.tarindex",
    "load_index": ".format.index",
    "verify_dataset": ".format.index",
    "Loader": ".loader.loader",
    "LoaderSettings": ".loader.settings",
    "RayWorkers": ".loader.placement",
    "Telemetry": ".loader.telemetry",
    "Source": ".pipeline.sources",
    "ReadPolicy": ".storage.fs",
    "model_inputs": ".families.inputs",
    "block_causal_mask": ".pipeline.collate",
}

__getattr__, __dir__ = lazy_exports(globals(), _HOMES)

__all__ = [
    *_HOMES,
    # what a user acts on: a dataset that is there already, bad input records, a dataset or
    # bucket that fails, a stream of samples that keep failing
    "WdsvlmError",
    "BadInputError",
    "DatasetExistsError",
    "ShardFormatError",
    "StorageError",
    "TooManyFailuresError",
]
