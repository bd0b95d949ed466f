"""Podman (>= 4.0, with runc): ``podman container checkpoint --export`` into parts.

Podman's export archive is already cut the way gpusnap stores a checkpoint: ``checkpoint/`` is
CRIU's images, ``rootfs-diff.tar`` / ``deleted.files`` / ``devshm-checkpoint.tar`` the
container's changed files, ``config.dump`` / ``spec.dump`` its config and OCI spec, and the rest
podman's own metadata. The archive is written uncompressed into a FIFO and unpacked as it comes
(``archive.TarReceiver``), so it never exists on disk as one file; a restore packs the parts
into an archive again and ``podman container restore --import``s it.

Every call passes the global flags this object was made with: the storage root (``--root``,
``--runroot``, ``--tmpdir``) — a second root is "another node" on one machine —, the OCI
runtime (runc: crun cannot checkpoint on hybrid cgroups), and optionally runc's state root
(``--runtime-flag root=``), which two storage roots on one machine must not share: runc keys
its state by container id and a restore keeps the id.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from gpusnap.daemon.containers.archive import Arrivals, TarReceiver, pack
from gpusnap.daemon.containers.model import (
    PART_CONFIG,
    PART_CRIU,
    PART_ROOTFS,
    PART_RUNTIME,
    CheckpointParts,
    ContainerInfo,
    ContainerSpec,
    Device,
    Mount,
    Ulimit,
    index_parts,
)
from gpusnap.daemon.containers.runtime import (
    DEFAULT_CRIU,
    DEFAULT_TIMEOUT,
    ContainerRuntime,
    Dumped,
    RuntimeTool,
    live_facts,
)
from gpusnap.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound

log = logging.getLogger(__name__)

MIN_VERSION = (4, 0)
MAX_RUNROOT = 50  # podman refuses a longer runroot path ("runroot ... is too long")
PARTS = {
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


class PodmanRuntime(ContainerRuntime):
    """Containers of one podman storage root."""

    name = "podman"

    def __init__(
        self,
        *,
        root: Path | None = None,
        runroot: Path | None = None,
        tmpdir: Path | None = None,
        oci_runtime: str = "runc",
        runtime_root: Path | None = None,
        cgroup_manager: str | None = None,
        events_backend: str | None = None,
        binary: str = "podman",
        criu: Path = DEFAULT_CRIU,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if runroot is not None and len(str(runroot)) > MAX_RUNROOT:
            raise InvalidArgument(
                f"podman: runroot {runroot} is longer than the {MAX_RUNROOT} characters "
                "podman accepts"
            )
        args: list[str] = ["--runtime", oci_runtime]
        for flag, value in (
            ("--root", root),
            ("--runroot", runroot),
            ("--tmpdir", tmpdir),
            ("--cgroup-manager", cgroup_manager),
            ("--events-backend", events_backend),
        ):
            if value is not None:
                args += [flag, str(value)]
        if runtime_root is not None:
            args += ["--runtime-flag", f"root={runtime_root}"]
        self.tool = RuntimeTool("podman", binary, args, criu=criu, timeout=timeout)
        self._digests: dict[str, tuple[str, ...]] = {}

    def version(self) -> str:
        return self.tool.version(["--version"], MIN_VERSION)

    # --- inspect ---------------------------------------------------------------------

    def _inspect_raw(self, ref: str) -> dict[str, Any]:
        self.version()
        proc = self.tool.run(["container", "inspect", ref], what="inspect", check=False)
        if proc.returncode != 0:
            raise NotFound(f"podman: no container {ref!r}")
        data = self.tool.json(proc, "inspect")
        if not data:
            raise NotFound(f"podman: no container {ref!r}")
        return dict(data[0])

    def inspect(self, ref: str) -> ContainerInfo:
        d = self._inspect_raw(ref)
        state = d.get("State") or {}
        running = bool(state.get("Running"))
        pids, limits = live_facts(int(state.get("Pid") or 0), running)
        image_id = f"sha256:{d['Image']}" if d.get("Image") else ""
        return ContainerInfo(
            id=str(d["Id"]),
            name=str(d.get("Name", "")),
            runtime=self.name,
            runtime_version=self.version(),
            running=running and bool(pids),
            pids=pids,
            spec=_spec_of(d, image_id),
            cgroup_limits=limits,
            image_digests=self._image_digests(image_id),
        )

    def _image_digests(self, image_id: str) -> tuple[str, ...]:
        if not image_id:
            return ()
        if image_id in self._digests:  # an image id names the same image for ever
            return self._digests[image_id]
        proc = self.tool.run(["image", "inspect", image_id], what="image inspect", check=False)
        if proc.returncode != 0:
            return ()
        img = self.tool.json(proc, "image inspect")[0]
        found = [img.get("Digest", "")] + [
            r.split("@", 1)[-1] for r in img.get("RepoDigests") or []
        ]
        self._digests[image_id] = tuple(sorted({x for x in found if x}))
        return self._digests[image_id]

    def image_present(self, image_id: str) -> bool:
        self.version()
        ref = image_id.removeprefix("sha256:")
        return (
            self.tool.run(["image", "exists", ref], what="image exists", check=False).returncode
            == 0
        )

    # --- checkpoint ------------------------------------------------------------------

    def _dump(
        self, info: ContainerInfo, dest: Path, *, leave_running: bool, arrivals: Arrivals | None
    ) -> Dumped:
        fifo = dest.parent / f".{dest.name}.export"
        args = ["container", "checkpoint", "--export", str(fifo), "--compress", "none"]
        args.append("--file-locks")
        if leave_running:
            args.append("--leave-running")
        t0 = time.monotonic()
        with TarReceiver(fifo, dest, arrivals):
            self.tool.run([*args, info.id], what="checkpoint")
        return Dumped(index_parts(dest, PARTS, PART_RUNTIME), time.monotonic() - t0)

    # --- restore ---------------------------------------------------------------------

    def restore(self, parts: CheckpointParts, *, name: str | None = None) -> ContainerInfo:
        rec = parts.container
        target = name or rec.name
        self._require_image(rec)
        self._make_room(target, rec)
        archive = parts.directory.parent / f".{parts.directory.name}.import.tar"
        args = ["container", "restore", "--import", str(archive), "--file-locks"]
        if name is not None:
            args += ["--name", name]
        try:
            pack(parts.directory, sorted(parts.parts), archive)
            proc = self.tool.run(args, what="restore")
        finally:
            archive.unlink(missing_ok=True)
        new_id = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else target
        return self.inspect(new_id)

    def _make_room(self, target: str, rec: ContainerInfo) -> None:
        """Remove the stopped container the checkpoint was taken from, so its name is free;
        refuse to touch anything else."""
        try:
            there = self.inspect(target)
        except NotFound:
            return
        if there.running:
            raise AlreadyExists(
                f"podman: container {target!r} is running; restore under a new name (--name NEW)"
            )
        if there.id != rec.id:
            raise AlreadyExists(
                f"podman: another container is named {target!r}; restore under a new name "
                "(--name NEW)"
            )
        self.remove(there.id)

    # --- cold start, cleanup ---------------------------------------------------------

    def create(self, spec: ContainerSpec, *, name: str) -> ContainerInfo:
        if not self.image_present(spec.image_id):
            raise FailedPrecondition(
                f"podman: image {spec.image_id} ({spec.image}) is not "
                "present here; gpusnap never pulls images"
            )
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
        proc = self.tool.run(
            [*args, spec.image_id.removeprefix("sha256:"), *spec.command], what="run"
        )
        return self.inspect(proc.stdout.strip().splitlines()[-1])

    def remove(self, ref: str) -> None:
        self.version()
        self.tool.run(["rm", "--force", "--ignore", "--time", "0", ref], what="rm")


def _mount_args(m: Mount) -> list[str]:
    if m.type == "tmpfs":
        return ["--tmpfs", m.destination]
    mode = "ro" if "ro" in m.options else "rw"
    return ["--volume", f"{m.source}:{m.destination}:{mode}"]


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
