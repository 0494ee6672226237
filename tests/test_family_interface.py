"""Every family answers the one Family interface, and the stages ask only it: no stage keeps a
branch of its own for the default tiling."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np
import pytest

import wdsvlm
from wdsvlm.families.base import Family
from wdsvlm.families.llava_onevision import LlavaOnevisionFamily
from wdsvlm.families.qwen import QwenFamily
from wdsvlm.families.registry import family_of
from wdsvlm.families.smolvlm import SmolVLMFamily
from wdsvlm.families.tiling import ImageConfig, TilingFamily
from wdsvlm.testing.tiny import FAMILIES, tiny_processor

from .conftest import EXAMPLE

TOKENIZER = os.path.join(EXAMPLE, "tokenizer")
PACKAGE = Path(wdsvlm.__file__).parent


def test_the_default_tiling_is_a_family_with_a_tokenizer_or_for_images_alone():
    tiling = TilingFamily(ImageConfig(tile_size=64), TOKENIZER, tokens_per_tile=3)
    assert isinstance(tiling, Family)
    assert isinstance(TilingFamily(), Family)  # the image side alone: DecodeImages, Collate
    assert tiling.image_cost(200, 100) == 4 * 2 + 1  # a 4 x 2 grid and the thumbnail
    ids = tiling.image_token_ids(200, 100)
    assert ids.dtype == np.int64 and (ids == tiling.image_token_id).all() and len(ids) == 9 * 3
    assert tiling.constant_fields() == {} and tiling.batch_fields([[]], {}) == {}


@pytest.mark.parametrize("name", FAMILIES)
def test_each_processor_family_is_a_family(name):
    family = family_of(tiny_processor(name))
    assert isinstance(family, (QwenFamily, SmolVLMFamily, LlavaOnevisionFamily))
    assert isinstance(family, Family)
    assert family.name in type(family).names
    assert family.constant_fields()["family"] == family.name


def test_an_object_missing_a_member_is_not_a_family():
    class Partial:
        def image_cost(self, width, height):
            return 1

    assert not isinstance(Partial(), Family)


def _family_none_tests(path: Path) -> list[str]:
    """``X is None`` / ``X is not None`` comparisons whose X is a name or attribute called
    ``family``, as ``file:line``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(
            (isinstance(s, ast.Name) and s.id == "family")
            or (isinstance(s, ast.Attribute) and s.attr == "family")
            for s in sides
        )
        none = any(isinstance(s, ast.Constant) and s.value is None for s in sides)
        if named and none and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_no_stage_branches_on_whether_there_is_a_family():
    files = [p for d in ("pipeline", "loader", "tools") for p in sorted((PACKAGE / d).glob("*.py"))]
    assert len(files) > 10
    assert [hit for p in files for hit in _family_none_tests(p)] == []
