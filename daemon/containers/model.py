"""What the runtime layer knows about a container, and the record a checkpoint's parts carry.

``ContainerSpec`` is what a cold start needs to create the container again (image, command,
environment, mounts, devices, limits); ``ContainerInfo`` is one inspected container (ids, host
pids, runtime, spec, the cgroup limits in force); ``CheckpointParts`` is a checkpoint directory
as a runtime left it, with the index of which file is which part.

The record is ``gpusnap-container.json`` at the top of a parts directory. It comes back from the
store on a restore, so ``load_parts`` checks every name it holds stays inside the directory and
names a regular file there: the manifest is authenticated upstream, but a parts directory is
also read straight from the node's staging.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from gpusnap.daemon.containers.criustats import dump_stats, pause_seconds
from gpusnap.errors import Corrupt, NotFound

# What reading a JSON document of the wrong shape (a list for an object, a string for a
# number, a missing key, an integer too large) raises: parsers catch these and say which
# document it was.
UNEXPECTED_JSON = (AttributeError, KeyError, TypeError, ValueError, OverflowError, RecursionError)

RECORD_NAME = "gpusnap-container.json"
RECORD_FORMAT = "gpusnap.container/1"

# The kinds of part a checkpoint is cut into (docs/containers.md). Every file of a parts
# directory but the record belongs to exactly one.
PART_CRIU = "criu"  # CRIU's images: pages, pagemaps, cores, fds, ...
PART_ROOTFS = "rootfs-diff"  # the container's changed files (rw layer diff, /dev/shm, deletions)
PART_CONFIG = "config"  # the runtime's container config and OCI spec
PART_RUNTIME = "runtime"  # the runtime's own metadata (state, network status, stats, logs)
PART_KINDS = (PART_CRIU, PART_ROOTFS, PART_CONFIG, PART_RUNTIME)


@dataclass(frozen=True)
class Mount:
    destination: str
    source: str
    type: str = "bind"
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class Device:
    """A device given to the container: a host node, or a CDI name (``nvidia.com/gpu=0``)."""

    path_on_host: str
    path_in_container: str = ""
    permissions: str = "rwm"


@dataclass(frozen=True)
class Ulimit:
    name: str  # "nofile", "nproc", ... (without RLIMIT_)
    soft: int
    hard: int


@dataclass(frozen=True)
class ContainerSpec:
    """Enough to create and start the container afresh (a cold start), without a registry."""

    image: str  # the reference it was created from ("localhost/tinylm:1")
    image_id: str  # the image's config digest, "sha256:..." (stable across save/load)
    command: tuple[str, ...] = ()
    entrypoint: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""
    mounts: tuple[Mount, ...] = ()
    devices: tuple[Device, ...] = ()
    ulimits: tuple[Ulimit, ...] = ()
    network: str = "none"
    # Resource limits as the runtime was asked for them: memory (bytes), cpu_quota and
    # cpu_period (microseconds), pids, cpuset. Absent means unlimited.
    resources: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ContainerInfo:
    """One container as inspected on this node."""

    id: str
    name: str
    runtime: str  # "podman" | "runc" | "containerd"
    runtime_version: str
    running: bool
    pids: tuple[int, ...]  # host pids of every process in it, init first
    spec: ContainerSpec
    # The limits the kernel enforces, read from the init process's cgroups
    # (memory.max / memory.limit_in_bytes, pids.max, cpu.max / cfs quota, cpuset).
    cgroup_limits: dict[str, str] = field(default_factory=dict)
    image_digests: tuple[str, ...] = ()  # manifest digests the image is known by here

    def summary(self) -> dict[str, str]:
        """What ``--json`` of checkpoint and restore shows as ``container``."""
        return {
            "name": self.name,
            "id": self.id,
            "runtime": self.runtime,
            "image_digest": self.spec.image_id,
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ContainerInfo:
        try:
            s = dict(d["spec"])
            spec = ContainerSpec(
                **{
                    **s,
                    "command": tuple(s.get("command", ())),
                    "entrypoint": tuple(s.get("entrypoint", ())),
                    "env": tuple(s.get("env", ())),
                    "mounts": tuple(
                        Mount(**{**m, "options": tuple(m.get("options", ()))})
                        for m in s.get("mounts", ())
                    ),
                    "devices": tuple(Device(**x) for x in s.get("devices", ())),
                    "ulimits": tuple(Ulimit(**u) for u in s.get("ulimits", ())),
                }
            )
            return cls(
                **{
                    **d,
                    "spec": spec,
                    "pids": tuple(int(p) for p in d.get("pids", ())),
                    "image_digests": tuple(d.get("image_digests", ())),
                }
            )
        except UNEXPECTED_JSON as exc:
            raise Corrupt(f"container record: {exc}") from exc


@dataclass(frozen=True)
class CheckpointParts:
    """A container checkpoint on disk: the runtime's own layout, cut into parts.

    ``parts`` maps each file (relative POSIX path) to its kind (``PART_KINDS``). The job body
    pushes ``directory`` as it is; the store chunks each file, so a part that did not change
    since the last checkpoint costs nothing to upload.
    """

    directory: Path
    container: ContainerInfo
    parts: dict[str, str]
    leave_running: bool
    seconds: float  # the runtime's checkpoint, from call to return (the container's pause
    # is inside it)
    extra: dict[str, Any] = field(default_factory=dict)  # runtime-specific facts for restore

    def sizes(self) -> dict[str, int]:
        """Bytes per kind of part."""
        out = dict.fromkeys(PART_KINDS, 0)
        for rel, kind in self.parts.items():
            out[kind] += (self.directory / rel).stat().st_size
        return out

    def criu_stats(self) -> dict[str, int]:
        """CRIU's statistics of the dump (``criustats``); empty where the parts hold none."""
        return dump_stats(self.directory, sorted(self.parts))

    def pause_seconds(self) -> float:
        """How long the container was frozen: CRIU's freezing and frozen time where it
        recorded them (podman, runc), else the runtime's whole call (the pause is inside)."""
        paused = pause_seconds(self.criu_stats())
        return self.seconds if paused is None else paused

    def record(self) -> dict[str, Any]:
        return {
            "format": RECORD_FORMAT,
            "container": self.container.as_dict(),
            "parts": self.parts,
            "leave_running": self.leave_running,
            "seconds": self.seconds,
            "extra": self.extra,
        }


