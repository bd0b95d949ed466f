"""The ``[containers]`` tables of gpusnapd's config: how this node reaches its container runtimes.

```
[containers]
detect = ["podman", "runc", "containerd"]   # where a container without a runtime is looked for

[containers.podman]                # every key optional: podman's own defaults otherwise
binary = "podman"
root = "/var/lib/containers/storage"
runroot = "/run/containers/storage"   # at most 50 characters (podman's limit)
tmpdir = "/var/tmp/gpusnap-podman"
runtime_root = "/run/runc"            # runc's state dir (--runtime-flag root=)
oci_runtime = "runc"                  # crun cannot checkpoint on hybrid cgroups
cgroup_manager = "systemd"            # or "cgroupfs" (no systemd as PID 1)
events_backend = "journald"           # or "file", "none"
timeout = 600.0                       # hang guard on one podman call, seconds

[containers.runc]
binary = "runc"
root = "/run/runc"
bundles = "/var/lib/gpusnap/runc/bundles"
images = "/var/lib/gpusnap/runc/images"
timeout = 600.0

[containers.containerd]
binary = "ctr"
address = "/run/containerd/containerd.sock"
namespace = "default"
timeout = 600.0
```

``parse_containers`` reads them into a ``ContainersSection`` whose ``options`` are each runtime
class's keyword arguments; every runtime is made once at parse time (nothing runs), so a bad
option (a relative path, a runroot podman would refuse) is a config error naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap.daemon.config.table import Table
from gpusnap.daemon.containers.podman import MAX_RUNROOT
from gpusnap.daemon.containers.runtimes import RUNTIMES, open_runtime
from gpusnap.errors import InvalidArgument

# key -> kind ("path", "string", "choice:a|b", "number") for each runtime's table
_KEYS: dict[str, dict[str, str]] = {
    "podman": {
        "binary": "string",
        "root": "path",
        "runroot": "path",
        "tmpdir": "path",
        "runtime_root": "path",
        "oci_runtime": "string",
        "cgroup_manager": "choice:systemd|cgroupfs",
        "events_backend": "choice:journald|file|none",
        "timeout": "number",
    },
    "runc": {
        "binary": "string",
        "root": "path",
        "bundles": "path",
        "images": "path",
        "timeout": "number",
    },
    "containerd": {
        "binary": "string",
        "address": "path",
        "namespace": "string",
        "timeout": "number",
    },
}


@dataclass(frozen=True)
class ContainersSection:
    """``detect``: the runtimes a workload without ``runtime`` is looked for in, in order;
    ``options``: per runtime, the keyword arguments of its class (docs/config.md)."""

    detect: tuple[str, ...] = RUNTIMES
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


def parse_containers(t: Table) -> ContainersSection:
    detect = t.string_list("detect")
    if detect is not None:
        unknown = [d for d in detect if d not in RUNTIMES]
        if unknown or not detect or len(set(detect)) != len(detect):
            raise t.bad("detect", f"must list runtimes among {', '.join(RUNTIMES)}, each once")
    options: dict[str, dict[str, Any]] = {}
    for name, keys in _KEYS.items():
        rt = t.table(name, optional=True)
        if rt is None:
            continue
        opts: dict[str, Any] = {}
        for key, kind in keys.items():
            value = _read(rt, key, kind)
            if value is not None:
                opts[key] = value
        rt.done()
        if name == "podman" and len(str(opts.get("runroot", ""))) > MAX_RUNROOT:
            raise rt.bad(
                "runroot", f"podman refuses a runroot longer than {MAX_RUNROOT} characters"
            )
        try:
            open_runtime(name, **opts)  # checks the options; runs nothing
        except InvalidArgument as err:
            raise InvalidArgument(f"{rt.where}: {err}") from err
        options[name] = opts
    t.done()
    return ContainersSection(detect=tuple(detect) if detect else RUNTIMES, options=options)


def _read(t: Table, key: str, kind: str) -> Path | str | float | None:
    if kind == "path":
        return t.path(key)
    if kind == "number":
        return t.number(key, minimum=1.0)
    if kind.startswith("choice:"):
        return t.choice(key, tuple(kind.removeprefix("choice:").split("|")))
    return t.string(key)
