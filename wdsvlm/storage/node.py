"""What the processes of one node share on its local disk: a folder for the shard table's copy
and the request budget's counter."""

from __future__ import annotations

import os
import tempfile


def node_folder(local_dir: str | None = None, cache_dir: str | None = None) -> str:
    """The node-local folder shared by the node's processes: ``local_dir`` if given, else
    ``cache_dir/node``, else ``wdsvlm-<uid>`` in the system's temporary folder. Made if
    missing. Jobs that share a node share it: what goes there is named by its content (a
    table by its digest) or keyed by the store, so they help rather than clash."""
    if local_dir is None:
        if cache_dir is not None:
            local_dir = os.path.join(cache_dir, "node")
        else:
            local_dir = os.path.join(tempfile.gettempdir(), f"wdsvlm-{os.getuid()}")
    os.makedirs(local_dir, exist_ok=True)
    return local_dir
