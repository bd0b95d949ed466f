"""OCI runtime spec (``config.json``) to and from ``ContainerSpec``, and overlay rootfs facts:
what runc and containerd share, since both run containers from an OCI bundle."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from gpusnap.daemon.containers.model import (
    UNEXPECTED_JSON,
    ContainerSpec,
    Device,
    Mount,
    Ulimit,
)
from gpusnap.errors import Internal

# Mounts every OCI config has; a cold start gets them from the runtime's own template.
_SYSTEM_MOUNTS = ("/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue", "/sys", "/sys/fs/cgroup")


def spec_from_oci(config: Any, *, image_id: str, image: str = "") -> ContainerSpec:
    """The spec of the container an OCI ``config.json`` describes; ``Internal`` when
    ``config`` is not one."""
    try:
        return _spec_from_oci(config, image_id=image_id, image=image)
    except UNEXPECTED_JSON as exc:
        raise Internal(f"OCI config: unexpected JSON ({type(exc).__name__}: {exc})") from exc


def _spec_from_oci(config: dict[str, Any], *, image_id: str, image: str) -> ContainerSpec:
    proc = config.get("process") or {}
    linux = config.get("linux") or {}
    res = linux.get("resources") or {}
    user = proc.get("user") or {}
    mounts = tuple(
        Mount(
            destination=str(m.get("destination", "")),
            source=str(m.get("source", "")),
            type=str(m.get("type", "bind")),
            options=tuple(m.get("options") or ()),
        )
        for m in config.get("mounts") or ()
        if m.get("destination") not in _SYSTEM_MOUNTS
    )
    devices = tuple(
        Device(path_on_host=str(d.get("path", "")), path_in_container=str(d.get("path", "")))
        for d in linux.get("devices") or ()
    )
    ulimits = tuple(
        Ulimit(str(r["type"]).removeprefix("RLIMIT_").lower(), int(r["soft"]), int(r["hard"]))
        for r in proc.get("rlimits") or ()
    )
    resources: dict[str, str] = {}
    mem = (res.get("memory") or {}).get("limit")
    if mem:
        resources["memory"] = str(mem)
    cpu = res.get("cpu") or {}
    for key, src in (("cpu_quota", "quota"), ("cpu_period", "period"), ("cpuset", "cpus")):
        if cpu.get(src):
            resources[key] = str(cpu[src])
    pids = (res.get("pids") or {}).get("limit")
    if pids:
        resources["pids"] = str(pids)
    netns = [n for n in linux.get("namespaces") or () if n.get("type") == "network"]
    network = "none" if netns and not netns[0].get("path") else "host"
    annotations = {str(k): str(v) for k, v in (config.get("annotations") or {}).items()}
    return ContainerSpec(
        image=image or annotations.get("org.opencontainers.image.ref.name", ""),
        image_id=image_id,
        command=tuple(proc.get("args") or ()),
        env=tuple(proc.get("env") or ()),
        workdir=str(proc.get("cwd") or ""),
        user=f"{user.get('uid', 0)}:{user.get('gid', 0)}" if user else "",
        mounts=mounts,
        devices=devices,
        ulimits=ulimits,
        network=network,
        resources=resources,
        annotations=annotations,
    )


def spec_to_oci(spec: ContainerSpec, template: dict[str, Any]) -> dict[str, Any]:
    """``template`` (``runc spec``'s default config) with ``spec`` applied: no terminal, a
    writable root, the recorded process, mounts, devices, rlimits, limits, annotations."""
    config = copy.deepcopy(template)
    proc = config.setdefault("process", {})
    proc["terminal"] = False
    proc["args"] = list(spec.entrypoint) + list(spec.command)
    if spec.env:
        proc["env"] = list(spec.env)
    if spec.workdir:
        proc["cwd"] = spec.workdir
    if spec.user:
        uid, _, gid = spec.user.partition(":")
        if uid.isdigit():
            proc["user"] = {"uid": int(uid), "gid": int(gid) if gid.isdigit() else 0}
    if spec.ulimits:
        proc["rlimits"] = [
            {"type": f"RLIMIT_{u.name.upper()}", "soft": u.soft, "hard": u.hard}
            for u in spec.ulimits
        ]
    config["root"] = {"path": "rootfs", "readonly": False}
    config["mounts"] = list(config.get("mounts") or []) + [
        {
            "destination": m.destination,
            "source": m.source,
            "type": m.type or "bind",
            "options": sorted(set(m.options) | ({"rbind"} if m.type == "bind" else set())),
        }
        for m in spec.mounts
    ]
    linux = config.setdefault("linux", {})
    if spec.devices:
        linux["devices"] = [
            {"path": d.path_in_container or d.path_on_host, "type": "c"} for d in spec.devices
        ]
    res = linux.setdefault("resources", {})
    r = spec.resources
    if r.get("memory"):
        res["memory"] = {"limit": int(r["memory"])}
    if r.get("pids"):
        res["pids"] = {"limit": int(r["pids"])}
    cpu: dict[str, Any] = {
        k: int(r[src])
        for k, src in (("quota", "cpu_quota"), ("period", "cpu_period"))
        if r.get(src)
    }
    if r.get("cpuset"):
        cpu["cpus"] = r["cpuset"]
    if cpu:
        res["cpu"] = cpu
    if spec.network == "host":
        linux["namespaces"] = [
            n for n in linux.get("namespaces") or [] if n.get("type") != "network"
        ]
    config["annotations"] = {**(config.get("annotations") or {}), **spec.annotations}
    return config


def overlay_upper(mount_point: Path) -> Path | None:
    """The upper directory of the overlay mounted at ``mount_point`` (None when it is not an
    overlay mount)."""
    target = str(mount_point.resolve())
    try:
        text = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    upper: Path | None = None
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields = left.split()
        if len(fields) < 5 or fields[4] != target:
            continue
        fstype, _source, opts = [*right.split(), "", "", ""][:3]
        if fstype != "overlay":
            upper = None
            continue
        for opt in opts.split(","):
            if opt.startswith("upperdir="):
                upper = Path(opt.removeprefix("upperdir="))
    return upper
