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

from gpusnap.daemon.reclaim._http import Endpoint
from gpusnap.daemon.reclaim.config import TriggersConfig
from gpusnap.daemon.reclaim.notice import Notice, NoticeKind
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
        cfg: TriggersConfig,
        key: GcpKey = "preempted",
        *,
        http_margin_s: float = 10.0,
        maintenance_notice_s: float = 60.0,
        min_poll_interval: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``[triggers]`` gives the metadata server (``gcp_metadata_url``), how long one long
        poll waits (``gcp_wait_timeout``; the HTTP timeout is that plus ``http_margin_s``) and a
        preemption's deadline (``preempt_notice``)."""
        wait_timeout_s = cfg.gcp_wait_timeout
        if key not in ("preempted", "maintenance-event"):
            raise ValueError(f"unknown GCP metadata key {key!r}")
        self.key: GcpKey = key
        self.name = f"gcp:{key}"
        self.wait_timeout_s = wait_timeout_s
        self.http_margin_s = http_margin_s
        self.metadata = Endpoint(
            cfg.gcp_metadata_url, wait_timeout_s + http_margin_s, {FLAVOR[0]: FLAVOR[1]}
        )
        # The value that means "the VM is going away", and the notice it gives.
        self._going: tuple[str, NoticeKind, float, str] = (
            ("TRUE", "reclaim", cfg.preempt_notice, "preempted")
            if key == "preempted"
            # The VM stops at the event, and so does the daemon: one per lifetime.
            else (
                "TERMINATE_ON_HOST_MAINTENANCE",
                "maintenance",
                maintenance_notice_s,
                "terminate-on-host-maintenance",
            )
        )
        # A long poll paces itself; this floor only stops a server that ignores
        # wait_for_change from turning the loop into a busy one.
        self.poll_interval = min_poll_interval
        self._clock = clock
        self.etag = "NONE"
        self.value: str | None = None

    def _path(self) -> str:
        return (
            f"{METADATA_PREFIX}{self.key}?wait_for_change=true"
            f"&timeout_sec={self.wait_timeout_s}&last_etag={quote(self.etag, safe='')}"
        )

    def poll(self) -> list[Notice]:
        # The long poll may take its whole timeout_sec: the HTTP timeout is that plus a margin.
        resp = self.metadata.call(
            "GET", self._path(), timeout=self.wait_timeout_s + self.http_margin_s
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
        going, kind, notice_s, event_id = self._going
        if value != going:
            return []
        now = self._clock()
        return [
            Notice(
                provider="gcp",
                kind=kind,
                deadline=now + notice_s,
                # Preemption (and a terminating host event) happens once in a VM's life: one
                # id per key, so a flapping value dedups.
                event_id=event_id,
                detail=f"instance/{self.key} is {value}",
                received_at=now,
            )
        ]

    def close(self) -> None:
        return None


def probe_gcp(base_url: str, timeout: float) -> bool:
    """True if a GCE metadata server (it says ``Metadata-Flavor: Google``) answers."""
    return Endpoint(base_url, timeout, {FLAVOR[0]: FLAVOR[1]}).answers(
        METADATA_PREFIX + "id",
        lambda resp: resp.status == 200 and resp.header(FLAVOR[0]) == FLAVOR[1],
    )
