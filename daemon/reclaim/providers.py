"""Which cloud this node is on (``provider = "auto"``), and the watchers ``[triggers]`` asks for."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from gpusnap.daemon.reclaim.aws import AwsImdsWatcher, probe_aws
from gpusnap.daemon.reclaim.azure import AzureScheduledEventsWatcher, probe_azure
from gpusnap.daemon.reclaim.config import TriggersConfig
from gpusnap.daemon.reclaim.gcp import GcpKey, GcpMetadataWatcher, probe_gcp
from gpusnap.daemon.reclaim.manager import Watcher

log = logging.getLogger(__name__)


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
    return _watchers(provider, cfg), detail


def _watchers(provider: str, cfg: TriggersConfig) -> list[Watcher]:
    if provider == "aws":
        return [AwsImdsWatcher(cfg)]
    if provider == "gcp":
        keys: list[GcpKey] = ["preempted"]  # one long poll, so one watcher, per key
        if cfg.gcp_maintenance:
            keys.append("maintenance-event")
        return [GcpMetadataWatcher(cfg, key) for key in keys]
    if provider == "azure":
        return [AzureScheduledEventsWatcher(cfg)]
    return []
