"""Where the processes of one node share files: the node folder (imports nothing of wdsvlm, so
that every module of the storage layer may name it)."""

from __future__ import annotations

import os
import tempfile

LOCAL_DIR_ENV = "WDSVLM_LOCAL_DIR"
"""The environment variable that names the node folder where a Loader's ``local_dir`` does
not (a cluster's image or job script sets it once for every job)."""


def node_folder(
    local_dir: str | None = None, cache_dir: str | None = None, make: bool = True
) -> str:
    """The node-local folder shared by the node's processes: ``local_dir`` if given, else
    ``$WDSVLM_LOCAL_DIR``, else ``cache_dir/node``, else ``wdsvlm-<uid>`` in the system's
    temporary folder. Made if missing (``make=False``: only named, made by what first writes
    there). Jobs that share a node share it: what goes there is named by its content (a table
    by its digest) or keyed by the store, so they help rather than clash."""
    if local_dir is None:
        local_dir = os.environ.get(LOCAL_DIR_ENV) or None
    if local_dir is None:
        if cache_dir is not None:
            local_dir = os.path.join(cache_dir, "node")
        else:
            local_dir = os.path.join(tempfile.gettempdir(), f"wdsvlm-{os.getuid()}")
    if make:
        os.makedirs(local_dir, exist_ok=True)
    return local_dir
