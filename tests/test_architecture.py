"""The house's shape holds: sub-packages in layers, imports (those inside functions too) only
downward or within a package, no import cycle, no module taking another's private name, and
short modules."""

from __future__ import annotations

import ast
import os

from .conftest import REPO

PACKAGE = os.path.join(REPO, "wdsvlm")
# Bottom to top. A module imports from its own sub-package or from lower layers only; packages
# on one layer (the writer and the model families) know nothing of each other.
LAYERS = {
    "errors": 0,
    "progress": 0,
    "version": 0,
    "lazy": 0,
    "storage": 1,
    "compat": 1,
    "format": 2,
    "write": 3,
    "families": 3,
    "pipeline": 4,
    "testing": 4,
    "loader": 5,
    "tools": 6,
    "hf": 6,
}
MAX_LINES = 400


def modules() -> dict[str, str]:
    """Dotted module name -> path, for every module of the package."""
    found = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports(name: str, path: str, known: dict[str, str]) -> list[tuple[str, str]]:
    """``(module, imported name)`` of every wdsvlm import in a module, at any depth."""
    package = name.split(".") if path.endswith("__init__.py") else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "wdsvlm":
                for alias in node.names:
                    whole = f"{target}.{alias.name}"
                    out.append((whole, "") if whole in known else (target, alias.name))
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.split(".")[0] == "wdsvlm"]
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {
        name: {target for target, _ in imports(name, path, known) if target != name}
        for name, path in known.items()
    }


def layer(module: str) -> tuple[int, str]:
    parts = module.split(".")
    if len(parts) == 1:  # the package's face: the top
        return 99, ""
    return LAYERS[parts[1]], parts[1]


def test_every_module_belongs_to_a_known_layer():
    unknown = {m.split(".")[1] for m in modules() if "." in m} - set(LAYERS)
    assert not unknown, f"give these a layer in LAYERS: {sorted(unknown)}"


def test_imports_run_only_down_the_layers_or_within_a_package():
    wrong = []
    for module, targets in graph().items():
        here, package = layer(module)
        for target in targets:
            there, other = layer(target)
            if there > here or (there == here and other != package):
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports that run up or across the layers:\n" + "\n".join(sorted(wrong))


def test_no_import_cycle():
    edges = graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            raise AssertionError("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(edges.get(module, ())):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(edges):
        visit(module, [])


def test_no_module_takes_another_modules_private_name():
    known = modules()
    taken = [
        f"{name} takes {target}.{imported}"
        for name, path in known.items()
        for target, imported in imports(name, path, known)
        if imported.startswith("_") and not imported.startswith("__")
    ]
    assert not taken, "\n".join(taken)


def test_every_module_is_short_enough_to_hold_in_ones_head():
    long = {
        name: n for name, path in modules().items() if (n := sum(1 for _ in open(path))) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines, two ideas in one file: {long}"


# Libraries whose private names wdsvlm may use only in wdsvlm/compat.py, each checked there.
GUARDED = ("torch", "transformers", "multiprocessing", "sys", "signal", "ctypes", "trl")
# Private names of theirs that wdsvlm uses (in compat.py), found wherever they are reached from.
KNOWN_PRIVATE = {
    "_from_config",
    "_new_shared",
    "_shutdown_workers",
    "_global_mapping",
    "_forkserver",
    "_preload_modules",
    "_forkserver_alive_fd",
    "_set_SIGCHLD_handler",
    "_attn_implementation",
    "_get_output_dir",
}


def test_private_names_of_other_libraries_live_in_compat_alone():
    """``module._name`` of torch, transformers or CPython, a private name imported from them,
    or ``super()._name`` (a Trainer's private method called, unless ``compat`` checks it when
    ``wdsvlm.hf`` is imported): only in ``compat.py``."""
    from wdsvlm.compat import TRAINER_METHODS

    found = []
    for name, path in modules().items():
        if name == "wdsvlm.compat":
            continue
        tree = ast.parse(open(path).read())
        external = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] in GUARDED:
                        external.add(a.asname or a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.split(".")[0] in GUARDED:
                    for a in node.names:
                        if a.name.startswith("_") and not a.name.startswith("__"):
                            found.append(f"{name}: from {node.module} import {a.name}")
                        external.add(a.asname or a.name)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
                continue
            if node.attr.startswith("__"):
                continue
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if node.attr in KNOWN_PRIVATE:  # whatever holds it (a class in a variable, say)
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(root, ast.Name) and root.id in external:
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(root, ast.Call) and getattr(root.func, "id", "") == "super":
                if node.attr not in TRAINER_METHODS:  # those are checked in compat
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "private names of other libraries outside compat.py:\n" + "\n".join(found)


def test_the_first_batch_bridge_is_gone():
    assert "wdsvlm.loader.bridge" not in modules()
    stream = open(os.path.join(PACKAGE, "loader", "stream.py")).read()
    for gone in ("handover", "held_samples", "private_copy", "os.environ.clear"):
        assert gone not in stream, gone
