"""The pipeline stages: sources, plan, read, shuffle, images, tokenize, pack, collate.

``wdsvlm.Loader`` chains them; they are exported here for a pipeline put together by hand
(a ``webdataset.DataPipeline`` of them), each imported on first use.
"""

from ..lazy import lazy_exports

_HOMES = {
    "Plan": ".plan",
    "WorkerConfig": ".plan",
    "ReadSamples": ".read",
    "Shuffle": ".shuffle",
    "ImageConfig": "..families.tiling",  # the default family's settings
    "DecodeImages": ".images",
    "Tokenize": ".tokenize",
    "SkipStats": ".stats",
    "Pack": ".pack",
    "Packer": ".packer",
    "Collate": ".collate",
}

__getattr__, __dir__ = lazy_exports(globals(), _HOMES)

__all__ = list(_HOMES)
