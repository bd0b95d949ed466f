"""A fault-injecting HTTP reverse proxy on 127.0.0.1, to put in front of a (moto) S3 server.

    with MotoServer() as moto, FaultProxy(moto.endpoint_url) as proxy:
        backend = open_backend(url, BackendOptions(endpoint_url=proxy.endpoint_url))
        proxy.fail_next(3, status=503)     # the next 3 requests get 503 SlowDown
        proxy.fail_for(2.0, status=500)    # every request for 2 s gets 500 InternalError
        proxy.drop_next(1)                 # the next request: connection closed, no answer
        proxy.lose_reply_next(1)           # the next request is applied, its answer is lost
        proxy.go_down()                    # refuse connections (port closed) until go_up()
        proxy.throttle(50e6)               # answers' bodies at most 50 MB/s, all together
        proxy.cut_next(2, is_part, "dropped")  # the next 2 requests ``is_part(method, path)``
                                               # matches: dropped (or "reply-lost")

Faults are checked per request, in this order of precedence: down, cut, drop, lose reply,
fail. A client that resets its connection (killed mid-request) gets no traceback on stderr.
Every request that reaches the proxy is recorded in ``requests`` as ``(method, path_and_query,
outcome)``, where outcome is ``"forwarded"``, ``"failed"``, ``"dropped"`` or ``"reply-lost"``,
so tests can assert what the client really sent (retries, multipart parts).
"""

from __future__ import annotations

import http.client
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from tests.support.lifecycle import StartStop

_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
}

_S3_ERRORS = {
    403: ("AccessDenied", "Access Denied"),
    409: (
        "ConditionalRequestConflict",
        "A conflicting conditional request is in progress; please retry.",
    ),
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}


def s3_error_body(status: int, request_path: str) -> bytes:
    """The XML error document S3 sends with ``status`` (SlowDown for 503, and so on)."""
    code, message = _S3_ERRORS.get(status, ("ServiceUnavailable", "Injected fault."))
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{request_path.split('?', maxsplit=1)[0]}</Resource>"
        "<RequestId>FAULTPROXY</RequestId></Error>"
    ).encode()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    proxy: FaultProxy


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep test output clean

    def _handle(self) -> None:
        proxy = self.server.proxy
        body = self._read_body()
        outcome = proxy._decide(self.command, self.path)
        proxy._record(self.command, self.path, outcome)
        if outcome == "reply-lost":
            self._forward(body, reply=False)
        if outcome in ("dropped", "reply-lost"):
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if outcome == "failed":
            status = proxy._fail_status
            payload = s3_error_body(status, self.path)
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            return
        self._forward(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes, *, reply: bool = True) -> None:
        proxy = self.server.proxy
        upstream = http.client.HTTPConnection(
            proxy._upstream_host, proxy._upstream_port, timeout=60
        )
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers.pop("Expect", None)
            headers["Content-Length"] = str(len(body))
            upstream.request(self.command, self.path, body=body, headers=headers)
            response = upstream.getresponse()
            payload = response.read()
            if not reply:
                return
            self.send_response(response.status, response.reason)
            for name, value in response.getheaders():
                if name.lower() not in _HOP_BY_HOP:
                    self.send_header(name, value)
            # A HEAD answer carries the object's length but no body.
            length = response.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                proxy._send(self.wfile, payload)
        except OSError:
            # The upstream went away mid-request: let the client see a dropped connection.
            self.close_connection = True
        finally:
            upstream.close()


