"""How the Loader's DataLoader workers start: from a process that holds no threads.

A training process is threaded whatever wdsvlm does: gloo and NCCL keep C++ threads, torch's
C++ threads release Python-owned tensors, tokenizers and fsspec keep their own. When such a
thread enters Python (``PyGILState_Ensure``) it takes the interpreter's thread-list lock
without holding the GIL; a worker forked at that moment inherits the lock held and waits for
it forever in ``PyOS_AfterFork_Child``, before it runs a line of Python (CPython gh-112275,
seen on 3.11.7). The DataLoader sees that worker alive, so the job hangs silently.

So workers start from a ``forkserver`` by default: a process started once (fork + exec, which
is safe from a threaded process) that imports the pipeline's modules, runs no thread, and
forks each worker. ``"spawn"`` works too (each worker imports everything itself);
``"fork"`` is allowed for those who know their process holds no thread at worker start.

A fork server's workers must also end with the training process, which is not their parent.
multiprocessing hands every process the fork server starts the write end of the server's
"alive" pipe (so that such a process could start more through the same server), and the
server exits only once every copy is closed; torch's watchdog in each worker checks that its
parent, the fork server, lives. So a training process killed outright (SIGKILL, the OOM
killer) left its fork server and workers running for good, each keeping the other alive.
``exit_with_training_process`` breaks that circle in each worker as it starts.

The fork server is started when the first Loader with workers is built, so that its imports
(about 1.5 s, once per process) overlap the rest of the set-up. It keeps the environment it
started with; ``adopt_environ`` gives a worker what the training process set since.
"""

from __future__ import annotations

import ast
import inspect
import logging
import multiprocessing
import os
import signal
import sys
from typing import Any

from .. import compat

log = logging.getLogger("wdsvlm.workers")

CONTEXTS = ("forkserver", "spawn", "fork")

# Imported once in the fork server, so that each worker forked from it starts with them.
_PRELOAD = ("wdsvlm.loader.stream",)

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


if "forkserver" in multiprocessing.get_all_start_methods():
    compat.check_forkserver()  # the fork server's private names: fail at import, not in a worker


def default_context() -> str:
    """``forkserver`` where the platform has it (Linux, macOS), else ``spawn``."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def check_context(name: str | None) -> str:
    """The start method to use: ``name`` checked, or the default."""
    if name is None:
        return default_context()
    if name not in CONTEXTS or name not in multiprocessing.get_all_start_methods():
        available = [c for c in CONTEXTS if c in multiprocessing.get_all_start_methods()]
        raise ValueError(
            f"multiprocessing_context {name!r} is not one of {available} on {sys.platform}"
        )
    return name


def worker_context(name: str, preload: tuple[str, ...] = ()) -> Any:
    """The multiprocessing context DataLoader workers start with. For ``forkserver``, the
    pipeline's modules (and ``preload``: e.g. the tokenizer's module) are added to what the
    fork server imports, so that a worker does not import torch itself, and the server is
    started now, once per process: its imports then overlap the Loader's set-up instead of
    delaying the first batch."""
    context = multiprocessing.get_context(name)
    if name == "forkserver":
        from multiprocessing import forkserver

        current = compat.forkserver_preload()
        wanted = [m for m in (*_PRELOAD, *preload) if m and m not in current]
        if wanted:
            context.set_forkserver_preload(current + wanted)
        forkserver.ensure_running()  # returns at once; the server imports in the background
    return context


def adopt_environ(environ: dict[str, str]) -> None:
    """In a worker: set the variables whose values differ in ``environ`` (the training
    process's environment when it sent the worker its job). A fork server keeps the
    environment it started with, so its workers would lack what the training process set
    since (credentials, say), which a forked or spawned worker inherits. Only those are set:
    what the worker's own environment holds besides stays as it is."""
    for name, value in environ.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def exit_with_training_process(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: a worker forked by a fork server ends when the training
    process does, however it ends. The worker closes its copy of the fork server's "alive"
    pipe, so that the server sees the pipe's end, and exits, as soon as the training process
    (the only other holder) is gone; and on Linux it asks the kernel for SIGKILL when its
    parent, the server, ends. Elsewhere torch's watchdog sees the parent change within 5 s.

    The server itself is not given a parent-death signal: that signal follows the *thread*
    that started the server (whichever built the first Loader, maybe one that ends soon),
    not the training process. A worker started by ``spawn`` or ``fork`` is a child of the
    training process, which torch's watchdog already follows: nothing to do."""
    from multiprocessing import forkserver

    trainer = multiprocessing.parent_process()  # the process that asked for this worker
    if trainer is None or trainer.pid == os.getppid() or forkserver.get_inherited_fds() is None:
        return  # its parent is the training process (spawn, fork), or no fork server's child
    if not die_with_parent():
        log.debug("worker %d: no parent-death signal on %s", worker_id, sys.platform)
    # after the signal is asked for: the server cannot end before, while this copy is open
    compat.close_forkserver_alive_fd()


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent ends (Linux); whether it will."""
    c = compat.libc()
    try:
        return c is not None and c.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except AttributeError:  # a C library without prctl
        return False


def check_main_guarded(name: str) -> None:
    """Refuse, with the fix, to start ``spawn``/``forkserver`` workers from the top-level code
    of a script: each worker imports the main module again, which would run that code (the
    training loop, ``init_process_group``) once more in the worker instead of the pipeline.
    Code under ``if __name__ == "__main__":`` or in functions called from there is fine."""
    if name == "fork":
        return
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or not path.endswith(".py"):
        return  # python -c, a notebook, an interpreter: workers import no main module
    path = os.path.abspath(path)
    here = inspect.currentframe()
    frame, top = here.f_back if here is not None else None, None
    while frame is not None:  # the script's own top-level frame, where this call started
        code = frame.f_code
        if (
            frame.f_globals is main.__dict__
            and code.co_name == "<module>"
            and os.path.abspath(code.co_filename) == path  # not a debugger's frame (pdb)
        ):
            top = frame
        frame = frame.f_back
    if top is None or _guarded(path, top.f_lineno):
        return
    raise RuntimeError(
        f"{path}, line {top.f_lineno}: DataLoader workers start with "
        f"multiprocessing_context={name!r}, so each imports this script again, and this line "
        'is not under `if __name__ == "__main__":`: the workers would run it too. Put the '
        "script's top-level code in a function called under that guard (as torchrun scripts "
        'do), or pass multiprocessing_context="fork" if no thread runs in this process '
        "when workers start (see docs/training.md: how workers start)."
    )


def _guarded(path: str, line: int) -> bool:
    """Whether ``line`` of the script at ``path`` lies in the body of an
    ``if __name__ == "__main__":`` (outside any function or class)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return True  # cannot tell: let multiprocessing's own check speak
    nodes = list(tree.body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and _tests_main(node.test) and node.body:
            if node.body[0].lineno <= line <= (node.body[-1].end_lineno or line):
                return True
        nodes.extend(ast.iter_child_nodes(node))
    return False


def _tests_main(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round), or an ``and`` that contains it."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return any(_tests_main(value) for value in test.values)
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    strings = [s.value for s in sides if isinstance(s, ast.Constant)]
    return isinstance(test.ops[0], ast.Eq) and names == ["__name__"] and strings == ["__main__"]
