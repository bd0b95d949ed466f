"""Loopback servers speaking the AWS IMDSv2, GCP metadata and Azure Scheduled Events protocols.

Each binds 127.0.0.1 on a free port, runs in a thread, and is driven by the test: announce a
reclaim, expire tokens, change a value, or misbehave — ``mode`` is one of

- ``"ok"``: speak the protocol;
- ``"drop"``: close the connection without answering (the service is down mid-flight);
- ``"slow"``: sleep ``slow_s`` before answering (beyond the client's timeout);
- ``"garbage"``: answer 200 with bytes that are not the protocol;
- ``"error"``: answer 500;

and ``flap = True`` answers each request, at random (seeded), either "ok" or ``flap_mode``.
Every request is recorded in ``requests`` (method, path with query, headers, body, monotonic time).
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tests.support.lifecycle import StartStop

LOOPBACK = "127.0.0.1"


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        owner = self.server.owner
        rec = Recorded(
            method,
            self.path,
            {k.lower(): v for k, v in self.headers.items()},
            body,
            time.monotonic(),
        )
        with owner.lock:
            owner.requests.append(rec)
            mode = owner.mode
            if owner.flap and owner._flap_rng.random() < 0.5:
                mode = owner.flap_mode
        if mode == "drop":
            self.close_connection = True
            self.connection.close()
            return
        if mode == "slow":
            owner.stopping.wait(owner.slow_s)
        if mode == "garbage":
            self._send(200, b"\x00\xffnot-a-protocol<html>{{{", {"Metadata-Flavor": "Google"})
            return
        if mode == "error":
            self._send(500, b"internal error", {})
            return
        status, payload, headers = owner.respond(rec)
        self._send(status, payload, headers)

    def _send(self, status: int, payload: bytes, headers: dict[str, str]) -> None:
        try:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            pass  # the client gave up (a timeout test); nothing to tell it

    def do_GET(self) -> None:
        self._handle("GET")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_POST(self) -> None:
        self._handle("POST")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    owner: MetadataServer


class MetadataServer(StartStop):
    """Base: a threaded loopback HTTP server with misbehaviour knobs."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.requests: list[Recorded] = []
        self.mode = "ok"
        self.slow_s = 5.0
        self.flap = False
        self.flap_mode = "garbage"
        self._flap_rng = random.Random(1234)  # seeded: a flapping run is reproducible
        self.stopping = threading.Event()
        self._httpd = _Server((LOOPBACK, 0), _Handler)
        self._httpd.owner = self
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self._httpd.server_port}"

    def start(self) -> MetadataServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def requests_to(self, path_prefix: str, method: str | None = None) -> list[Recorded]:
        with self.lock:
            return [
                r
                for r in self.requests
                if r.path.startswith(path_prefix) and (method is None or r.method == method)
            ]

    def respond(self, rec: Recorded) -> tuple[int, bytes, dict[str, str]]:
        raise NotImplementedError

    def reclaim(self, at: float | None = None) -> float | None:
        """Announce that the platform takes the VM back at ``at`` (default: its usual notice),
        the provider's way; the deadline the notice carries, ``None`` where the protocol
        carries none (GCP: the daemon's ``preempt_notice`` applies)."""
        raise NotImplementedError


