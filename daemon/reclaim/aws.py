"""AWS EC2 spot interruption notices over IMDSv2.

Protocol (EC2 user guide, "Spot Instance interruption notices" and "Use IMDSv2"):

- ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds: <ttl>``; the body of
  the reply is a session token, sent as ``X-aws-ec2-metadata-token`` on every ``GET``. A 401
  means the token expired or is unknown: fetch a new one and ask again. We also refresh it
  before it expires.
- ``GET /latest/meta-data/spot/instance-action``: 404 = nothing pending; 200 =
  ``{"action": "terminate"|"stop"|"hibernate", "time": "2017-09-18T08:22:00Z"}`` — the time the
  action happens, about two minutes ahead (hibernate starts at once). That time is the deadline.
- ``GET /latest/meta-data/events/recommendations/rebalance``: 404 = none; 200 =
  ``{"noticeTime": "…Z"}``, an early, advisory signal.

IMDS gives no event id, so a notice's id is a hash of what it says (as aws-node-termination-
handler does): the same notice polled again dedups; a changed one is new.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from gpusnap.daemon.reclaim._http import Endpoint, Response, epoch_seconds
from gpusnap.daemon.reclaim.config import TriggersConfig
from gpusnap.daemon.reclaim.notice import Notice
from gpusnap.errors import Corrupt, Unavailable

log = logging.getLogger(__name__)

TOKEN_PATH = "/latest/api/token"  # noqa: S105 - a URL path, not a secret
INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"  # noqa: S105 - a header name
ACTIONS = ("terminate", "stop", "hibernate")


def parse_aws_time(value: object, *, what: str) -> float:
    """``2017-09-18T08:22:00Z`` -> epoch seconds; ``Corrupt`` for anything else."""
    if not isinstance(value, str):
        raise Corrupt(f"AWS IMDS {what}: expected an ISO 8601 time, got {value!r:.60}")
    try:
        dt = datetime.fromisoformat(value.strip())
    except ValueError as exc:
        raise Corrupt(f"AWS IMDS {what}: not an ISO 8601 time: {value!r:.60}") from exc
    return epoch_seconds(dt, f"AWS IMDS {what}: time without a zone: {value!r:.60}")


class AwsImdsWatcher:
    """Polls the spot instance-action and the rebalance recommendation (AWS: every 5 s)."""

    provider = "aws"

    def __init__(
        self, cfg: TriggersConfig, *, token_ttl: int = 21600, clock: Callable[[], float] = time.time
    ) -> None:
        """``[triggers]`` gives the IMDS (``aws_imds_url``), ``poll_interval``, ``http_timeout``
        and whether to watch the rebalance recommendation (``aws_rebalance``)."""
        self.name = "aws"
        self.imds = Endpoint(cfg.aws_imds_url, cfg.http_timeout)
        self.poll_interval = cfg.poll_interval
        self.token_ttl = token_ttl
        self.watch_rebalance = cfg.aws_rebalance
        self._clock = clock
        self._lock = threading.Lock()
        self._token: str | None = None
        self._token_expires = 0.0  # monotonic

    # --- token -------------------------------------------------------------------------------

    def _fetch_token(self) -> str:
        resp = self.imds.call("PUT", TOKEN_PATH, headers={TTL_HEADER: str(self.token_ttl)})
        if resp.status != 200:
            raise Unavailable(f"AWS IMDS token request answered HTTP {resp.status}")
        token = resp.text().strip()
        if (
            " " in token
            or not token
            or len(token) > 4096
            or not (token.isascii() and token.isprintable())
        ):
            raise Corrupt("AWS IMDS token request answered an unusable token")
        return token

    def _current_token(self, *, force: bool = False) -> str:
        with self._lock:
            # Refresh well before expiry: a quarter of the TTL, at most a minute early.
            margin = min(60.0, self.token_ttl / 4)
            if force or self._token is None or time.monotonic() >= self._token_expires - margin:
                self._token = self._fetch_token()
                self._token_expires = time.monotonic() + self.token_ttl
                log.debug("fetched a new IMDSv2 token (ttl %d s)", self.token_ttl)
            return self._token

    def _get(self, path: str) -> Response:
        resp = self.imds.call("GET", path, headers={TOKEN_HEADER: self._current_token()})
        if resp.status == 401:
            log.info("IMDSv2 token rejected (401); fetching a new one")
            token = self._current_token(force=True)
            resp = self.imds.call("GET", path, headers={TOKEN_HEADER: token})
        if resp.status == 401:
            raise Unavailable(f"AWS IMDS refused a fresh token for {path} (401)")
        return resp

    def _document(self, path: str) -> dict[str, Any] | None:
        """The JSON object at ``path``; ``None`` when IMDS says nothing is there (404)."""
        resp = self._get(path)
        if resp.status == 404:
            return None
        if resp.status != 200:
            raise Unavailable(f"AWS IMDS {path} answered HTTP {resp.status}")
        try:
            doc = json.loads(resp.body)
        except ValueError as exc:
            raise Corrupt(f"AWS IMDS {path}: answer is not JSON: {resp.text()[:60]!r}") from exc
        if not isinstance(doc, dict):
            raise Corrupt(f"AWS IMDS {path}: answer is not a JSON object")
        return doc

    # --- poll --------------------------------------------------------------------------------

    def _instance_action(self) -> Notice | None:
        doc = self._document(INSTANCE_ACTION_PATH)
        if doc is None:
            return None
        action = doc.get("action")
        if action not in ACTIONS:
            raise Corrupt(f"AWS IMDS instance-action: unknown action {action!r:.40}")
        when = parse_aws_time(doc.get("time"), what="instance-action time")
        now = self._clock()
        # Hibernation starts at once, without the two-minute warning.
        deadline = min(when, now) if action == "hibernate" else when
        digest = hashlib.sha256(f"{action}|{doc.get('time')}".encode()).hexdigest()[:16]
        return Notice(
            provider="aws",
            kind="reclaim",
            deadline=deadline,
            event_id=f"spot-itn-{digest}",
            detail=f"spot instance-action {action} at {doc.get('time')}",
            received_at=now,
        )

    def _rebalance(self) -> Notice | None:
        doc = self._document(REBALANCE_PATH)
        if doc is None:
            return None
        notice_time = doc.get("noticeTime")
        parse_aws_time(notice_time, what="rebalance noticeTime")
        return Notice(
            provider="aws",
            kind="rebalance",
            deadline=None,
            event_id=f"rebalance-{notice_time}",
            detail=f"rebalance recommendation at {notice_time}",
            received_at=self._clock(),
        )

    def poll(self) -> list[Notice]:
        found = [self._instance_action()]
        if self.watch_rebalance:
            found.append(self._rebalance())
        return [n for n in found if n is not None]

    def close(self) -> None:
        return None


def probe_aws(base_url: str, timeout: float) -> bool:
    """True if an IMDSv2 service answers a token request at ``base_url``."""
    return Endpoint(base_url, timeout).answers(
        TOKEN_PATH,
        lambda resp: resp.status == 200 and bool(resp.body.strip()),
        method="PUT",
        headers={TTL_HEADER: "60"},
    )
