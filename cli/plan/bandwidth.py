"""Upload bandwidth to a store, measured: a short timed upload of temporary objects.

Goes through the store's own backend (``gpusnap.storage.open_backend``), so it crosses the
same client, endpoint, credentials and retry wrapper that a checkpoint's chunks do. The
objects are random (nothing compresses or deduplicates them), written in parallel the way a
push writes chunks, under names of their own (``plan-probe-<random>-<n>``, flat, so a directory
store keeps no empty folder) that no checkpoint uses, and deleted afterwards whatever happened.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from gpusnap.errors import InvalidArgument
from gpusnap.storage import Backend, BackendOptions, open_backend

log = logging.getLogger(__name__)

PROBE_PREFIX = "plan-probe"
DEFAULT_PROBE_BYTES = 64 * 1024 * 1024
DEFAULT_OBJECT_BYTES = 8 * 1024 * 1024  # about a push's chunk batch
DEFAULT_WORKERS = 8


@dataclass(frozen=True)
class Measurement:
    bytes_per_second: float
    bytes_sent: int
    seconds: float
    url: str


def measure(
    url: str,
    *,
    total_bytes: int = DEFAULT_PROBE_BYTES,
    object_bytes: int = DEFAULT_OBJECT_BYTES,
    workers: int = DEFAULT_WORKERS,
    options: BackendOptions | None = None,
) -> Measurement:
    """Put ``total_bytes`` in objects of ``object_bytes`` with ``workers`` in parallel, time
    it, delete them. A store that is not there is ``NotFound``; one that cannot be reached,
    ``Unavailable`` (the backend's own errors)."""
    if total_bytes < 1 or object_bytes < 1 or workers < 1:
        raise InvalidArgument("the bandwidth probe needs a positive size and worker count")
    # Never create a store to measure it: a mistyped path is an error, not a new directory.
    opts = dataclasses.replace(options or BackendOptions(), create=False)
    backend = open_backend(url, opts)
    try:
        return _timed_upload(backend, url, total_bytes, min(object_bytes, total_bytes), workers)
    finally:
        backend.close()


def _timed_upload(backend: Backend, url: str, total: int, size: int, workers: int) -> Measurement:
    prefix = f"{PROBE_PREFIX}-{secrets.token_hex(8)}"
    count = -(-total // size)
    payload = os.urandom(size)
    keys = [f"{prefix}-{i:04d}" for i in range(count)]
    written: list[str] = []

    def put(key: str) -> None:
        backend.put(key, payload)
        written.append(key)

    try:
        start = time.monotonic()
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="plan-probe") as pool:
            for future in [pool.submit(put, key) for key in keys]:
                future.result()
        seconds = max(time.monotonic() - start, 1e-9)
    finally:
        for key in written:
            try:
                backend.delete(key)
            except Exception:  # the measurement stands; a leftover probe object is logged
                log.warning("could not delete bandwidth probe object %s", key, exc_info=True)
    sent = count * size
    return Measurement(sent / seconds, sent, seconds, url)
