"""A local object store for tests and benches: static files over HTTP on 127.0.0.1 with byte
ranges, as object stores serve them, each ranged answer a set time late (a store's latency),
counting what it is asked for and what it sends."""

from __future__ import annotations

import contextlib
import http.server
import os
import threading
import time
from collections.abc import Iterator
from typing import Any


class RangeServer(http.server.ThreadingHTTPServer):
    """Static files of ``folder`` with byte ranges (``Range: bytes=a-b``), each ranged answer
    ``delay`` seconds late; ``requests`` counts the ranged requests, ``most_at_once`` is the
    most of them it has had in flight at once, ``gets`` and ``heads`` count every GET and HEAD
    (a missing file's too), ``asked_by_name`` both per file name, ``served`` the body bytes the
    GETs sent, ``served_by_name`` those bytes per file name, and ``sent_ranges`` each GET's
    ``(file name, first byte, byte past the last)``."""

    def __init__(self, folder: str, delay: float = 0.0):
        self.folder, self.delay = folder, delay
        self.requests = self.most_at_once = self._at_once = 0
        self.gets = self.heads = self.served = 0
        self.served_by_name: dict[str, int] = {}
        self.sent_ranges: list[tuple[str, int, int]] = []
        self.asked_by_name: dict[str, int] = {}
        self._lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Ranges)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"

    def count(self, step: int) -> None:
        with self._lock:
            self._at_once += step
            self.requests += step > 0
            self.most_at_once = max(self.most_at_once, self._at_once)

    def sent(self, name: str, start: int, size: int) -> None:
        with self._lock:
            self.sent_ranges.append((name, start, start + size))
            self.served += size
            self.served_by_name[name] = self.served_by_name.get(name, 0) + size

    def asked(self, method: str, name: str) -> None:
        with self._lock:
            self.asked_by_name[name] = self.asked_by_name.get(name, 0) + 1
            if method == "GET":
                self.gets += 1
            else:
                self.heads += 1


class _Ranges(http.server.SimpleHTTPRequestHandler):
    def __init__(self, request, address, server: RangeServer):
        super().__init__(request, address, server, directory=server.folder)

    def do_HEAD(self):
        self.server.asked("HEAD", os.path.basename(self.translate_path(self.path)))
        super().do_HEAD()

    def do_GET(self):
        path = self.translate_path(self.path)
        self.server.asked("GET", os.path.basename(path))
        if not os.path.isfile(path):
            return self.send_error(404)
        size = os.path.getsize(path)
        a, b, status = 0, size - 1, 200
        wanted = self.headers.get("Range")
        if wanted:
            self.server.count(1)
            time.sleep(self.server.delay)
            self.server.count(-1)
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            a, b, status = int(first), min(int(last) if last else b, b), 206
        with open(path, "rb") as f:
            f.seek(a)
            data = f.read(max(0, b + 1 - a))
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.server.sent(os.path.basename(path), a, len(data))
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def range_server(folder: str, delay: float = 0.0) -> contextlib.AbstractContextManager:
    """A ``RangeServer`` of ``folder`` on 127.0.0.1, in a thread, for the ``with`` block."""
    return serving(RangeServer(folder, delay))


@contextlib.contextmanager
def serving(server: Any) -> Iterator[Any]:
    """``server`` (a ``socketserver`` server) answering from a thread for the ``with`` block,
    then shut down and closed."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()
