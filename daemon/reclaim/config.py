"""Reclaim's config: the ``[triggers]`` and ``[migration]`` tables and each workload's policy keys.

Plain functions over parsed TOML mappings, each returning a frozen, typed value:
``parse_triggers`` -> ``TriggersConfig``, ``parse_migration`` -> ``MigrationConfig``,
``parse_workload_policy`` -> ``WorkloadPolicy``. ``gpusnap.daemon.config.file`` calls them; a
problem is an ``InvalidArgument`` naming the key. Imports nothing of the daemon (only the
metadata URL check, the workload-name grammar and the error vocabulary), so the daemon's config
can import it freely.

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

[migration]
standby = false                           # adopt reclaimed workloads from the store
poll_interval = 5.0                       # seconds between looks at the board
cold_start_after = 120.0                  # an incompatible node claims a request this old
claim_timeout = 1800.0                    # a claim without outcome this old is taken over
request_ttl = 3600.0                      # a request nobody claimed this old is not acted on
node_id = ""                              # empty: [daemon] node_id, else the host name
prefetch = false                          # keep the latest checkpoints warm in the chunk cache
prefetch_bandwidth = 100000000            # bytes/s from the store, for every workload together
prefetch_workloads = []                   # empty: every [[workload]] of the config
```
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, get_type_hints

from gpusnap.daemon.infra.numbers import MAX_NUMBER, is_finite_number
from gpusnap.daemon.reclaim._http import check_base_url
from gpusnap.errors import InvalidArgument
from gpusnap.storage.manifest import is_workload

PROVIDERS = ("auto", "aws", "gcp", "azure", "none")
OnNotice = Literal["checkpoint", "none"]
POLICY_KEYS = frozenset({"on_notice", "checkpoint_interval", "checkpoint_on_rebalance"})

_C = TypeVar("_C")


@dataclass(frozen=True)
class TriggersConfig:
    """The ``[triggers]`` table: which cloud to watch, and how."""

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


@dataclass(frozen=True)
class MigrationConfig:
    """The ``[migration]`` table: whether this node adopts reclaimed workloads, and how."""

    standby: bool = False
    poll_interval: float = 5.0  # seconds between looks at the board
    cold_start_after: float = 120.0  # an incompatible node claims a request this old
    claim_timeout: float = 1800.0  # a claim without outcome this old is taken over
    # A request nobody claimed this old (seconds) is expired: no standby acts on it, so one
    # added later never starts a stale copy of a workload that has run on elsewhere since.
    request_ttl: float = 3600.0
    node_id: str = ""  # empty: the daemon's node id, else the host name
    # Follow each workload's latest checkpoint into the node's chunk cache (reclaim/prefetch.py)
    prefetch: bool = False
    prefetch_bandwidth: float = 100e6  # bytes/s from the store, shared by every workload
    prefetch_workloads: tuple[str, ...] = ()  # empty: every [[workload]] of the config


@dataclass(frozen=True)
class WorkloadPolicy:
    """What notices and schedules start for one workload (its ``POLICY_KEYS``)."""

    workload: str
    on_notice: OnNotice = "checkpoint"
    checkpoint_interval: float | None = None
    checkpoint_on_rebalance: bool = True


# --- checks of one value; ``where`` is "[table] key" ------------------------------------------


def _number(where: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{where} must be a number, got {value!r:.40}")
    if not value > 0:
        raise InvalidArgument(f"{where} must be greater than 0, got {value!r:.40}")
    return float(value)


def _whole(where: str, value: object) -> int:
    if isinstance(value, float):
        raise InvalidArgument(f"{where} must be a whole number, got {value!r:.40}")
    return int(_number(where, value))


def _bool(where: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{where} must be true or false, got {value!r:.40}")
    return value


def _url(where: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{where} must be a string")
    return check_base_url(value, what=where)


def _provider(where: str, value: object) -> str:
    if value not in PROVIDERS:
        raise InvalidArgument(f"{where} must be one of {', '.join(PROVIDERS)}, got {value!r:.40}")
    return str(value)


def _word(where: str, value: object) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise InvalidArgument(f"{where} must be a non-empty word")
    return value


def _workload_names(where: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"{where} must be a list of workload names, got {value!r:.60}")
    for name in value:
        if not is_workload(name):
            raise InvalidArgument(
                f"{where}: {name!r} is not a workload name "
                "(letters, digits, '.', '_', '-'; at most 128)"
            )
    if len(set(value)) != len(value):
        raise InvalidArgument(f"{where} names a workload twice")
    return tuple(value)


_BY_TYPE: dict[object, Callable[[str, object], object]] = {
    float: _number,
    int: _whole,
    bool: _bool,
}


def _parse_table(
    table: str,
    cls: type[_C],
    data: Mapping[str, Any],
    checks: Mapping[str, Callable[[str, object], object]],
) -> _C:
    """``cls`` from ``data``, strictly: an unknown key is an error, and each value is checked
    by ``checks[key]``, else by the type of its field (``_BY_TYPE``)."""
    types = get_type_hints(cls)  # each field's type; the dataclass's own annotations
    values: dict[str, object] = {}
    for key, value in data.items():
        if key not in types:
            raise InvalidArgument(
                f"[{table}] unknown key {key!r}; known keys: {', '.join(sorted(types))}"
            )
        check = checks.get(key) or _BY_TYPE[types[key]]
        values[key] = check(f"[{table}] {key}", value)
    return cls(**values)


def parse_triggers(data: Mapping[str, Any]) -> TriggersConfig:
    """Validate the ``[triggers]`` table (a parsed TOML mapping) strictly."""
    urls = {k: _url for k in ("aws_imds_url", "gcp_metadata_url", "azure_metadata_url")}
    return _parse_table("triggers", TriggersConfig, data, {"provider": _provider, **urls})


def parse_migration(data: Mapping[str, Any]) -> MigrationConfig:
    """Validate the ``[migration]`` table strictly (unknown keys are errors)."""
    return _parse_table(
        "migration",
        MigrationConfig,
        data,
        {"node_id": _word, "prefetch_workloads": _workload_names},
    )


def parse_workload_policy(workload: str, table: Mapping[str, Any]) -> WorkloadPolicy:
    """Read the ``POLICY_KEYS`` of a workload's config table (other keys are not ours)."""
    where = f"[workloads.{workload}]"
    on_notice = table.get("on_notice", "checkpoint")
    if on_notice not in ("checkpoint", "none"):
        raise InvalidArgument(f"{where} on_notice must be 'checkpoint' or 'none'")
    interval = table.get("checkpoint_interval")
    if interval is not None and (not is_finite_number(interval) or not 0 < interval <= MAX_NUMBER):
        raise InvalidArgument(
            f"{where} checkpoint_interval must be a number of seconds > 0 "
            f"and at most {MAX_NUMBER:g}"
        )
    on_rebalance = table.get("checkpoint_on_rebalance", True)
    if not isinstance(on_rebalance, bool):
        raise InvalidArgument(f"{where} checkpoint_on_rebalance must be true or false")
    return WorkloadPolicy(
        workload,
        on_notice,
        float(interval) if interval is not None else None,
        on_rebalance,
    )
