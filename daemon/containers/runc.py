"""runc (>= 1.1) directly: ``runc checkpoint --image-path`` into parts, bundles gpusnap lays out.

runc has no image store and no layers: a container is a bundle (``config.json`` and a rootfs
directory) someone else prepared. So that a runc checkpoint can restore on another node, this
layer's convention is the one containerd's snapshotters use: the rootfs is an overlay whose
lower layer is an image directory ``IMAGES/<hex>/rootfs`` (``<hex>`` the image id) and whose
upper directory is the container's changes; ``config.json`` names the image in the annotation
``io.gpusnap.image.id``. ``create`` lays out such a bundle; a bundle made otherwise still
checkpoints and restores in place (its rootfs is not copied), but not elsewhere.

Parts: ``criu/`` (CRIU's images), ``rootfs-diff.tar`` (the overlay's upper directory),
``config.json`` (the OCI spec), ``runtime/`` (runc's ``state.json``, CRIU's dump log).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

from gpusnap.daemon.containers.archive import Arrivals
from gpusnap.daemon.containers.model import (
    PART_CONFIG,
    PART_CRIU,
    PART_ROOTFS,
    PART_RUNTIME,
    CheckpointParts,
    ContainerInfo,
    ContainerSpec,
    Dumped,
    index_parts,
)
from gpusnap.daemon.containers.oci import overlay_upper, spec_from_oci, spec_to_oci
from gpusnap.daemon.containers.openfiles import criu_images
from gpusnap.daemon.containers.runtime import (
    DEFAULT_CRIU,
    DEFAULT_TIMEOUT,
    ContainerRuntime,
    RuntimeTool,
    last_line,
)
from gpusnap.daemon.host.openfiles import Fitted, fit_tree, recorded_sizes
from gpusnap.errors import AlreadyExists, FailedPrecondition, NotFound

log = logging.getLogger(__name__)

IMAGE_ANNOTATION = "io.gpusnap.image.id"
PARTS = {
    "criu/": PART_CRIU,
    "rootfs-diff.tar": PART_ROOTFS,
    "config.json": PART_CONFIG,
}


def _upper_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """An overlay upper directory: files, dirs, links inside it, and whiteouts (0:0 char
    devices); never another device, never a path or link out of ``dest``."""
    if member.ischr() and (member.devmajor, member.devminor) != (0, 0):
        raise tarfile.FilterError(f"{member.name}: a device in a rootfs diff")
    if member.isblk() or member.isfifo():
        raise tarfile.FilterError(f"{member.name}: a device in a rootfs diff")
    return tarfile.tar_filter(member, dest)


class RuncRuntime(ContainerRuntime):
    """Containers of one runc state root, with bundles and images under gpusnap's dirs."""

    name = "runc"
    min_version = (1, 1)

    def __init__(
        self,
        *,
        root: Path | None = None,
        bundles: Path = Path("/var/lib/gpusnap/runc/bundles"),
        images: Path = Path("/var/lib/gpusnap/runc/images"),
        binary: str = "runc",
        criu: Path = DEFAULT_CRIU,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        args = ["--root", str(root)] if root is not None else []
        self.tool = RuntimeTool("runc", binary, args, criu=criu, timeout=timeout)
        self.bundles = bundles
        self.images = images

    def _state(self, ref: str) -> dict[str, Any]:
        self.version()
        proc = self.tool.run(["state", ref], what="state", check=False)
        if proc.returncode != 0:
            raise NotFound(f"runc: no container {ref!r}")
        return dict(self.tool.json(proc, "state"))

    def inspect(self, ref: str) -> ContainerInfo:
        st = self._state(ref)
        bundle = Path(st["bundle"])
        config = json.loads((bundle / "config.json").read_text())
        annotations = config.get("annotations") or {}
        return self._container(
            id=str(st["id"]),
            name=str(st["id"]),
            init_pid=int(st.get("pid") or 0),
            running=st.get("status") == "running",
            spec=spec_from_oci(config, image_id=str(annotations.get(IMAGE_ANNOTATION, ""))),
        )

    def image_present(self, image_id: str) -> bool:
        return bool(image_id) and self._image_rootfs(image_id).is_dir()

    def _image_rootfs(self, image_id: str) -> Path:
        return self.images / image_id.removeprefix("sha256:") / "rootfs"

    # --- checkpoint ------------------------------------------------------------------

    def _dump(
        self, info: ContainerInfo, dest: Path, *, leave_running: bool, arrivals: Arrivals | None
    ) -> Dumped:
        ref = info.id
        st = self._state(ref)
        bundle = Path(st["bundle"])
        work = dest / "runtime"
        work.mkdir()
        args = ["checkpoint", "--image-path", str(dest / "criu"), "--work-path", str(work)]
        args += ["--file-locks"]
        if leave_running:
            args.append("--leave-running")
        t0 = time.monotonic()
        self.tool.run([*args, ref], what="checkpoint")
        seconds = time.monotonic() - t0
        shutil.copyfile(bundle / "config.json", dest / "config.json")
        upper = overlay_upper(Path(st.get("rootfs") or bundle / "rootfs"))
        if upper is not None:
            with tarfile.open(dest / "rootfs-diff.tar", "w", format=tarfile.PAX_FORMAT) as t:
                t.add(upper, arcname=".")
        state_file = self._state_dir(ref) / "state.json"
        if state_file.exists():
            shutil.copyfile(state_file, work / "state.json")
        extra = {"bundle": str(bundle), "rootfs_diff": upper is not None}
        return Dumped(index_parts(dest, PARTS, PART_RUNTIME), seconds, extra)

    def _state_dir(self, ref: str) -> Path:
        base = self.tool.base_args
        root = Path(base[1]) if base[:1] == ["--root"] else Path("/run/runc")
        return root / ref

    # --- restore ---------------------------------------------------------------------

    def restore(self, parts: CheckpointParts, *, name: str | None = None) -> ContainerInfo:
        rec = parts.container
        target = name or rec.name
        self._make_room(target, rec)
        recorded = self._in_place_bundle(parts, target)
        if recorded is not None:
            bundle = recorded
        else:
            if not parts.extra.get("rootfs_diff"):
                raise FailedPrecondition(
                    f"runc: container {rec.name!r} had no overlay rootfs; it restores only in "
                    f"place, from its bundle {parts.extra.get('bundle', '')}"
                )
            if not self.image_present(rec.spec.image_id):
                raise FailedPrecondition(
                    f"runc: image {rec.spec.image_id} of container {rec.name!r} is not present "
                    f"here (no {self._image_rootfs(rec.spec.image_id or 'none')})"
                )
            config = json.loads((parts.directory / "config.json").read_text())
            bundle = self._lay_bundle(target, config, rec.spec.image_id)
            with tarfile.open(parts.directory / "rootfs-diff.tar") as t:
                t.extractall(bundle / "upper", filter=_upper_filter)  # noqa: S202 (filtered)
            self._mount_rootfs(bundle, rec.spec.image_id)
        work = parts.directory.parent / f".{parts.directory.name}.restore"
        work.mkdir(exist_ok=True)
        args = ["restore", "--detach", "--image-path", str(parts.directory / "criu")]
        args += ["--work-path", str(work), "--bundle", str(bundle), "--file-locks", target]
        try:
            self._run_detached(args, bundle, what="restore")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return self.inspect(target)

    def _in_place_bundle(self, parts: CheckpointParts, target: str) -> Path | None:
        """The checkpointed container's own bundle, where a restore as ``target`` runs from it
        again (the same name, the bundle still there); None where it lays a new one."""
        recorded = Path(str(parts.extra.get("bundle", "")))
        if target == parts.container.name and (recorded / "config.json").is_file():
            return recorded
        return None

    def fit_open_files(self, parts: CheckpointParts, *, name: str | None = None) -> list[Fitted]:
        # In place the rw layer is the bundle's upper directory as the container left it, not
        # the checkpoint's diff.
        bundle = self._in_place_bundle(parts, name or parts.container.name)
        images = criu_images(parts)
        if bundle is None or images is None:
            return super().fit_open_files(parts, name=name)
        config = json.loads((bundle / "config.json").read_text())
        root = Path(str((config.get("root") or {}).get("path", "rootfs")))
        upper = overlay_upper(root if root.is_absolute() else bundle / root)
        # Not an overlay: no rw layer apart from the image, and nothing of it is cut.
        return fit_tree(upper, recorded_sizes(images)) if upper is not None else []

    def _discard(self, stopped: ContainerInfo) -> None:
        # Not ``remove``: an in-place restore runs from this container's bundle again.
        self.tool.run(["delete", "--force", stopped.id], what="delete")

    # --- bundles, cold start, cleanup ------------------------------------------------

    def _lay_bundle(self, name: str, config: dict[str, Any], image_id: str) -> Path:
        bundle = self.bundles / name
        if bundle.exists():
            raise AlreadyExists(f"runc: a bundle for {name!r} exists at {bundle}")
        for d in ("rootfs", "upper", "work"):
            (bundle / d).mkdir(parents=True)
        config = dict(config)
        config["root"] = {**(config.get("root") or {}), "path": str(bundle / "rootfs")}
        config.setdefault("annotations", {})[IMAGE_ANNOTATION] = image_id
        (bundle / "config.json").write_text(json.dumps(config, indent=1))
        return bundle

    def _mount_rootfs(self, bundle: Path, image_id: str) -> None:
        lower = self._image_rootfs(image_id)
        opts = f"lowerdir={lower},upperdir={bundle / 'upper'},workdir={bundle / 'work'}"
        proc = subprocess.run(
            ["mount", "-t", "overlay", "overlay", "-o", opts, str(bundle / "rootfs")],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise FailedPrecondition(f"runc: cannot mount the rootfs of {bundle}: {proc.stderr}")

    def _run_detached(self, args: list[str], bundle: Path, *, what: str) -> None:
        # The container's stdout and stderr are a pipe to a small pump appending to
        # stdio.log, as conmon does for podman: CRIU dumps a pipe as external and runc hands the
        # restored process the new one, where a file on the host is a mount CRIU cannot find;
        # and a pipe we read ourselves would kill a detached container with SIGPIPE once we
        # let go of it. runc's own errors go to runc.log.
        runc_log = bundle / "runc.log"
        runc_log.unlink(missing_ok=True)
        r, w = os.pipe()
        try:
            subprocess.run(
                ["sh", "-c", 'cat >> "$0" &', str(bundle / "stdio.log")],
                stdin=r,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                check=True,
                timeout=30,
            )
            cmd = [self.tool.binary(), "--log", str(runc_log), *self.tool.base_args, *args]
            proc = subprocess.run(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=w,
                stderr=w,
                env=self.tool.environ(),
                timeout=self.tool.timeout,
                check=False,
            )
        finally:
            os.close(r)
            os.close(w)
        if proc.returncode != 0:
            text = runc_log.read_text(errors="replace") if runc_log.exists() else ""
            raise FailedPrecondition(f"runc {what} failed: {last_line(text)}")

    def create(self, spec: ContainerSpec, *, name: str) -> ContainerInfo:
        if not self.image_present(spec.image_id):
            raise FailedPrecondition(f"runc: image {spec.image_id} is not present here")
        self.version()
        scratch = self.bundles / f".{name}.spec"
        scratch.mkdir(parents=True, exist_ok=True)
        try:
            self.tool.run(["spec", "--bundle", str(scratch)], what="spec")
            template = json.loads((scratch / "config.json").read_text())
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        bundle = self._lay_bundle(name, spec_to_oci(spec, template), spec.image_id)
        self._mount_rootfs(bundle, spec.image_id)
        self._run_detached(["run", "--detach", "--bundle", str(bundle), name], bundle, what="run")
        return self.inspect(name)

    def remove(self, ref: str) -> None:
        self.version()
        self.tool.run(["delete", "--force", ref], what="delete", check=False)
        bundle = self.bundles / ref
        if (bundle / "upper").is_dir():  # one of ours: unmount and remove it
            subprocess.run(["umount", str(bundle / "rootfs")], capture_output=True, check=False)
            shutil.rmtree(bundle, ignore_errors=True)
