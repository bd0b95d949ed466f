"""containerd (>= 1.6) through ``ctr``: a checkpoint image, exported as an OCI layout, as parts.

``ctr containers checkpoint --task --rw`` makes a checkpoint image in containerd's content store
(the task keeps running; a kill-mode checkpoint kills it after); ``ctr image export
--skip-manifest-json`` writes it as an OCI layout into a FIFO that is unpacked as it comes. Its
blobs are the parts, classified by the media types the checkpoint index gives them: the CRIU
images (one uncompressed tar), the rw layer (a gzipped tar), the container spec and the runtime
options. A restore packs the layout again, ``ctr image import --no-unpack``s it and ``ctr
containers restore --live --rw``s the container; the container's image must be here.

``ctr`` pauses the task for the whole checkpoint and diffs the rw layer while it is paused, so a
file the container holds open there is in the rw blob at the size CRIU recorded, even after a
leave-running checkpoint: unlike podman's and runc's, nothing needs fitting (``openfiles.py``).

The image id is the image's target digest in containerd's store (``ctr images ls``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from gpusnap.daemon.containers.archive import Arrivals, TarReceiver, pack
from gpusnap.daemon.containers.containerd_format import parts_of_layout
from gpusnap.daemon.containers.model import CheckpointParts, ContainerInfo, ContainerSpec, Dumped
from gpusnap.daemon.containers.oci import spec_from_oci
from gpusnap.daemon.containers.runtime import (
    DEFAULT_CRIU,
    DEFAULT_TIMEOUT,
    ContainerRuntime,
    RuntimeTool,
)
from gpusnap.errors import AlreadyExists, FailedPrecondition, NotFound

log = logging.getLogger(__name__)

CHECKPOINT_REPO = "gpusnap-checkpoint"


class ContainerdRuntime(ContainerRuntime):
    """Containers of one containerd daemon and namespace."""

    name = "containerd"
    min_version = (1, 6)
    version_args = ("version",)

    def __init__(
        self,
        *,
        address: Path = Path("/run/containerd/containerd.sock"),
        namespace: str = "default",
        binary: str = "ctr",
        criu: Path = DEFAULT_CRIU,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        args = ["--address", str(address), "--namespace", namespace]
        self.tool = RuntimeTool("containerd", binary, args, criu=criu, timeout=timeout)

    def _images(self) -> dict[str, str]:
        """Image name → target digest."""
        proc = self.tool.run(["images", "ls"], what="images ls")
        out: dict[str, str] = {}
        for line in proc.stdout.splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 3:
                out[fields[0]] = fields[2]
        return out

    def _task(self, ref: str) -> tuple[int, bool]:
        proc = self.tool.run(["tasks", "ls"], what="tasks ls")
        for line in proc.stdout.splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 3 and fields[0] == ref:
                return int(fields[1]), fields[2] == "RUNNING"
        return 0, False

    def inspect(self, ref: str) -> ContainerInfo:
        self.version()
        proc = self.tool.run(["containers", "info", ref], what="info", check=False)
        if proc.returncode != 0:
            raise NotFound(f"containerd: no container {ref!r}")
        d = self.tool.json(proc, "info")
        pid, running = self._task(ref)
        image = str(d.get("Image", ""))
        digest = self._images().get(image, "")
        return self._container(
            id=str(d["ID"]),
            name=str(d["ID"]),
            init_pid=pid,
            running=running,
            spec=spec_from_oci(d.get("Spec") or {}, image_id=digest, image=image),
            image_digests=(digest,) if digest else (),
        )

    def image_present(self, image_id: str) -> bool:
        self.version()
        return bool(image_id) and image_id in self._images().values()

    def _dump(
        self, info: ContainerInfo, dest: Path, *, leave_running: bool, arrivals: Arrivals | None
    ) -> Dumped:
        ref = info.id
        image = f"localhost/{CHECKPOINT_REPO}/{ref}:{time.time_ns()}"
        fifo = dest.parent / f".{dest.name}.export"
        t0 = time.monotonic()
        self.tool.run(["containers", "checkpoint", "--task", "--rw", ref, image], what="checkpoint")
        seconds = time.monotonic() - t0
        if not leave_running:
            self._stop(ref)
        try:
            with TarReceiver(fifo, dest, arrivals):
                self.tool.run(
                    ["images", "export", "--skip-manifest-json", str(fifo), image], what="export"
                )
        finally:
            self.tool.run(["images", "rm", image], what="images rm", check=False)
        return Dumped(parts_of_layout(dest), seconds, {"checkpoint_image": image})

    def _still_running(self, ref: str) -> bool:
        return self._task(ref)[1]

    def _stop(self, ref: str) -> None:
        self.tool.run(["tasks", "kill", "--signal", "SIGKILL", ref], what="kill", check=False)
        deadline = time.monotonic() + 60
        while self._task(ref)[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        self.tool.run(["tasks", "rm", "--force", ref], what="tasks rm", check=False)

    def restore(self, parts: CheckpointParts, *, name: str | None = None) -> ContainerInfo:
        rec = parts.container
        target = name or rec.name
        self._require_image(rec)
        try:
            there = self.inspect(target)
        except NotFound:
            there = None
        if there is not None:
            if there.running or target != rec.name:
                raise AlreadyExists(
                    f"containerd: container {target!r} exists; restore under a new name "
                    "(--name NEW)"
                )
            self.remove(target)
        image = str(parts.extra.get("checkpoint_image", ""))
        archive = parts.directory.parent / f".{parts.directory.name}.import.tar"
        try:
            pack(parts.directory, sorted(parts.parts), archive)
            self.tool.run(["images", "import", "--no-unpack", str(archive)], what="import")
            self.tool.run(
                ["containers", "restore", "--live", "--rw", target, image], what="restore"
            )
        finally:
            archive.unlink(missing_ok=True)
            self.tool.run(["images", "rm", image], what="images rm", check=False)
        return self.inspect(target)

    def create(self, spec: ContainerSpec, *, name: str) -> ContainerInfo:
        if not self.image_present(spec.image_id):
            raise FailedPrecondition(f"containerd: image {spec.image_id} is not present here")
        args = ["run", "--detach", "--null-io"]
        for m in spec.mounts:
            opts = ":".join(sorted(set(m.options) | {"rbind"}))
            args += ["--mount", f"type=bind,src={m.source},dst={m.destination},options={opts}"]
        for e in spec.env:
            args += ["--env", e]
        if spec.network == "host":
            args.append("--net-host")
        self.tool.run([*args, spec.image, name, *spec.entrypoint, *spec.command], what="run")
        return self.inspect(name)

    def remove(self, ref: str) -> None:
        self.version()
        self._stop(ref)
        self.tool.run(["containers", "rm", ref], what="rm", check=False)
