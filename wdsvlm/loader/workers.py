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

Until the fork server has done its imports (about 1.5 s, once per process; ``spawn``'s workers
import at every start) new workers cannot start, and the training process would wait with
nothing to do: ``workers_start_slowly`` says when that is so, and the Loader then makes the
first batch itself meanwhile (``bridge.py``).
"""

from __future__ import annotations

import ast
import logging
import multiprocessing
import os
import signal
import sys
import threading
from typing import Any

from ..pipeline.memory import libc

log = logging.getLogger("wdsvlm.workers")

CONTEXTS = ("forkserver", "spawn", "fork")

# Imported once in the fork server, so that each worker forked from it starts with them.
_PRELOAD = ("wdsvlm.loader.stream",)

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>

_server_ready = threading.Event()  # set once this process's fork server has started a process
_server_watch: list[threading.Thread] = []  # the thread that waits for it, once per process


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

        server = forkserver._forkserver  # the process-wide server; its list is private
        current = list(getattr(server, "_preload_modules", ["__main__"]))
        wanted = [m for m in (*_PRELOAD, *preload) if m and m not in current]
        if wanted:
            context.set_forkserver_preload(current + wanted)
        forkserver.ensure_running()  # returns at once; the server imports in the background
        watch_server(context)
    return context


def watch_server(context: Any) -> None:
    """Start (once per process) a thread that starts a process doing nothing through the fork
    server: ``start()`` returns once the server has done its imports and forked it, and then
    ``workers_start_slowly`` is false. The thread ends with that process."""
    if _server_watch:
        return

    def probe() -> None:
        process = context.Process(target=os.getpid, daemon=True, name="wdsvlm-probe")
        try:
            process.start()
            process.join()
        except Exception as e:  # noqa: BLE001 - no server: the workers' own start will say why
            log.debug("the fork server did not start a process: %s", e)
            return
        _server_ready.set()

    thread = threading.Thread(target=probe, daemon=True, name="wdsvlm-fork-server-watch")
    _server_watch.append(thread)
    thread.start()


def workers_start_slowly(context: Any) -> bool:
    """Whether DataLoader workers started now with ``context`` take seconds before they can
    work: ``spawn``'s each import torch and the pipeline; the fork server's wait until it has
    done its imports (``watch_server``). ``fork``'s start at once."""
    method = context.get_start_method()
    if method == "forkserver":
        return not _server_ready.is_set()
    return method == "spawn"


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

    server = forkserver._forkserver  # the worker's view of the server it came from; private
    trainer = multiprocessing.parent_process()  # the process that asked for this worker
    if trainer is None or trainer.pid == os.getppid() or server.get_inherited_fds() is None:
        return  # its parent is the training process (spawn, fork), or no fork server's child
    if not die_with_parent():
        log.debug("worker %d: no parent-death signal on %s", worker_id, sys.platform)
    # after the signal is asked for: the server cannot end before, while this copy is open
    alive = server._forkserver_alive_fd
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None  # a server this worker would start is its own


def die_with_parent() -> bool:
    """Have the kernel SIGKILL this process when its parent ends (Linux); whether it will."""
    c = libc()
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
    frame, top = sys._getframe(1), None
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
