"""Container runtimes: inspect, checkpoint into parts, restore, cold-start containers.

One small interface (``ContainerRuntime``) with an implementation per runtime — podman
(``podman.py``), runc (``runc.py``), containerd through ``ctr`` (``containerd.py``) — each
driving the runtime's own command-line tool, and ``open_runtime`` to pick one by name. The job
bodies freeze GPU state on ``inspect(ref).pids``, call ``checkpoint`` into staging and push the
parts directory; a restore pulls it, calls ``restore`` and thaws GPU state on the returned pids.
``container_mismatches`` gives the compatibility gate its container reasons; ``RuntimeSet``
holds one node's runtimes, made once from their options. docs/containers.md
describes the layer, what each runtime needs, and what fails.

Imports nothing of gpusnap's but ``gpusnap.errors``, itself and ``daemon.host`` (its /proc
reader, ``host/proctree.py``, for a container's host pids and cgroup limits): no other daemon
module, no storage, no proto.
"""

from __future__ import annotations

from gpusnap.daemon.containers.archive import Arrivals
from gpusnap.daemon.containers.compat import Mismatch, container_mismatches, container_reasons
from gpusnap.daemon.containers.containerd import ContainerdRuntime
from gpusnap.daemon.containers.model import (
    PART_CONFIG,
    PART_CRIU,
    PART_KINDS,
    PART_ROOTFS,
    PART_RUNTIME,
    RECORD_NAME,
    CheckpointParts,
    ContainerInfo,
    ContainerSpec,
    Device,
    Mount,
    Ulimit,
    load_parts,
)
from gpusnap.daemon.containers.podman import PodmanRuntime
from gpusnap.daemon.containers.runc import RuncRuntime
from gpusnap.daemon.containers.runtime import ContainerRuntime
from gpusnap.daemon.containers.runtimes import RUNTIMES, RuntimeSet, open_runtime
from gpusnap.errors import NotFound, Unsupported


def detect_runtime(ref: str, candidates: list[ContainerRuntime]) -> ContainerRuntime:
    """The first of ``candidates`` that has a container ``ref`` (``[[workload]]`` without
    ``runtime``). Runtimes that are missing on this node are skipped."""
    missing: list[str] = []
    for rt in candidates:
        try:
            rt.inspect(ref)
        except NotFound:
            continue
        except Unsupported as err:
            missing.append(str(err))
            continue
        return rt
    names = ", ".join(rt.name for rt in candidates)
    extra = f" ({'; '.join(missing)})" if missing else ""
    raise NotFound(f"no container {ref!r} in {names}{extra}")


__all__ = [
    "PART_CONFIG",
    "PART_CRIU",
    "PART_KINDS",
    "PART_ROOTFS",
    "PART_RUNTIME",
    "RECORD_NAME",
    "RUNTIMES",
    "Arrivals",
    "CheckpointParts",
    "ContainerInfo",
    "ContainerRuntime",
    "ContainerSpec",
    "ContainerdRuntime",
    "Device",
    "Mismatch",
    "Mount",
    "PodmanRuntime",
    "RuncRuntime",
    "RuntimeSet",
    "Ulimit",
    "container_mismatches",
    "container_reasons",
    "detect_runtime",
    "load_parts",
    "open_runtime",
]
