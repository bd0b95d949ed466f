"""The container section of a stamp: written from a container and its parts, read back the
same, judged by the gate, and the GPU section moved onto a restored container's host pids."""

from __future__ import annotations

from pathlib import Path

from gpusnap.daemon.containers import (
    CheckpointParts,
    ContainerInfo,
    ContainerSpec,
    Device,
    Mount,
    RuntimeSet,
    Ulimit,
)
from gpusnap.daemon.gate.container_stamp import (
    container_gate,
    container_stamp,
    devices_stamp,
    recorded_container,
    recorded_ns_pids,
    remap_gpu_stamp,
)

INFO = ContainerInfo(
    id="c0ffee",
    name="llm",
    runtime="podman",
    runtime_version="4.3.1",
    running=True,
    pids=(4100, 4107),
    spec=ContainerSpec(
        image="localhost/llm:1",
        image_id="sha256:" + "ab" * 32,
        command=("python3", "serve.py"),
        env=("A=1",),
        mounts=(Mount("/models", "/srv/models", options=("ro",)),),
        devices=(Device("/dev/nvidia0", "/dev/nvidia0"), Device("nvidia.com/gpu=0")),
        ulimits=(Ulimit("nofile", 20000, 20000),),
        resources={"memory": "1073741824"},
    ),
    cgroup_limits={"memory": "1073741824", "pids": "max"},
    image_digests=("sha256:" + "cd" * 32,),
)


def test_devices_are_recorded_as_nodes_or_cdi_names() -> None:
    assert devices_stamp(INFO.spec.devices) == [
        {"path": "/dev/nvidia0", "container_path": "/dev/nvidia0", "permissions": "rwm"},
        {"cdi": "nvidia.com/gpu=0"},
    ]


def test_the_section_reads_back_as_the_container_it_recorded(tmp_path: Path) -> None:
    (tmp_path / "pages-1.img").write_bytes(b"p" * 100)
    parts = CheckpointParts(tmp_path, INFO, {"pages-1.img": "criu"}, False, 0.5)
    c = container_stamp(INFO, parts, {4100: 1, 4107: 9})
    assert {k: c[k] for k in ("name", "id", "runtime", "image_digest")} == INFO.summary()
    assert c["parts"] == {"criu": 100, "rootfs-diff": 0, "config": 0, "runtime": 0}
    assert c["cgroup_limits"] == INFO.cgroup_limits and c["leave_running"] is False
    stamp = {"container": c}
    assert recorded_container(stamp) == INFO
    assert recorded_ns_pids(stamp) == {4100: 1, 4107: 9}


def test_the_gpu_section_moves_to_the_restored_host_pids_by_namespace_pid() -> None:
    gpu = {
        "present": True,
        "cuda_pids": [4100, 4107],
        "memory_files": [{"pid": 4107, "uuid": "GPU-a", "path": "gpu-memory/4107/0-GPU-a.bin"}],
    }
    moved = remap_gpu_stamp(gpu, {4100: 1, 4107: 9}, {7300: 1, 7311: 9, 7320: 12})
    assert moved["cuda_pids"] == [7300, 7311]
    assert moved["memory_files"] == [
        {"pid": 7311, "uuid": "GPU-a", "path": "gpu-memory/4107/0-GPU-a.bin"}  # same stream
    ]
    assert gpu["cuda_pids"] == [4100, 4107]  # the stamp itself is left alone


def test_the_gate_names_a_runtime_this_node_cannot_use(tmp_path: Path) -> None:
    stamp = {"container": container_stamp(INFO, CheckpointParts(tmp_path, INFO, {}, True, 0), {})}
    missing = tmp_path / "no-podman"
    (reason,) = container_gate(RuntimeSet({"podman": {"binary": str(missing)}}), stamp)
    assert reason.field == "container.runtime_version" and reason.expected == "4.3.1"
    assert f"container runtime unusable here: podman: {missing} not found" in reason.message
    assert container_gate(RuntimeSet(), {"process": {}}) == []  # a process tree's stamp
    (bad,) = container_gate(RuntimeSet(), {"container": {"id": "x"}})
    assert bad.field == "container" and "container record" in bad.message
