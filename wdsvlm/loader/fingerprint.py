"""What a saved state records of the dataset, to resume only on the data it was saved on.

Two facts of the resume config (``settings.resume_config``):

- ``dataset``: which shards the sources hold (each shard's name, samples and bytes) and each
  source's share of a pass;
- ``shards_sha256``: the shards' content (each shard's sha256, as the indexes record them): a
  dataset rewritten with the same names, counts and sizes is another dataset.

Where every source's index is of version 3, both come from the shard tables' digests, which
``index.json`` records (``ShardTable.table_sha256``): O(1) whatever the number of shards, and
written ``table:<hex digits>``. ``shards_sha256`` is then the digest of the tables (a table
holds every shard's name, counts, sizes and sha256), ``dataset`` each source's share of a pass
with its table's shard and sample counts. Otherwise (an index of version 1 or 2 among the
sources) each is a hash of every shard's row, the same for a dataset's index of any version.

A state that records the row form (saved on an index of version 1 or 2, or by an earlier
wdsvlm) is checked against the row form computed here for it (``comparable``): only such a
resume reads every row (about 1 s at a million shards), and a state saved on a version-2 index
resumes on the same dataset upgraded to version 3 (``wdsvlm index --upgrade``: the same shards,
a new table). A state that records the tables' form cannot be checked on an index of version 1
or 2 (no table to take a digest of): it resumes with a warning, unchecked.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Any

from ..format.table import ShardTable
from ..pipeline.plan import Plan

log = logging.getLogger("wdsvlm.loader")

FACTS = ("dataset", "shards_sha256")
TABLES = "table:"
"""The start of a fact taken from the shard tables' digests."""


def dataset_facts(plan: Plan) -> dict[str, str]:
    """``dataset`` and ``shards_sha256`` of the plan's sources: from their tables' digests
    where every index has one (O(1)), else from every shard's row (``row_facts``)."""
    tables = [s.index["shards"] for s in plan.sources]
    if not all(isinstance(t, ShardTable) and t.table_sha256 for t in tables):
        return row_facts(plan)
    fixed = plan.schedule is None
    if plan.mixture:
        heads = [
            [s.name, s.copies if fixed else None, s.extra if fixed else None, len(t), s.size]
            for s, t in zip(plan.sources, tables, strict=True)
        ]
    else:
        heads = [[len(tables[0]), plan.sources[0].size]]
    return {
        "dataset": TABLES + _hex(json.dumps(heads).encode()),
        "shards_sha256": TABLES + _hex(json.dumps([t.table_sha256 for t in tables]).encode()),
    }


def row_facts(plan: Plan) -> dict[str, str]:
    """``dataset`` and ``shards_sha256`` from every shard's row, as every wdsvlm before the
    tables' form recorded them."""
    return {"dataset": dataset_id(plan), "shards_sha256": shards_sha256(plan)}


def comparable(saved: Mapping[str, Any], here: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
    """``here`` (a loader's resume config) in the form of the ``saved`` config's dataset facts:
    the row form computed where the state records it and ``here`` has the tables' form; a fact
    the state records in the tables' form and ``here`` cannot (an index of version 1 or 2)
    left out, with a warning."""
    out, rows, unchecked = dict(here), None, []
    for k in FACTS:
        if k not in saved or k not in out:
            continue
        old, new = str(saved[k]).startswith(TABLES), str(out[k]).startswith(TABLES)
        if new and not old:
            rows = rows or row_facts(plan)  # every row read: only for such a state
            out[k] = rows[k]
        elif old and not new:
            del out[k]
            unchecked.append(k)
    if unchecked:
        log.warning(
            "the loader state records %s of shard tables (index version 3), and an index of "
            "this dataset is of an earlier version: resuming without checking them "
            "(`wdsvlm index --upgrade` the dataset to have them checked)",
            unchecked,
        )
    return out


def dataset_id(plan: Plan) -> str:
    """The sources' shards and each source's share of a pass (of a weight schedule: the
    schedule, recorded apart, decides the shares). The same for a dataset's index of any
    version; hashed as JSON text made piece by piece (a million shards need no list)."""
    fixed = plan.schedule is None
    digest = hashlib.sha256()
    if not plan.mixture:  # as the first release recorded a dataset
        _hash_rows(digest, plan.sources[0].index["shards"], _name_samples_bytes)
        return digest.hexdigest()[:16]
    digest.update(b"[")
    for k, s in enumerate(plan.sources):
        head = [s.name, s.copies if fixed else None, s.extra if fixed else None]
        digest.update(((", " if k else "") + json.dumps(head)[:-1] + ", ").encode())
        _hash_rows(digest, s.index["shards"], _name_samples_bytes)
        digest.update(b"]")
    digest.update(b"]")
    return digest.hexdigest()[:16]


def shards_sha256(plan: Plan) -> str:
    """The sha256 of every shard of every source, as the indexes record them. Its own key
    beside ``dataset``, so a state saved before it was recorded still resumes (unchecked, with
    a warning) rather than being refused."""
    digest = hashlib.sha256(b"[")
    for k, s in enumerate(plan.sources):
        digest.update(b", " if k else b"")
        _hash_rows(digest, s.index["shards"], _sha256s)
    digest.update(b"]")
    return digest.hexdigest()[:16]


def _hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _name_samples_bytes(shards, a: int, b: int) -> list:
    if isinstance(shards, ShardTable):
        columns = (shards.names(a, b), shards.samples[a:b].tolist(), shards.bytes[a:b].tolist())
        return list(zip(*columns, strict=True))  # JSON writes a tuple as a list
    return [[h["name"], h["samples"], h.get("bytes")] for h in shards[a:b]]


def _sha256s(shards, a: int, b: int) -> list:
    if isinstance(shards, ShardTable):
        return shards.shard_sha256s(a, b)
    return [h.get("sha256") for h in shards[a:b]]


def _hash_rows(digest, shards, rows, step: int = 65536) -> None:
    """``digest.update`` with ``json.dumps([rows of every shard])``, made ``step`` at a time."""
    digest.update(b"[")
    for a in range(0, len(shards), step):
        text = json.dumps(rows(shards, a, min(len(shards), a + step)))[1:-1]
        digest.update(((", " if a else "") + text).encode())
    digest.update(b"]")
