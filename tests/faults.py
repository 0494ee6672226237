"""A fault-injecting HTTP proxy for the storage tests: it sits between a client and a real
server on 127.0.0.1 and, request by request, answers 503, cuts the connection part-way
through a response body, or stalls, as its settings ask."""

from __future__ import annotations

import random
import socket
import threading
from collections import Counter


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(1 << 20)
    # answer at once: a delayed ACK meets the sender's Nagle wait, 40 ms per response
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
    return chunk


def _read_head(sock: socket.socket, buffer: bytearray) -> bytes | None:
    while b"\r\n\r\n" not in buffer:
        chunk = _recv(sock)
        if not chunk:
            return None
        buffer += chunk
    end = buffer.index(b"\r\n\r\n") + 4
    head = bytes(buffer[:end])
    del buffer[:end]
    return head


def _read_exact(sock: socket.socket, buffer: bytearray, n: int) -> bytes:
    while len(buffer) < n:
        chunk = _recv(sock)
        if not chunk:
            raise ConnectionError("closed mid-body")
        buffer += chunk
    data = bytes(buffer[:n])
    del buffer[:n]
    return data


def _length(head: bytes) -> int:
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


class FaultProxy:
    """``FaultProxy(upstream_port)``: listens on ``self.port``. Per request, with the given
    probabilities: ``error`` answers 503 (S3's ServiceUnavailable), ``cut`` closes the
    connection after half the response body, ``stall`` sends half the body and then nothing.
    ``status`` (when set) answers every request with that status at once, a permanent fault.
    ``requests`` and ``faults`` count what it did; ``served`` the body bytes it relayed whole,
    by request path."""

    def __init__(self, upstream_port: int, seed: int = 0):
        self.upstream = ("127.0.0.1", upstream_port)
        self.error = self.cut = self.stall = 0.0
        self.status: int | None = None
        self.requests = self.faults = 0
        self.served: Counter = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.port = self._server.getsockname()[1]
        self._threads: list[threading.Thread] = []
        self._sockets: list[socket.socket] = []
        self._accept = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)
        self._accept.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def faults_off(self) -> None:
        self.error = self.cut = self.stall = 0.0
        self.status = None

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._accept.join()
        for s in list(self._sockets):
            try:
                s.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        self._server.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets.append(client)
            t = threading.Thread(
                target=self._handle, args=(client,), name="fault-proxy", daemon=True
            )
            self._threads.append(t)
            t.start()

    def _choose(self) -> str:
        with self._lock:
            self.requests += 1
            if self.status is not None:
                self.faults += 1
                return "status"
            x = self._rng.random()
            for name, p in (("error", self.error), ("cut", self.cut), ("stall", self.stall)):
                if x < p:
                    self.faults += 1
                    return name
                x -= p
            return "ok"

    def _handle(self, client: socket.socket) -> None:
        upstream = None
        inbox, outbox = bytearray(), bytearray()
        try:
            while not self._stop.is_set():
                head = _read_head(client, inbox)
                if head is None:
                    return
                body = _read_exact(client, inbox, _length(head))
                fault = self._choose()
                if fault in ("error", "status"):
                    status = 503 if fault == "error" else self.status
                    text = (
                        b"<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>"
                    )
                    if status == 403:
                        text = (
                            b"<Error><Code>AccessDenied</Code><Message>injected</Message></Error>"
                        )
                    client.sendall(
                        b"HTTP/1.1 %d Injected\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: %d\r\n\r\n" % (status, len(text)) + text
                    )
                    continue
                # one upstream connection per request: the server may close after each
                upstream = socket.create_connection(self.upstream)
                upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    upstream.sendall(head + body)
                    outbox.clear()
                    reply = _read_head(upstream, outbox)
                    if reply is None:
                        return
                    n = 0 if head.startswith(b"HEAD ") else _length(reply)
                    payload = _read_exact(upstream, outbox, n)
                finally:
                    upstream.close()
                    upstream = None
                if fault == "ok" or n < 2:
                    client.sendall(reply + payload)
                    path = head.split(b" ", 2)[1].split(b"?", 1)[0].decode()
                    with self._lock:
                        self.served[path] += n
                    continue
                client.sendall(reply + payload[: n // 2])
                if fault == "stall":
                    self._stop.wait()  # hold the connection open, silent, until closed
                return  # "cut": drop the connection part-way through the body
        except OSError:
            return
        finally:
            for s in (client, upstream):
                if s is not None:
                    try:
                        s.close()
                    except OSError:
                        pass