def iso_z(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class AwsImdsServer(MetadataServer):
    """IMDSv2: token required on every GET (HttpTokens=required)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.issued: list[str] = []  # every token handed out, in order (expired ones too)
        self.instance_action: dict[str, str] | None = None
        self.rebalance: dict[str, str] | None = None

    def announce_reclaim(self, action: str = "terminate", at: float | None = None) -> float:
        at = time.time() + 120 if at is None else at
        with self.lock:
            self.instance_action = {"action": action, "time": iso_z(at)}
        return float(int(at))

    def reclaim(self, at: float | None = None) -> float:
        return self.announce_reclaim("terminate", at)

    def recommend_rebalance(self, at: float | None = None) -> None:
        with self.lock:
            self.rebalance = {"noticeTime": iso_z(time.time() if at is None else at)}

    def expire_tokens(self) -> None:
        with self.lock:
            self.tokens.clear()

    def respond(self, rec: Recorded) -> tuple[int, bytes, dict[str, str]]:
        path = rec.path
        with self.lock:
            if rec.method == "PUT" and path == "/latest/api/token":
                if "x-forwarded-for" in rec.headers:
                    return 403, b"Forbidden", {}
                try:
                    ttl = int(rec.headers.get("x-aws-ec2-metadata-token-ttl-seconds", ""))
                except ValueError:
                    return 400, b"Bad Request", {}
                if not 1 <= ttl <= 21600:
                    return 400, b"Bad Request", {}
                token = "AQAE" + uuid.uuid4().hex
                self.tokens[token] = time.monotonic() + ttl
                self.issued.append(token)
                return 200, token.encode(), {"X-Aws-Ec2-Metadata-Token-Ttl-Seconds": str(ttl)}
            if rec.method != "GET":
                return 405, b"", {}
            token = rec.headers.get("x-aws-ec2-metadata-token", "")
            if self.tokens.get(token, 0.0) < time.monotonic():
                return 401, b"Unauthorized", {}
            if path == "/latest/meta-data/spot/instance-action":
                if self.instance_action is None:
                    return 404, b"Not Found", {}
                return 200, json.dumps(self.instance_action).encode(), {}
            if path == "/latest/meta-data/events/recommendations/rebalance":
                if self.rebalance is None:
                    return 404, b"Not Found", {}
                return 200, json.dumps(self.rebalance).encode(), {}
            return 404, b"Not Found", {}


class GcpMetadataServer(MetadataServer):
    """GCE metadata with ETags and ``wait_for_change`` long-polling."""

    def __init__(self) -> None:
        super().__init__()
        self.send_flavor = True
        self.values: dict[str, str] = {
            "preempted": "FALSE",
            "maintenance-event": "NONE",
            "id": "4520031799277581759",
        }
        self.etags: dict[str, str] = {k: uuid.uuid4().hex[:16] for k in self.values}
        self.changed = threading.Condition(self.lock)

    def set(self, key: str, value: str) -> None:
        with self.changed:
            self.values[key] = value
            self.etags[key] = uuid.uuid4().hex[:16]
            self.changed.notify_all()

    def preempt(self) -> None:
        self.set("preempted", "TRUE")

    def reclaim(self, at: float | None = None) -> None:
        self.preempt()  # preemption says no time: the VM has about 30 s

    def respond(self, rec: Recorded) -> tuple[int, bytes, dict[str, str]]:
        flavor = {"Metadata-Flavor": "Google"} if self.send_flavor else {}
        if rec.headers.get("metadata-flavor") != "Google":
            return 403, b"Missing Metadata-Flavor:Google header.", flavor
        parts = urlsplit(rec.path)
        prefix = "/computeMetadata/v1/instance/"
        if not parts.path.startswith(prefix) or rec.method != "GET":
            return 404, b"Not Found", flavor
        key = parts.path[len(prefix) :]
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        with self.changed:
            if key not in self.values:
                return 404, b"Not Found", flavor
            if query.get("wait_for_change") == "true":
                timeout = float(query.get("timeout_sec", "60"))
                last = query.get("last_etag", "NONE")
                end = time.monotonic() + timeout
                while self.etags[key] == last and not self.stopping.is_set():
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self.changed.wait(min(left, 0.2))
            return 200, self.values[key].encode(), {**flavor, "ETag": self.etags[key]}


class AzureEventsServer(MetadataServer):
    """Scheduled Events: GET the document, POST StartRequests to approve."""

    def __init__(self, vm_name: str = "gpu-node-a") -> None:
        super().__init__()
        self.vm_name = vm_name
        self.incarnation = 1
        self.events: list[dict[str, Any]] = []
        self.approvals: list[tuple[str, float]] = []  # (event id, monotonic time)

    def schedule(
        self,
        event_type: str = "Preempt",
        *,
        not_before: float | None = None,
        resources: list[str] | None = None,
        event_id: str | None = None,
    ) -> str:
        eid = event_id or str(uuid.uuid4()).upper()
        nb = time.time() + 30 if not_before is None else not_before
        with self.lock:
            self.events.append(
                {
                    "EventId": eid,
                    "EventStatus": "Scheduled",
                    "EventType": event_type,
                    "ResourceType": "VirtualMachine",
                    "Resources": resources if resources is not None else [self.vm_name],
                    "NotBefore": format_datetime(datetime.fromtimestamp(nb, UTC), usegmt=True),
                    "Description": "test event",
                    "EventSource": "Platform",
                    "DurationInSeconds": -1,
                }
            )
            self.incarnation += 1
        return eid

    def reclaim(self, at: float | None = None) -> float:
        nb = time.time() + 30 if at is None else at
        self.schedule("Preempt", not_before=nb)
        return float(int(nb))  # NotBefore is written to the second

    def respond(self, rec: Recorded) -> tuple[int, bytes, dict[str, str]]:
        if rec.headers.get("metadata") != "true":
            return 400, b'{"error": "Bad request. Required metadata header not specified"}', {}
        parts = urlsplit(rec.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        if "api-version" not in query:
            return 400, b'{"error": "Bad request. api-version was not specified"}', {}
        with self.lock:
            if parts.path == "/metadata/scheduledevents":
                if rec.method == "POST":
                    try:
                        doc = json.loads(rec.body)
                        ids = [r["EventId"] for r in doc["StartRequests"]]
                    except (ValueError, KeyError, TypeError):
                        return 400, b'{"error": "Bad request"}', {}
                    for eid in ids:
                        self.approvals.append((eid, time.monotonic()))
                    return 200, b"", {}
                doc = {"DocumentIncarnation": self.incarnation, "Events": self.events}
                return 200, json.dumps(doc).encode(), {"Content-Type": "application/json"}
            if parts.path == "/metadata/instance/compute/name":
                return 200, self.vm_name.encode(), {}
            if parts.path == "/metadata/instance":
                doc = {"compute": {"name": self.vm_name, "azEnvironment": "AzurePublicCloud"}}
                return 200, json.dumps(doc).encode(), {}
            return 404, b"Not Found", {}


SERVERS: dict[str, type[MetadataServer]] = {
    "aws": AwsImdsServer,
    "gcp": GcpMetadataServer,
    "azure": AzureEventsServer,
}


def dead_url() -> str:
    """An http://127.0.0.1 URL where nothing listens (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
