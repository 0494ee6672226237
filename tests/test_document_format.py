"""The record of a document or caption (``format/documents.py``) and what its index entry
keeps (``sample_entry``, the sidecar): refused with a reason where malformed, read back as
written."""

from __future__ import annotations

import json
import os

import pytest

from wdsvlm.errors import InputError
from wdsvlm.format.builder import sample_entry
from wdsvlm.format.documents import (
    check_elements,
    document_json,
    element_numbers,
    kind_of,
)
from wdsvlm.format.sidecar import Entries, pack_entries


def test_elements_in_reading_order_are_kept_and_numbered_for_the_index():
    elements = [{"text": "A title"}, {"image": 0}, {"text": "A paragraph."}, {"image": 1}]
    assert check_elements(elements, 2, "doc.jsonl:3 (id d3)") == elements
    assert element_numbers(elements) == [7, -1, 12, -1]
    record = json.loads(document_json("d3", "document", elements, "obelics", {"metadata": 1}))
    assert kind_of(record) == "document" and record["elements"] == elements
    assert record["metadata"] == 1 and kind_of({"messages": []}) == "conversation"


@pytest.mark.parametrize(
    "elements, images, kind, reason",
    [
        ([], 0, "document", "bad_elements"),
        ([{"text": "a", "image": 0}], 1, "document", "bad_elements"),
        ([{"text": 3}], 0, "document", "bad_elements"),
        ([{"video": 0}, {"text": "a"}], 0, "document", "bad_elements"),
        ([{"image": 0}, {"text": "  "}], 1, "document", "missing_text"),
        ([{"image": 1}, {"text": "a"}], 1, "document", "image_count_mismatch"),
        ([{"image": 0}, {"text": "a"}], 2, "document", "image_count_mismatch"),
        ([{"text": "a"}, {"image": 0}], 1, "caption", "bad_elements"),
    ],
)
def test_malformed_elements_are_refused_naming_the_record_and_the_reason(
    elements, images, kind, reason
):
    with pytest.raises(InputError) as e:
        check_elements(elements, images, "docs.jsonl:9 (id x)", kind)
    assert e.value.reason == reason and str(e.value).startswith("docs.jsonl:9 (id x): ")


def test_the_sidecar_keeps_each_samples_kind_and_elements_and_old_shards_are_conversations():
    entries = [
        sample_entry("a", 0, 10, [[3, 4]], [5]),
        sample_entry(
            "b", 10, 20, [[1, 2], [5, 6]], [3, 4], kind="document", elements=[3, -1, 4, -1]
        ),
        sample_entry("c", 30, 5, [[1, 1]], [7], kind="caption", elements=[-1, 7]),
    ]
    assert entries[1]["kind"] == 1 and entries[2]["kind"] == 2 and "kind" not in entries[0]
    read = Entries(pack_entries(entries), "x.idx")
    assert list(read) == entries
    assert read.kind.tolist() == [0, 1, 2]
    only_conversations = Entries(pack_entries(entries[:1]), "y.idx")
    assert only_conversations.kind is None and list(only_conversations) == entries[:1]


def test_a_merged_index_adds_up_the_parts_documents_captions_and_dropped_images(tmp_path):
    from wdsvlm.format.index import INDEX_NAME
    from wdsvlm.format.merge import merge_indexes
    from wdsvlm.testing.documents import random_documents, write_documents

    for n, seed in enumerate((1, 2)):
        made = random_documents(6, seed=seed, words=(5, 30), caption_share=0.5)
        part = write_documents(str(tmp_path / f"part-{n}"), made, per_shard=3)
        with open(os.path.join(part, INDEX_NAME)) as f:
            index = json.load(f)
        index["totals"]["dropped_images"] = {"download_failed": n + 1}
        with open(os.path.join(part, INDEX_NAME), "w") as f:
            json.dump(index, f)
    merged = merge_indexes(str(tmp_path), ["part-0", "part-1"], index_version=2)
    totals = merged["totals"]
    assert totals["documents"] + totals["captions"] == totals["samples"] == 12
    assert totals["dropped_images"] == {"download_failed": 3}
