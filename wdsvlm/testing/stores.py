"""A local object store for tests and benches: static files over HTTP on 127.0.0.1 with byte
ranges, as object stores serve them, each ranged answer a set time late (a store's latency),
counting what it is asked for and what it sends; and throttling as stores do above a request
rate (``Throttle``), in the range server or in a proxy in front of another server (moto)."""

from __future__ import annotations

import collections
import contextlib
import http.client
import http.server
import os
import threading
import time
from collections.abc import Iterator
from typing import Any


class Throttle:
    """Admits at most ``per_second`` requests in any sliding second; past it, answers as
    ``style`` says: ``"s3"``: ``503 Slow Down`` with S3's ``SlowDown`` error body, ``"hub"``:
    ``429 Too Many Requests`` with ``Retry-After: retry_after`` (seconds). ``answers`` holds
    each request's ``(time.monotonic(), admitted)``; ``throttled`` counts those refused."""

    def __init__(self, per_second: float, style: str = "s3", retry_after: int = 1):
        if style not in ("s3", "hub"):
            raise ValueError(f"style must be 's3' or 'hub', not {style!r}")
        self.per_second, self.style, self.retry_after = per_second, style, retry_after
        self.throttled = 0
        self.answers: list[tuple[float, bool]] = []
        self._admitted: collections.deque[float] = collections.deque()
        self._lock = threading.Lock()

    def admit(self) -> bool:
        with self._lock:
            now = time.monotonic()
            while self._admitted and now - self._admitted[0] >= 1.0:
                self._admitted.popleft()
            admitted = len(self._admitted) < self.per_second
            if admitted:
                self._admitted.append(now)
            else:
                self.throttled += 1
            self.answers.append((now, admitted))
            return admitted

    def refuse(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        """Send the throttling answer on ``handler``."""
        if self.style == "hub":
            status, reason, body = 429, "Too Many Requests", b"rate limit reached"
            headers = {"Retry-After": str(self.retry_after), "Content-Type": "text/plain"}
        else:
            status, reason = 503, "Slow Down"
            body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate."
            body += b"</Message></Error>"
            headers = {"Content-Type": "application/xml"}
        handler.send_response(status, reason)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)


class RangeServer(http.server.ThreadingHTTPServer):
    """Static files of ``folder`` with byte ranges (``Range: bytes=a-b``), each ranged answer
    ``delay`` seconds late; ``requests`` counts the ranged requests, ``most_at_once`` is the
    most of them it has had in flight at once, ``gets`` and ``heads`` count every GET and HEAD
    (a missing file's too), ``asked_by_name`` both per file name, ``served`` the body bytes the
    GETs sent, ``served_by_name`` those bytes per file name, and ``sent_ranges`` each GET's
    ``(file name, first byte, byte past the last)``. With a ``throttle``, the requests past
    its rate get its throttling answer instead."""

    def __init__(self, folder: str, delay: float = 0.0, throttle: Throttle | None = None):
        self.folder, self.delay, self.throttle = folder, delay, throttle
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
        if self.server.throttle is not None and not self.server.throttle.admit():
            return self.server.throttle.refuse(self)
        super().do_HEAD()

    def do_GET(self):
        path = self.translate_path(self.path)
        self.server.asked("GET", os.path.basename(path))
        if self.server.throttle is not None and not self.server.throttle.admit():
            return self.server.throttle.refuse(self)
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


def range_server(
    folder: str, delay: float = 0.0, throttle: Throttle | None = None
) -> contextlib.AbstractContextManager:
    """A ``RangeServer`` of ``folder`` on 127.0.0.1, in a thread, for the ``with`` block."""
    return serving(RangeServer(folder, delay, throttle))


class ThrottlingProxy(http.server.ThreadingHTTPServer):
    """A proxy on 127.0.0.1 in front of the HTTP server at ``upstream`` (``host:port``, e.g. a
    moto S3 server) that relays every request, except those past ``throttle``'s rate: they get
    its throttling answer. ``endpoint`` is its URL."""

    def __init__(self, upstream: str, throttle: Throttle):
        self.upstream, self.throttle = upstream, throttle
        super().__init__(("127.0.0.1", 0), _Relay)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class _Relay(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _relay(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        if not self.server.throttle.admit():
            return self.server.throttle.refuse(self)
        upstream = http.client.HTTPConnection(self.server.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
            upstream.request(self.command, self.path, body=body, headers=headers)
            answer = upstream.getresponse()
            data = answer.read()
            self.send_response(answer.status, answer.reason)
            length = answer.getheader("Content-Length", "0") if self.command == "HEAD" else None
            for name, value in answer.getheaders():
                if name.lower() not in ("connection", "transfer-encoding", "content-length"):
                    self.send_header(name, value)
            self.send_header("Content-Length", length or str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        finally:
            upstream.close()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

    def log_message(self, *args):
        pass


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
