"""Prometheus metrics: a small thread-safe registry and a text-exposition HTTP endpoint.

The service records into ``METRICS``; ``start_metrics_server`` (off by default, enabled by
the daemon's config) serves ``GET /metrics`` in the Prometheus text format 0.0.4 from a
background thread. No client library needed: the format is a few lines of text.

Exposed series:

- ``gpusnap_jobs_total{kind,outcome}`` counter
- ``gpusnap_job_duration_seconds{kind,outcome}`` histogram
- ``gpusnap_bytes_uploaded_total{kind}`` / ``gpusnap_bytes_total{kind}`` counters: bytes
  actually sent to the store, and the logical size of what the jobs covered
- ``gpusnap_last_checkpoint_timestamp_seconds{workload}`` and
  ``gpusnap_last_checkpoint_age_seconds{workload}`` gauges: the last good checkpoint
- the background store check (``daemon/node/storecheck.py``), once one has run:
  ``gpusnap_store_missing_chunks`` and ``gpusnap_store_damaged_checkpoints`` gauges (what the
  last check found), ``gpusnap_store_last_check_timestamp_seconds`` and
  ``gpusnap_store_last_check_duration_seconds`` gauges; ``gpusnap_store_check_failures_total``
  counter (checks that could not run: the store unreachable)
- ``gpusnap_bytes_fetched_total{kind}`` / ``gpusnap_bytes_cached_total{kind}`` counters: chunk
  object bytes a restore or a standby's prefetch (``kind``) read from the store, and those it
  read from the node's chunk cache instead
- ``gpusnap_warm_fraction{workload}`` gauge: how much of the workload's latest checkpoint
  (of what a restore of it would fetch) the node's chunk cache holds, on a prefetching standby
"""

from __future__ import annotations

import bisect
import logging
import math
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Job durations span a small leave-running checkpoint (seconds) to a 140 GB upload (an hour).
DURATION_BUCKETS: tuple[float, ...] = (1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels, extra: Labels = ()) -> str:
    pairs = labels + extra
    if not pairs:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in pairs) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)  # per bucket, not cumulative
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.count += 1
        self.sum += value


# The store check's gauges, in StoreCheckFigures' order (name, help).
_STORE_CHECK_GAUGES = (
    (
        "gpusnap_store_missing_chunks",
        "Chunks named by the store's checkpoints that the last store check did not find.",
    ),
    (
        "gpusnap_store_damaged_checkpoints",
        "Checkpoints naming a chunk the last store check did not find.",
    ),
    (
        "gpusnap_store_last_check_timestamp_seconds",
        "When the last store check that ran started (unix epoch).",
    ),
    ("gpusnap_store_last_check_duration_seconds", "How long the last store check took."),
)


@dataclass(frozen=True)
class StoreCheckFigures:
    """What the metrics say of the last store check."""

    checked_at: float  # when it started (epoch seconds)
    seconds: float
    chunks_missing: int
    damaged: int  # checkpoints naming a missing chunk