class FaultProxy(StartStop):
    """A threaded reverse proxy to ``upstream_url`` whose faults tests switch at run time."""

    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"FaultProxy needs an http://host:port upstream, got {upstream_url}")
        self._upstream_host = parts.hostname
        self._upstream_port = parts.port
        self._lock = threading.Lock()
        self._fail_count = 0
        self._fail_until = 0.0
        self._fail_status = 503
        self._fail_match: str | None = None
        self._fail_after = 0
        self._drop_count = 0
        self._lose_reply_count = 0
        self._down = False
        self._rate: float | None = None  # bytes/s of answers' bodies, every connection together
        self._next_free = 0.0
        self._rate_lock = threading.Lock()
        self._port: int | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._cut: list[tuple[Callable[[str, str], bool], str, int]] = []
        self.requests: list[tuple[str, str, str]] = []

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        if self._port is None:
            raise RuntimeError("FaultProxy is not started")
        return f"http://127.0.0.1:{self._port}"

    def start(self) -> str:
        self._listen(self._port or 0)
        return self.endpoint_url

    def stop(self) -> None:
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join()

    # -- faults ---------------------------------------------------------------------------

    def fail_next(
        self, count: int, status: int = 503, *, match: str | None = None, after: int = 0
    ) -> None:
        """Answer the next ``count`` requests with ``status`` and an S3 XML error body.

        With ``match``, only requests whose ``"METHOD /path?query"`` contains it count (and
        fail), e.g. ``match="partNumber=2"`` fails the second part of a multipart upload.
        ``after``: the first ``after`` of those requests still go through.
        """
        with self._lock:
            self._fail_count = count
            self._fail_status = status
            self._fail_match = match
            self._fail_after = after

    def fail_for(self, seconds: float, status: int = 503) -> None:
        """Answer every request with ``status`` for the next ``seconds``."""
        with self._lock:
            self._fail_until = time.monotonic() + seconds
            self._fail_status = status

    def drop_next(self, count: int) -> None:
        """Close the connection of the next ``count`` requests without answering."""
        with self._lock:
            self._drop_count = count

    def lose_reply_next(self, count: int) -> None:
        """Forward the next ``count`` requests, then cut the connection instead of answering.

        The store applied the request but the client cannot know: an ambiguous failure.
        """
        with self._lock:
            self._lose_reply_count = count

    def cut_next(self, count: int, match: Callable[[str, str], bool], how: str) -> None:
        """The next ``count`` requests ``match(method, path)`` accepts: ``"dropped"`` (no
        answer) or ``"reply-lost"`` (applied by the store, the answer cut)."""
        with self._lock:
            self._cut.append((match, how, count))

    def go_down(self) -> None:
        """The server is down: the port refuses connections, open connections are cut."""
        with self._lock:
            self._down = True
        self.stop()

    def go_up(self) -> None:
        """Listen again on the same port and forward as before."""
        with self._lock:
            self._down = False
        self.start()

    def throttle(self, bytes_per_second: float | None) -> None:
        """Send answers' bodies (what readers download) at most this fast, every connection
        together, as a remote store's bandwidth would; ``None``: as fast as they come."""
        with self._rate_lock:
            self._rate = bytes_per_second
            self._next_free = time.monotonic()

    def _send(self, out: Any, payload: bytes) -> None:
        piece = 64 * 1024
        view = memoryview(payload)
        for at in range(0, len(view), piece):
            part = view[at : at + piece]
            with self._rate_lock:
                rate = self._rate
                if rate is not None:
                    # Each piece books the line for its own time, after every piece before it.
                    start = max(time.monotonic(), self._next_free)
                    self._next_free = start + len(part) / rate
                    due = self._next_free
            if rate is not None:
                delay = due - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            out.write(part)

    def heal(self) -> None:
        """Clear every pending fault (but not ``go_down``; use ``go_up`` for that)."""
        with self._lock:
            self._fail_count = self._drop_count = self._lose_reply_count = self._fail_after = 0
            self._fail_until = 0.0
            self._fail_match = None
            self._cut.clear()

    def outcomes(self) -> list[str]:
        with self._lock:
            return [outcome for _, _, outcome in self.requests]

    def hits(self) -> int:
        """Requests a fault has hit so far (failed, dropped, or their reply lost)."""
        return sum(1 for outcome in self.outcomes() if outcome != "forwarded")

    def saw(self, match: Callable[[str, str], bool]) -> int:
        """Requests so far that ``match(method, path)`` accepts."""
        with self._lock:
            seen = list(self.requests)
        return sum(1 for method, path, _ in seen if match(method, path))

    # -- internals ------------------------------------------------------------------------

    def _listen(self, port: int) -> None:
        server = _Server(("127.0.0.1", port), _Handler)
        server.proxy = self
        report = server.handle_error

        def quiet(request: object, client_address: object) -> None:
            # A client killed mid-request (the point of the chaos tests) resets its
            # connection: not worth a traceback on stderr. Anything else still gets one.
            if not isinstance(sys.exc_info()[1], ConnectionError):
                report(request, client_address)  # type: ignore[arg-type]

        server.handle_error = quiet  # type: ignore[method-assign]
        self._port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="faultproxy", daemon=True)
        self._thread.start()

    def _decide(self, method: str, path: str) -> str:
        with self._lock:
            if self._down:
                return "dropped"
            for i, (match, how, count) in enumerate(self._cut):
                if count > 0 and match(method, path):
                    self._cut[i] = (match, how, count - 1)
                    return how
            if self._drop_count > 0:
                self._drop_count -= 1
                return "dropped"
            if self._lose_reply_count > 0:
                self._lose_reply_count -= 1
                return "reply-lost"
            if self._fail_count > 0 and (
                self._fail_match is None or self._fail_match in f"{method} {path}"
            ):
                if self._fail_after > 0:
                    self._fail_after -= 1
                    return "forwarded"
                self._fail_count -= 1
                return "failed"
            if time.monotonic() < self._fail_until:
                return "failed"
            return "forwarded"

    def _record(self, method: str, path: str, outcome: str) -> None:
        with self._lock:
            self.requests.append((method, path, outcome))


class GateProxy(FaultProxy):
    """A FaultProxy that holds chunk requests (``…/chunks/…``) while its gate is shut, so a
    job can be caught mid-transfer without guessing how long it takes.

        with GateProxy(moto.endpoint_url, methods=("PUT",)) as proxy:
            proxy.gate.clear()                  # the next chunk upload waits ...
            ...                                 # ... until proxy.held > 0: caught mid-upload
            proxy.gate.set()                    # and goes on

    ``methods``: the requests the gate holds (uploads and downloads by default). A held
    request waits at most ``hold_timeout`` seconds, a hang guard; ``stop()`` opens the gate
    first, so no request is left waiting on a stopped proxy.
    """

    def __init__(
        self,
        upstream_url: str,
        *,
        methods: tuple[str, ...] = ("GET", "PUT"),
        hold_timeout: float = 120.0,
    ) -> None:
        super().__init__(upstream_url)
        self.methods = frozenset(methods)
        self.hold_timeout = hold_timeout
        self.gate = threading.Event()
        self.gate.set()
        self.held = 0

    def stop(self) -> None:
        self.gate.set()
        super().stop()

    def _decide(self, method: str, path: str) -> str:
        if method in self.methods and "/chunks/" in path and not self.gate.is_set():
            with self._lock:
                self.held += 1
            self.gate.wait(self.hold_timeout)
        return super()._decide(method, path)
