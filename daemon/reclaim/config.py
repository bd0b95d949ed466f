"""The ``[triggers]`` config table, and building the watchers it asks for.

```
[triggers]
provider = "auto"                         # aws | gcp | azure | auto | none
aws_imds_url = "http://169.254.169.254"
gcp_metadata_url = "http://metadata.google.internal"
azure_metadata_url = "http://169.254.169.254"
poll_interval = 5.0                       # AWS IMDS poll period, seconds
azure_poll_interval = 1.0                 # Azure scheduled events poll period, seconds
http_timeout = 2.0                        # one metadata request (AWS, Azure), seconds
gcp_wait_timeout = 60                     # GCP long-poll timeout_sec
probe_timeout = 1.0                       # each "auto" probe, seconds
max_backoff = 60.0                        # longest wait between polls of a failing service
aws_rebalance = true                      # watch the AWS rebalance recommendation
gcp_maintenance = true                    # watch instance/maintenance-event
preempt_notice = 30.0                     # GCP/Azure deadline when the notice gives none
logind = true                             # hold a logind shutdown delay lock
```
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpusnap.daemon.reclaim._http import check_base_url
from gpusnap.daemon.reclaim.aws import AwsImdsWatcher, probe_aws
from gpusnap.daemon.reclaim.azure import AzureScheduledEventsWatcher, probe_azure
from gpusnap.daemon.reclaim.gcp import GcpMetadataWatcher, probe_gcp
from gpusnap.daemon.reclaim.manager import Watcher
from gpusnap.errors import InvalidArgument

log = logging.getLogger(__name__)

PROVIDERS = ("auto", "aws", "gcp", "azure", "none")


@dataclass(frozen=True)
class TriggersConfig:
    provider: str = "auto"
    aws_imds_url: str = "http://169.254.169.254"
    gcp_metadata_url: str = "http://metadata.google.internal"
    azure_metadata_url: str = "http://169.254.169.254"
    poll_interval: float = 5.0
    azure_poll_interval: float = 1.0
    http_timeout: float = 2.0
    gcp_wait_timeout: int = 60
    probe_timeout: float = 1.0
    max_backoff: float = 60.0
    aws_rebalance: bool = True
    gcp_maintenance: bool = True
    preempt_notice: float = 30.0
    logind: bool = True


def _positive(table: str, key: str, value: object, *, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"[{table}] {key} must be a number, got {value!r:.40}")
    if integer and not isinstance(value, int):
        raise InvalidArgument(f"[{table}] {key} must be a whole number, got {value!r:.40}")
    if not value > 0:
        raise InvalidArgument(f"[{table}] {key} must be greater than 0, got {value!r:.40}")
    return float(value)


def _bool(table: str, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"[{table}] {key} must be true or false, got {value!r:.40}")
    return value


def check_known_keys(table: str, data: Mapping[str, Any], known: Any) -> None:
    for key in data:
        if key not in known:
            raise InvalidArgument(
                f"[{table}] unknown key {key!r}; known keys: {', '.join(sorted(known))}"
            )


def parse_triggers_config(data: Mapping[str, Any]) -> TriggersConfig:
    """Validate the ``[triggers]`` table (a parsed TOML mapping) strictly."""
    known = TriggersConfig.__dataclass_fields__
    check_known_keys("triggers", data, known)
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key == "provider":
            if value not in PROVIDERS:
                raise InvalidArgument(
                    f"[triggers] provider must be one of {', '.join(PROVIDERS)}, got {value!r:.40}"
                )
            values[key] = value
        elif key.endswith("_url"):
            if not isinstance(value, str):
                raise InvalidArgument(f"[triggers] {key} must be a string")
            values[key] = check_base_url(value, what=f"[triggers] {key}")
        elif key in ("aws_rebalance", "gcp_maintenance", "logind"):
            values[key] = _bool("triggers", key, value)
        elif key == "gcp_wait_timeout":
            values[key] = int(_positive("triggers", key, value, integer=True))
        else:
            values[key] = _positive("triggers", key, value)
    return TriggersConfig(**values)


def detect_provider(cfg: TriggersConfig) -> str | None:
    """Probe AWS, GCP and Azure at once with short timeouts; the first in that order wins."""
    probes: dict[str, Callable[[], bool]] = {
        "aws": lambda: probe_aws(cfg.aws_imds_url, cfg.probe_timeout),
        "gcp": lambda: probe_gcp(cfg.gcp_metadata_url, cfg.probe_timeout),
        "azure": lambda: probe_azure(cfg.azure_metadata_url, cfg.probe_timeout),
    }
    found: dict[str, bool] = {}

    def run(name: str, probe: Callable[[], bool]) -> None:
        try:
            found[name] = probe()
        except Exception:
            log.exception("probing %s failed", name)
            found[name] = False

    threads = [
        threading.Thread(target=run, args=item, name=f"probe-{item[0]}", daemon=True)
        for item in probes.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(cfg.probe_timeout * 3 + 1)
    for name in probes:
        if found.get(name):
            return name
    return None


def build_watchers(cfg: TriggersConfig) -> tuple[list[Watcher], str]:
    """The watchers for ``cfg`` and a one-line account of the choice (shown by the CLI).

    ``auto`` probes once, here; a node where no metadata service answers gets no cloud
    watcher (SIGTERM and logind still work).
    """
    provider = cfg.provider
    detail = f"provider {provider} (configured)"
    if provider == "auto":
        found = detect_provider(cfg)
        if found is None:
            log.info("triggers: no cloud metadata service answered; no cloud watcher")
            return [], "provider none (auto: no metadata service answered)"
        provider = found
        detail = f"provider {provider} (auto-detected)"
        log.info("triggers: detected %s", provider)
    watchers: list[Watcher] = []
    if provider == "aws":
        watchers.append(
            AwsImdsWatcher(
                cfg.aws_imds_url,
                poll_interval=cfg.poll_interval,
                timeout=cfg.http_timeout,
                watch_rebalance=cfg.aws_rebalance,
            )
        )
    elif provider == "gcp":
        watchers.append(
            GcpMetadataWatcher(
                cfg.gcp_metadata_url,
                "preempted",
                wait_timeout_s=cfg.gcp_wait_timeout,
                preempt_notice_s=cfg.preempt_notice,
            )
        )
        if cfg.gcp_maintenance:
            watchers.append(
                GcpMetadataWatcher(
                    cfg.gcp_metadata_url, "maintenance-event", wait_timeout_s=cfg.gcp_wait_timeout
                )
            )
    elif provider == "azure":
        watchers.append(
            AzureScheduledEventsWatcher(
                cfg.azure_metadata_url,
                poll_interval=cfg.azure_poll_interval,
                timeout=cfg.http_timeout,
                default_notice_s=cfg.preempt_notice,
            )
        )
    return watchers, detail
