"""Podman's own formats, as gpusnap reads and writes them: which file of a ``podman container
checkpoint --export`` archive is which part, ``podman container inspect``'s JSON as a
``ContainerSpec``, and a ``ContainerSpec`` as ``podman run`` flags (a cold start)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpusnap.daemon.containers.model import (
    PART_CONFIG,
    PART_CRIU,
    PART_ROOTFS,
    PART_RUNTIME,
    UNEXPECTED_JSON,
    ContainerSpec,
    Device,
    Mount,
    Ulimit,
    index_parts,
)
from gpusnap.errors import Internal

_PARTS = {
    "checkpoint/": PART_CRIU,
    "rootfs-diff.tar": PART_ROOTFS,
    "deleted.files": PART_ROOTFS,
    "devshm-checkpoint.tar": PART_ROOTFS,
    "volumes/": PART_ROOTFS,
    "config.dump": PART_CONFIG,
    "spec.dump": PART_CONFIG,
}
# Set by podman itself in every container; a cold start must not pass them back.
_PODMAN_ENV = ("HOSTNAME=", "container=")
_PODMAN_ANNOTATIONS = (
    "io.podman.",
    "io.container.manager",
    "io.kubernetes.cri-o.",
    "org.opencontainers.image.stopSignal",
)


def parts_of(dest: Path) -> dict[str, str]:
    """Each file of the export archive unpacked into ``dest`` with its kind (the rest is
    podman's own metadata)."""
    return index_parts(dest, _PARTS, PART_RUNTIME)


def run_args(spec: ContainerSpec, name: str) -> list[str]:
    """``podman run`` up to the image: the container ``name`` detached, as ``spec`` says, but
    for what podman sets itself."""
    args = ["run", "--detach", "--name", name, "--network", spec.network or "none"]
    for u in spec.ulimits:
        args += ["--ulimit", f"{u.name}={u.soft}:{u.hard}"]
    for dev in spec.devices:
        inner = dev.path_in_container or dev.path_on_host
        args += ["--device", f"{dev.path_on_host}:{inner}:{dev.permissions}"]
    for m in spec.mounts:
        args += _mount_args(m)
    for e in spec.env:
        if not e.startswith(_PODMAN_ENV):
            args += ["--env", e]
    if spec.workdir:
        args += ["--workdir", spec.workdir]
    if spec.user:
        args += ["--user", spec.user]
    if spec.entrypoint:
        args += ["--entrypoint", json.dumps(list(spec.entrypoint))]
    for key, value in sorted(spec.annotations.items()):
        if not key.startswith(_PODMAN_ANNOTATIONS):
            args += ["--annotation", f"{key}={value}"]
    r = spec.resources
    for key, flag in (
        ("memory", "--memory"),
        ("pids", "--pids-limit"),
        ("cpu_quota", "--cpu-quota"),
        ("cpu_period", "--cpu-period"),
        ("cpuset", "--cpuset-cpus"),
    ):
        if r.get(key):
            args += [flag, r[key]]
    return args


def _mount_args(m: Mount) -> list[str]:
    if m.type == "tmpfs":
        return ["--tmpfs", m.destination]
    mode = "ro" if "ro" in m.options else "rw"
    return ["--volume", f"{m.source}:{m.destination}:{mode}"]


def spec_of(d: Any, image_id: str) -> ContainerSpec:
    """The spec of the container ``podman container inspect`` described as ``d``;
    ``Internal`` when ``d`` is not what podman prints."""
    try:
        return _spec_of(d, image_id)
    except UNEXPECTED_JSON as exc:
        raise Internal(f"podman inspect: unexpected JSON ({type(exc).__name__}: {exc})") from exc


def _spec_of(d: dict[str, Any], image_id: str) -> ContainerSpec:
    cfg = d.get("Config") or {}
    host = d.get("HostConfig") or {}
    entry = cfg.get("Entrypoint") or []
    if isinstance(entry, str):
        entry = [entry] if entry else []
    mounts = tuple(
        Mount(
            destination=str(m.get("Destination", "")),
            source=str(m.get("Source") or m.get("Name") or ""),
            type=str(m.get("Type", "bind")),
            options=tuple(m.get("Options") or ()) + (() if m.get("RW", True) else ("ro",)),
        )
        for m in d.get("Mounts") or ()
    )
    devices = tuple(
        Device(
            path_on_host=str(x.get("PathOnHost", "")),
            path_in_container=str(x.get("PathInContainer", "")),
            permissions=str(x.get("CgroupPermissions") or "rwm"),
        )
        for x in host.get("Devices") or ()
    )
    ulimits = tuple(
        Ulimit(str(u["Name"]).removeprefix("RLIMIT_").lower(), int(u["Soft"]), int(u["Hard"]))
        for u in host.get("Ulimits") or ()
    )
    resources = {
        key: str(host[src])
        for key, src in (
            ("memory", "Memory"),
            ("pids", "PidsLimit"),
            ("cpu_quota", "CpuQuota"),
            ("cpu_period", "CpuPeriod"),
            ("cpuset", "CpusetCpus"),
        )
        if host.get(src) not in (None, 0, "")
    }
    return ContainerSpec(
        image=str(d.get("ImageName", "")),
        image_id=image_id,
        command=tuple(cfg.get("Cmd") or ()),
        entrypoint=tuple(entry),
        env=tuple(cfg.get("Env") or ()),
        workdir=str(cfg.get("WorkingDir") or ""),
        user=str(cfg.get("User") or ""),
        mounts=mounts,
        devices=devices,
        ulimits=ulimits,
        network=str(host.get("NetworkMode") or "none"),
        resources=resources,
        annotations={str(k): str(v) for k, v in (cfg.get("Annotations") or {}).items()},
    )
