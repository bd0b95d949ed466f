"""Google Compute Engine preemption and host-maintenance notices.

Protocol (Compute Engine docs, "Detect if a VM was preempted", "Getting live migration
notices", and google-cloud-go's ``metadata.Subscribe``):

- ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``; the body is
  ``TRUE`` or ``FALSE``. A genuine server answers with ``Metadata-Flavor: Google`` too — a reply
  without it is not the metadata server (a captive proxy, say) and is rejected.
- Long-poll: ``?wait_for_change=true&timeout_sec=N&last_etag=E`` returns when the value's ETag
  differs from ``E`` or after N seconds; the first call uses ``last_etag=NONE`` and so returns
  at once. The HTTP timeout is N plus a margin.
- ``GET /computeMetadata/v1/instance/maintenance-event`` the same way; the value becomes
  ``TERMINATE_ON_HOST_MAINTENANCE`` about 60 s before a host event stops the VM (GPU VMs
  cannot live-migrate).

Spot VMs get about 30 s between ``preempted`` turning TRUE and the hard power-off, so the
deadline is 30 s from receipt (``preempt_notice_s``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal
from urllib.parse import quote

from gpusnap.daemon.reclaim._http import request
from gpusnap.daemon.reclaim.manager import Notice
from gpusnap.errors import Corrupt, NotFound, Unavailable

log = logging.getLogger(__name__)

METADATA_PREFIX = "/computeMetadata/v1/instance/"
FLAVOR = ("Metadata-Flavor", "Google")
GcpKey = Literal["preempted", "maintenance-event"]
MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")


class GcpMetadataWatcher:
    """Long-polls one instance metadata key (one watcher, one thread, per key)."""

    provider = "gcp"

    def __init__(
        self,
        base_url: str,
        key: GcpKey = "preempted",
        *,
        wait_timeout_s: int = 60,
        http_margin_s: float = 10.0,
        preempt_notice_s: float = 30.0,
        maintenance_notice_s: float = 60.0,
        min_poll_interval: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if key not in ("preempted", "maintenance-event"):
            raise ValueError(f"unknown GCP metadata key {key!r}")
        self.key: GcpKey = key
        self.name = f"gcp:{key}"
        self.base_url = base_url.rstrip("/")
        self.wait_timeout_s = wait_timeout_s
        self.http_margin_s = http_margin_s
        self.preempt_notice_s = preempt_notice_s
        self.maintenance_notice_s = maintenance_notice_s
        # A long poll paces itself; this floor only stops a server that ignores
        # wait_for_change from turning the loop into a busy one.
        self.poll_interval = min_poll_interval
        self._clock = clock
        self.etag = "NONE"
        self.value: str | None = None

    def _url(self) -> str:
        return (
            f"{self.base_url}{METADATA_PREFIX}{self.key}?wait_for_change=true"
            f"&timeout_sec={self.wait_timeout_s}&last_etag={quote(self.etag, safe='')}"
        )

    def poll(self) -> list[Notice]:
        resp = request(
            "GET",
            self._url(),
            headers={FLAVOR[0]: FLAVOR[1]},
            timeout=self.wait_timeout_s + self.http_margin_s,
        )
        if resp.header(FLAVOR[0]) != FLAVOR[1]:
            raise Corrupt(
                f"GCP metadata {self.key}: reply lacks 'Metadata-Flavor: Google'; "
                "not the metadata server"
            )
        if resp.status == 404:
            raise NotFound(f"GCP metadata key instance/{self.key} is not defined on this VM")
        if resp.status != 200:
            raise Unavailable(f"GCP metadata {self.key} answered HTTP {resp.status}")
        value = resp.text().strip()
        if self.key == "preempted":
            if value not in ("TRUE", "FALSE"):
                raise Corrupt(f"GCP metadata preempted: expected TRUE or FALSE, got {value[:40]!r}")
        elif value not in MAINTENANCE_VALUES:
            raise Corrupt(f"GCP metadata maintenance-event: unknown value {value[:60]!r}")
        etag = resp.header("ETag")
        if etag:
            self.etag = etag
        if value != self.value:
            log.info("GCP metadata %s = %s (etag %s)", self.key, value, self.etag)
        self.value = value
        now = self._clock()
        if self.key == "preempted" and value == "TRUE":
            return [
                Notice(
                    provider="gcp",
                    kind="reclaim",
                    deadline=now + self.preempt_notice_s,
                    # Preemption happens once in a VM's life: one id, so flapping dedups.
                    event_id="preempted",
                    detail="instance/preempted is TRUE",
                    received_at=now,
                )
            ]
        if self.key == "maintenance-event" and value == "TERMINATE_ON_HOST_MAINTENANCE":
            return [
                Notice(
                    provider="gcp",
                    kind="maintenance",
                    deadline=now + self.maintenance_notice_s,
                    # The VM stops at the event, and so does the daemon: one per lifetime.
                    event_id="terminate-on-host-maintenance",
                    detail="instance/maintenance-event is TERMINATE_ON_HOST_MAINTENANCE",
                    received_at=now,
                )
            ]
        return []

    def close(self) -> None:
        return None


def probe_gcp(base_url: str, timeout: float) -> bool:
    """True if a GCE metadata server (it says ``Metadata-Flavor: Google``) answers."""
    try:
        resp = request(
            "GET",
            base_url.rstrip("/") + METADATA_PREFIX + "id",
            headers={FLAVOR[0]: FLAVOR[1]},
            timeout=timeout,
        )
    except Unavailable:
        return False
    return resp.status == 200 and resp.header(FLAVOR[0]) == FLAVOR[1]
