"""The ``container`` section of a container checkpoint's stamp: written, read back, judged.

A container checkpoint's stamp is a process checkpoint's (host, gpusnap, engine, model, files,
gpu, process) plus ``container``: the runtime and its version, the container's name and id,
the image (reference, ``image_digest``: the image id the rw-layer diff sits on, and the
manifest digests it is known by), its config (what a cold start creates it from: command,
environment, mounts, devices, ulimits, network, resource limits, annotations), the cgroup
limits in force, the devices it was given (device nodes or CDI names), its processes (host pids
and their pids in the container's namespace) and the bytes of each kind of part.

``container_gate`` adds the container rules to the compatibility gate (docs/compat.md):
runtime, its major version, the image present here. ``remap_gpu_stamp`` moves the GPU section
from the checkpointed host pids to the restored ones: a restored container keeps its
namespace's pids, not its host pids.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from gpusnap.daemon.containers import (
    CheckpointParts,
    ContainerInfo,
    Device,
    RuntimeSet,
    container_mismatches,
)
from gpusnap.daemon.gate.verdict import Reason
from gpusnap.errors import Corrupt, GpusnapError

# A CDI device name: "vendor.com/class=name" (the Container Device Interface spec).
_CDI = re.compile(r"^[a-z0-9][a-z0-9.-]*/[a-zA-Z0-9][a-zA-Z0-9_.-]*=[a-zA-Z0-9_.:-]+$")


def devices_stamp(devices: Sequence[Device]) -> list[dict[str, str]]:
    """The devices given to the container: CDI names as ``{"cdi": NAME}``, device nodes as
    ``{"path", "container_path", "permissions"}``."""
    out: list[dict[str, str]] = []
    for d in devices:
        if _CDI.match(d.path_on_host):
            out.append({"cdi": d.path_on_host})
        else:
            out.append(
                {
                    "path": d.path_on_host,
                    "container_path": d.path_in_container or d.path_on_host,
                    "permissions": d.permissions,
                }
            )
    return out


def container_stamp(
    info: ContainerInfo, parts: CheckpointParts, ns: Mapping[int, int]
) -> dict[str, Any]:
    """The stamp's ``container`` section for ``info`` checkpointed into ``parts``; ``ns`` maps
    its host pids to their pids in its namespace."""
    spec = info.spec
    return {
        **info.summary(),
        "runtime_version": info.runtime_version,
        "image": spec.image,
        "image_digests": list(info.image_digests),
        "config": dataclasses.asdict(spec),
        "cgroup_limits": dict(info.cgroup_limits),
        "devices": devices_stamp(spec.devices),
        "pids": list(info.pids),
        "ns_pids": [[pid, ns[pid]] for pid in info.pids if pid in ns],
        "parts": parts.sizes(),
        "leave_running": parts.leave_running,
    }


def is_container(stamp: Mapping[str, Any]) -> bool:
    return isinstance(stamp.get("container"), Mapping)


def recorded_container(stamp: Mapping[str, Any]) -> ContainerInfo:
    """The container as the stamp recorded it (``Corrupt`` when the section is malformed)."""
    c = stamp.get("container")
    if not isinstance(c, Mapping):
        raise Corrupt("the checkpoint's stamp has no container section")
    return ContainerInfo.from_dict(
        {
            "id": c.get("id"),
            "name": c.get("name"),
            "runtime": c.get("runtime"),
            "runtime_version": c.get("runtime_version", ""),
            "running": True,
            "pids": c.get("pids") or [],
            "spec": c.get("config") or {},
            "cgroup_limits": dict(c.get("cgroup_limits") or {}),
            "image_digests": c.get("image_digests") or [],
        }
    )


def recorded_ns_pids(stamp: Mapping[str, Any]) -> dict[int, int]:
    """Host pid -> namespace pid of the checkpointed container's processes."""
    c = stamp.get("container")
    pairs = c.get("ns_pids") if isinstance(c, Mapping) else None
    out: dict[int, int] = {}
    for pair in pairs if isinstance(pairs, list) else []:
        if isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, int) for x in pair):
            out[pair[0]] = pair[1]
    return out


def container_gate(runtimes: RuntimeSet, stamp: Mapping[str, Any]) -> list[Reason]:
    """The container rules' reasons (empty for a process checkpoint, or when it fits)."""
    if not is_container(stamp):
        return []
    try:
        recorded = recorded_container(stamp)
    except Corrupt as err:
        return [Reason("container", "a container record", "unreadable", str(err))]
    try:
        rt = runtimes.get(recorded.runtime)
    except GpusnapError as err:
        return [
            Reason(
                "container.runtime",
                recorded.runtime,
                "(unusable)",
                f"container runtime unusable here: {err}",
            )
        ]
    return [
        Reason(m.field, m.expected, m.actual, m.message) for m in container_mismatches(recorded, rt)
    ]


def remap_gpu_stamp(
    gpu_stamp: Mapping[str, Any], before: Mapping[int, int], after: Mapping[int, int]
) -> dict[str, Any]:
    """``gpu_stamp`` with each checkpointed host pid replaced by the restored process's host
    pid: ``before`` and ``after`` map host pids to namespace pids at checkpoint and now."""
    by_ns = {ns: host for host, ns in after.items()}
    moved = {old: by_ns[ns] for old, ns in before.items() if ns in by_ns}
    out = dict(gpu_stamp)
    if isinstance(out.get("cuda_pids"), list):
        out["cuda_pids"] = [moved.get(int(p), int(p)) for p in out["cuda_pids"]]
    if isinstance(out.get("memory_files"), list):
        out["memory_files"] = [
            {**m, "pid": moved.get(int(m["pid"]), int(m["pid"]))}
            for m in out["memory_files"]
            if isinstance(m, Mapping)
        ]
    return out