class MetricsRegistry:
    """Everything gpusnapd exports; every method is safe to call from any thread."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._jobs: dict[Labels, int] = {}
        self._durations: dict[Labels, _Histogram] = {}
        self._bytes_uploaded: dict[Labels, int] = {}
        self._bytes_total: dict[Labels, int] = {}
        self._last_checkpoint: dict[str, float] = {}
        self._store_check: StoreCheckFigures | None = None
        self._store_check_failures = 0
        self._bytes_fetched: dict[Labels, int] = {}
        self._bytes_cached: dict[Labels, int] = {}
        self._warm: dict[str, float] = {}

    def observe_job(
        self,
        kind: str,
        outcome: str,
        seconds: float,
        bytes_uploaded: int = 0,
        bytes_total: int = 0,
    ) -> None:
        """Record a finished job: ``outcome`` is its end state (succeeded, failed, ...)."""
        key: Labels = (("kind", kind), ("outcome", outcome))
        kind_key: Labels = (("kind", kind),)
        with self._lock:
            self._jobs[key] = self._jobs.get(key, 0) + 1
            self._durations.setdefault(key, _Histogram(DURATION_BUCKETS)).observe(max(0.0, seconds))
            self._bytes_uploaded[kind_key] = self._bytes_uploaded.get(kind_key, 0) + max(
                0, bytes_uploaded
            )
            self._bytes_total[kind_key] = self._bytes_total.get(kind_key, 0) + max(0, bytes_total)

    def set_last_checkpoint(self, workload: str, epoch: float) -> None:
        """The commit time of ``workload``'s newest good checkpoint (never moves backwards)."""
        with self._lock:
            self._last_checkpoint[workload] = max(epoch, self._last_checkpoint.get(workload, epoch))

    def set_store_check(self, figures: StoreCheckFigures) -> None:
        """What the last store check found (replaces the one before)."""
        with self._lock:
            self._store_check = figures

    def store_check_failed(self) -> None:
        """A store check could not run (the store unreachable, say)."""
        with self._lock:
            self._store_check_failures += 1

    def observe_fetch(self, kind: str, *, fetched: int, cached: int) -> None:
        """Count what a pull of ``kind`` (restore, prefetch) read from the store (``fetched``)
        and from the node's chunk cache (``cached``), in chunk object bytes."""
        key: Labels = (("kind", kind),)
        with self._lock:
            self._bytes_fetched[key] = self._bytes_fetched.get(key, 0) + max(0, fetched)
            self._bytes_cached[key] = self._bytes_cached.get(key, 0) + max(0, cached)

    def set_warm_fraction(self, workload: str, fraction: float) -> None:
        """How much of ``workload``'s latest checkpoint the node's cache holds (0..1)."""
        with self._lock:
            self._warm[workload] = min(1.0, max(0.0, fraction))

    def render(self) -> str:
        """The whole registry in the Prometheus text format."""
        with self._lock:
            now = self._clock()
            out: list[str] = []
            self._counter(
                out, "gpusnap_jobs_total", "Jobs finished, by kind and outcome.", self._jobs
            )
            name = "gpusnap_job_duration_seconds"
            out.append(f"# HELP {name} Time from job start to its end state.")
            out.append(f"# TYPE {name} histogram")
            for labels, hist in sorted(self._durations.items()):
                cumulative = 0
                for bound, n in zip(hist.buckets, hist.counts, strict=True):
                    cumulative += n
                    le = (("le", _number(bound)),)
                    out.append(f"{name}_bucket{_labels(labels, le)} {cumulative}")
                out.append(f"{name}_bucket{_labels(labels, (('le', '+Inf'),))} {hist.count}")
                out.append(f"{name}_sum{_labels(labels)} {_number(hist.sum)}")
                out.append(f"{name}_count{_labels(labels)} {hist.count}")
            self._counter(
                out,
                "gpusnap_bytes_uploaded_total",
                "Bytes sent to the store (new chunks, compressed).",
                self._bytes_uploaded,
            )
            self._counter(
                out,
                "gpusnap_bytes_total",
                "Logical bytes of the checkpoints and restores jobs covered.",
                self._bytes_total,
            )
            self._gauge(
                out,
                "gpusnap_last_checkpoint_timestamp_seconds",
                "Commit time of each workload's newest good checkpoint (unix epoch).",
                ((w, t) for w, t in self._last_checkpoint.items()),
            )
            self._gauge(
                out,
                "gpusnap_last_checkpoint_age_seconds",
                "Seconds since each workload's newest good checkpoint.",
                ((w, max(0.0, now - t)) for w, t in self._last_checkpoint.items()),
            )
            self._store_check_series(out)
            self._counter(
                out,
                "gpusnap_bytes_fetched_total",
                "Chunk object bytes read from the store, by restores and prefetches.",
                self._bytes_fetched,
            )
            self._counter(
                out,
                "gpusnap_bytes_cached_total",
                "Chunk object bytes read from the node's chunk cache instead of the store.",
                self._bytes_cached,
            )
            self._gauge(
                out,
                "gpusnap_warm_fraction",
                "Fraction of each workload's latest checkpoint held in the node's chunk cache.",
                self._warm.items(),
            )
            return "\n".join(out) + "\n"

    def _store_check_series(self, out: list[str]) -> None:
        # The gauges only once a check has run: an absent series is "not known", a 0 is "none
        # missing", and alerts must be able to tell the two apart.
        check = self._store_check
        values = (
            (None,) * len(_STORE_CHECK_GAUGES)
            if check is None
            else (check.chunks_missing, check.damaged, check.checked_at, check.seconds)
        )
        for (name, help_text), value in zip(_STORE_CHECK_GAUGES, values, strict=True):
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} gauge")
            if value is not None:
                out.append(f"{name} {_number(value)}")
        self._counter(
            out,
            "gpusnap_store_check_failures_total",
            "Store checks that could not run (the store unreachable).",
            {(): self._store_check_failures},
        )

    @staticmethod
    def _counter(out: list[str], name: str, help_text: str, values: dict[Labels, int]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} counter")
        for labels, value in sorted(values.items()):
            out.append(f"{name}{_labels(labels)} {value}")

    @staticmethod
    def _gauge(
        out: list[str], name: str, help_text: str, values: Iterable[tuple[str, float]]
    ) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} gauge")
        for workload, value in sorted(values):
            out.append(f"{name}{_labels((('workload', workload),))} {_number(value)}")


METRICS = MetricsRegistry()


class _Handler(BaseHTTPRequestHandler):
    registry: MetricsRegistry  # set on the per-server subclass

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404, "only /metrics lives here")
            return
        body = self.registry.render().encode()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics %s: " + format, self.address_string(), *args)


class _V6HTTPServer(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class MetricsServer:
    """A running ``/metrics`` endpoint; ``close()`` stops it."""

    def __init__(self, httpd: ThreadingHTTPServer) -> None:
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return (str(host), int(port))

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def parse_address(text: str) -> tuple[str, int]:
    """``"127.0.0.1:9464"``, ``"[::1]:9464"`` or ``":9464"`` (all addresses) -> (host, port)."""
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"metrics address must be HOST:PORT, not {text!r}")
    return (host.strip("[]"), int(port_text))


def start_metrics_server(address: str, registry: MetricsRegistry = METRICS) -> MetricsServer:
    """Serve ``registry`` at ``http://ADDRESS/metrics`` from a background thread."""
    host, port = parse_address(address)
    handler = type("MetricsHandler", (_Handler,), {"registry": registry})
    server_class = _V6HTTPServer if ":" in host else ThreadingHTTPServer
    httpd = server_class((host, port), handler)
    httpd.daemon_threads = True
    log.info("metrics on http://%s:%d/metrics", host or "0.0.0.0", httpd.server_address[1])
    return MetricsServer(httpd)
