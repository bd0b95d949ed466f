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

import logging
import time
from pathlib import Path
from typing import Any

from gpusnap.daemon.containers.archive import Arrivals, TarReceiver, pack
from gpusnap.daemon.containers.model import CheckpointParts, ContainerInfo, ContainerSpec, Dumped
from gpusnap.daemon.containers.podman_format import parts_of, run_args, spec_of
from gpusnap.daemon.containers.runtime import (
    DEFAULT_CRIU,
    DEFAULT_TIMEOUT,
    ContainerRuntime,
    RuntimeTool,
)
from gpusnap.errors import FailedPrecondition, InvalidArgument, NotFound

log = logging.getLogger(__name__)

MAX_RUNROOT = 50  # podman refuses a longer runroot path ("runroot ... is too long")


class PodmanRuntime(ContainerRuntime):
    """Containers of one podman storage root."""

    name = "podman"
    min_version = (4, 0)

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
        image_id = f"sha256:{d['Image']}" if d.get("Image") else ""
        return self._container(
            id=str(d["Id"]),
            name=str(d.get("Name", "")),
            init_pid=int(state.get("Pid") or 0),
            running=bool(state.get("Running")),
            spec=spec_of(d, image_id),
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
        return Dumped(parts_of(dest), time.monotonic() - t0)

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

    # --- cold start, cleanup ---------------------------------------------------------

    def create(self, spec: ContainerSpec, *, name: str) -> ContainerInfo:
        if not self.image_present(spec.image_id):
            raise FailedPrecondition(
                f"podman: image {spec.image_id} ({spec.image}) is not "
                "present here; gpusnap never pulls images"
            )
        proc = self.tool.run(
            [*run_args(spec, name), spec.image_id.removeprefix("sha256:"), *spec.command],
            what="run",
        )
        return self.inspect(proc.stdout.strip().splitlines()[-1])

    def remove(self, ref: str) -> None:
        self.version()
        self.tool.run(["rm", "--force", "--ignore", "--time", "0", ref], what="rm")
