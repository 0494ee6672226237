"""The troubleshooting page names every reason the code counts a sample under: a skip or drop of
the Loader, a bad record of ``wdsvlm write`` or a bad tar sample of ``wdsvlm index``.

The reasons are read from the source with ``ast`` (no import, no subprocess): the string given
as the reason to ``skip``/``drop``/``BadSample``/``InputError``/``bad_sample``, assigned to a
variable named ``reason``, or returned by the functions that say why a sample cannot be packed
or tokenized. A reason built with an f-string (``f"{kind}_count_mismatch"``) must match a
reason written on the page."""

from __future__ import annotations

import ast
import os
import re

from .conftest import REPO

PAGE = os.path.join(REPO, "docs", "troubleshooting.md")
PACKAGE = os.path.join(REPO, "wdsvlm")

# the call's name -> which positional argument is the reason
REASON_ARGUMENT = {"skip": 1, "drop": 0, "BadSample": 0, "InputError": 1, "bad_sample": 1}
# functions whose returned strings (or the first item of returned tuples) are reasons
REASON_FUNCTIONS = {"oversized", "video_refusal"}
REASON = re.compile(r"[a-z*][a-z_*]*")


def pattern(node: ast.AST) -> str | None:
    """A string literal as it is, an f-string with ``*`` for each of its fields, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "*" for v in node.values)
    return None


def reasons_in(tree: ast.AST) -> set[str]:
    found: list[str | None] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            at = REASON_ARGUMENT.get(name)
            if at is not None and len(node.args) > at:
                found.append(pattern(node.args[at]))
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == "reason" for t in node.targets):
                found.append(pattern(node.value))
        elif isinstance(node, ast.FunctionDef) and node.name in REASON_FUNCTIONS:
            for inner in ast.walk(node):
                if isinstance(inner, ast.Return) and inner.value is not None:
                    value = inner.value
                    if isinstance(value, ast.Tuple) and value.elts:
                        value = value.elts[0]
                    found.append(pattern(value))
    return {r for r in found if r and REASON.fullmatch(r)}


def code_reasons() -> dict[str, list[str]]:
    """Every reason the package counts, with the files it is counted in."""
    reasons: dict[str, list[str]] = {}
    for folder, _, files in os.walk(PACKAGE):
        for file in sorted(files):
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), path)
            for reason in reasons_in(tree):
                reasons.setdefault(reason, []).append(os.path.relpath(path, REPO))
    return reasons


def page_reasons() -> set[str]:
    with open(PAGE, encoding="utf-8") as f:
        return set(re.findall(r"`([a-z][a-z_]*)`", f.read()))


def test_the_scan_finds_the_known_reasons():
    """A guard on the scan itself: it still finds reasons of each kind it reads."""
    reasons = code_reasons()
    for known in (
        "too_many_tokens",  # returned by the packer
        "too_many_vision_units",
        "undecodable_image",  # a Loader skip
        "video_not_supported",  # returned with its message
        "unreadable_sidecar",  # assigned to reason
        "bad_record",  # a writer's InputError
        "duplicate_key",  # a tar sample of wdsvlm index
        "*_count_mismatch",  # an f-string
    ):
        assert known in reasons, f"the scan no longer finds {known!r}: update REASON_ARGUMENT"
    assert len(reasons) >= 30


def test_every_counted_reason_is_on_the_troubleshooting_page():
    written = page_reasons()
    missing = []
    for reason, files in sorted(code_reasons().items()):
        if "*" in reason:
            regex = re.compile(re.escape(reason).replace(r"\*", "[a-z]+"))
            ok = any(regex.fullmatch(w) for w in written)
        else:
            ok = reason in written
        if not ok:
            missing.append(f"{reason} ({', '.join(files)})")
    assert not missing, "docs/troubleshooting.md does not name: " + "; ".join(missing)
