"""Azure Scheduled Events (instance metadata service).

Protocol (Azure docs, "Azure Metadata Service: Scheduled Events for Linux VMs"):

- ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true`` (without
  it the service answers 400). 200 with ``{"DocumentIncarnation": n, "Events": [...]}``; no
  events is ``"Events": []``. Each event has ``EventId``, ``EventType`` (Freeze, Reboot,
  Redeploy, Preempt, Terminate), ``EventStatus`` (Scheduled, Started), ``Resources`` (VM
  names), ``NotBefore`` (RFC 1123, blank once started). Poll about once a second.
- Approve: ``POST`` the same URL with ``Metadata: true`` and
  ``{"StartRequests": [{"EventId": "…"}]}``. Approval lets the platform go ahead *early*, so
  gpusnap approves only after the checkpoint has committed (``Notice.ack``).
- Events of an availability set list every VM they touch; this watcher acts only on events
  whose ``Resources`` name this VM (from ``/metadata/instance/compute/name``).

Preempt and Terminate are reclaims; Reboot and Redeploy lose process and GPU state and are
reported as maintenance; Freeze (a pause of seconds, memory kept) is ignored. The deadline is
``NotBefore`` when given, else 30 s from receipt (Preempt's guaranteed minimum).
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from typing import Any

from gpusnap.daemon.reclaim._http import Endpoint, Response, epoch_seconds
from gpusnap.daemon.reclaim.config import TriggersConfig
from gpusnap.daemon.reclaim.notice import Notice, NoticeKind
from gpusnap.errors import Corrupt, Unavailable

log = logging.getLogger(__name__)

EVENTS_PATH = "/metadata/scheduledevents"
NAME_PATH = "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
INSTANCE_PATH = "/metadata/instance?api-version=2021-02-01"
KINDS: dict[str, NoticeKind] = {
    "Preempt": "reclaim",
    "Terminate": "reclaim",
    "Reboot": "maintenance",
    "Redeploy": "maintenance",
}


def parse_rfc1123(value: str) -> float:
    try:
        dt = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError) as exc:
        raise Corrupt(f"Azure scheduled event NotBefore is not RFC 1123: {value[:60]!r}") from exc
    return epoch_seconds(dt, f"Azure scheduled event NotBefore has no zone: {value[:60]!r}")


class AzureScheduledEventsWatcher:
    provider = "azure"

    def __init__(
        self,
        cfg: TriggersConfig,
        *,
        api_version: str = "2020-07-01",
        vm_name: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``[triggers]`` gives the IMDS (``azure_metadata_url``), ``azure_poll_interval``,
        ``http_timeout`` and the deadline of an event without NotBefore (``preempt_notice``).
        ``vm_name`` None: asked of the IMDS, to tell this VM's events from its neighbours'."""
        self.name = "azure"
        self.imds = Endpoint(cfg.azure_metadata_url, cfg.http_timeout, {"Metadata": "true"})
        self.events_path = f"{EVENTS_PATH}?api-version={api_version}"
        self.poll_interval = cfg.azure_poll_interval
        self.default_notice_s = cfg.preempt_notice
        self.vm_name = vm_name
        self._name_known = vm_name is not None
        self._clock = clock
        self.incarnation: int | None = None

    def _resolve_vm_name(self) -> None:
        if self._name_known:
            return
        resp = self.imds.call("GET", NAME_PATH)
        if resp.status == 200 and resp.text().strip():
            self.vm_name = resp.text().strip()
            log.info("Azure VM name: %s", self.vm_name)
        else:
            # Without our name we cannot filter; acting on a neighbour's event costs a spare
            # checkpoint, ignoring our own would lose the workload.
            log.warning(
                "Azure IMDS did not give this VM's name (HTTP %d); acting on all events",
                resp.status,
            )
        self._name_known = True

    def approve(self, event_id: str) -> None:
        """Approve (start) one scheduled event now."""
        body = json.dumps({"StartRequests": [{"EventId": event_id}]}).encode()
        resp = self.imds.call(
            "POST", self.events_path, headers={"Content-Type": "application/json"}, body=body
        )
        if resp.status != 200:
            raise Unavailable(f"Azure approval of event {event_id} answered HTTP {resp.status}")
        log.info("approved Azure scheduled event %s", event_id)

    def _parse(self, body: bytes) -> list[dict[str, Any]]:
        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise Corrupt(f"Azure scheduled events: answer is not JSON: {body[:60]!r}") from exc
        if not isinstance(doc, dict) or not isinstance(doc.get("Events"), list):
            raise Corrupt("Azure scheduled events: answer has no Events list")
        incarnation = doc.get("DocumentIncarnation")
        if isinstance(incarnation, int):
            self.incarnation = incarnation
        events: list[dict[str, Any]] = []
        for ev in doc["Events"]:
            if not isinstance(ev, dict) or not isinstance(ev.get("EventId"), str):
                raise Corrupt("Azure scheduled events: an event has no EventId")
            if not isinstance(ev.get("EventType"), str):
                raise Corrupt(f"Azure scheduled event {ev['EventId']} has no EventType")
            events.append(ev)
        return events

    def poll(self) -> list[Notice]:
        self._resolve_vm_name()
        resp = self.imds.call("GET", self.events_path)
        if resp.status != 200:
            raise Unavailable(f"Azure scheduled events answered HTTP {resp.status}")
        now = self._clock()
        notices: list[Notice] = []
        for ev in self._parse(resp.body):
            kind = KINDS.get(ev["EventType"])
            if kind is None:
                continue
            resources = ev.get("Resources")
            if (
                self.vm_name is not None
                and isinstance(resources, list)
                and self.vm_name not in resources
            ):
                continue
            not_before = ev.get("NotBefore")
            if isinstance(not_before, str) and not_before.strip():
                deadline = parse_rfc1123(not_before.strip())
            elif ev.get("EventStatus") == "Started":
                deadline = now
            else:
                deadline = now + self.default_notice_s
            event_id: str = ev["EventId"]
            notices.append(
                Notice(
                    provider="azure",
                    kind=kind,
                    deadline=deadline,
                    event_id=event_id,
                    detail=f"{ev['EventType']} {ev.get('EventStatus', '')} "
                    f"NotBefore={not_before or '-'}",
                    received_at=now,
                    ack=functools.partial(self.approve, event_id),
                )
            )
        return notices

    def close(self) -> None:
        return None


def probe_azure(base_url: str, timeout: float) -> bool:
    """True if an Azure IMDS answers the instance document at ``base_url``."""
    return Endpoint(base_url, timeout, {"Metadata": "true"}).answers(INSTANCE_PATH, _is_instance)


def _is_instance(resp: Response) -> bool:
    if resp.status != 200:
        return False
    try:
        doc = json.loads(resp.body)
    except ValueError:
        return False
    return isinstance(doc, dict) and "compute" in doc