@dataclass(frozen=True)
class Dumped:
    """What a runtime's own checkpoint left in ``dest``: each file with its kind, how long the
    runtime's checkpoint call took (the container's pause is inside it), and the facts its
    restore needs again."""

    parts: dict[str, str]
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


def write_parts(parts: CheckpointParts) -> CheckpointParts:
    """Write the record into the parts directory (last, atomically) and return ``parts``."""
    path = parts.directory / RECORD_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(parts.record(), indent=1, sort_keys=True))
    os.replace(tmp, path)
    return parts


def load_parts(directory: Path) -> CheckpointParts:
    """Read and check the record of a parts directory (one written by ``write_parts``)."""
    path = directory / RECORD_NAME
    try:
        rec = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise NotFound(f"{directory} is not a container checkpoint (no {RECORD_NAME})") from exc
    except (OSError, ValueError, RecursionError) as exc:
        raise Corrupt(f"{path}: {exc}") from exc
    if not isinstance(rec, dict) or rec.get("format") != RECORD_FORMAT:
        raise Corrupt(f"{path}: not a {RECORD_FORMAT} record")
    parts = rec.get("parts")
    if not isinstance(parts, dict):
        raise Corrupt(f"{path}: no parts index")
    for rel, kind in parts.items():
        check_part_name(directory, rel)
        if not isinstance(kind, str) or kind not in PART_KINDS:
            raise Corrupt(f"{path}: part {rel!r} has unknown kind {kind!r}")
    container = rec.get("container")
    extra = rec.get("extra") or {}
    seconds = rec.get("seconds", 0.0)
    if not isinstance(container, dict) or not isinstance(extra, dict):
        raise Corrupt(f"{path}: no container section")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds > 2**40:
        raise Corrupt(f"{path}: seconds is not a number of seconds")
    return CheckpointParts(
        directory=directory,
        container=ContainerInfo.from_dict(container),
        parts={str(k): str(v) for k, v in parts.items()},
        leave_running=bool(rec.get("leave_running", False)),
        seconds=float(seconds),
        extra=dict(extra),
    )


def check_part_name(directory: Path, rel: str) -> Path:
    """``directory/rel`` when ``rel`` is a plain relative path to a regular file inside it;
    ``Corrupt`` otherwise (absolute, ``..``, a symlink on the way, missing, not a file)."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or any(x in ("", ".", "..") for x in p.parts):
        raise Corrupt(f"container checkpoint part {rel!r}: not a plain relative path")
    full = directory / rel
    cur = directory
    for name in p.parts:
        cur = cur / name
        if cur.is_symlink():
            raise Corrupt(f"container checkpoint part {rel!r}: {name} is a symlink")
    if not full.is_file():
        raise Corrupt(f"container checkpoint part {rel!r}: missing from {directory}")
    return full


def index_parts(directory: Path, kind_of: dict[str, str], default: str) -> dict[str, str]:
    """Every regular file under ``directory`` (but the record) with its kind: the kind of the
    longest ``kind_of`` prefix (a file name or ``dir/``) that matches, else ``default``."""
    out: dict[str, str] = {}
    rules = sorted(kind_of.items(), key=lambda kv: -len(kv[0]))
    for root, dirs, files in os.walk(directory):
        dirs.sort()
        for name in sorted(files):
            full = Path(root, name)
            rel = full.relative_to(directory).as_posix()
            if rel == RECORD_NAME or full.is_symlink() or not full.is_file():
                continue
            out[rel] = next(
                (k for prefix, k in rules if rel == prefix or rel.startswith(prefix)), default
            )
    return out
