"""A podman container holding (fake) GPU state, checkpointed and restored through gpusnapd.

The container runs ``workload/cudaloop.c`` against the fake ``libcuda.so.1``
(tests/fakes/libcuda), bind-mounted into it together with the fake's node directories; the
daemons' GPU workers load the same library on the host. gpusnapd freezes the container's CUDA
process by its host pid (lock, checkpoint: device memory into the process's host memory), podman
checkpoints the container, and on the other node podman restores it and gpusnapd restores the
GPU state onto that node's GPU (another UUID) and unlocks it. The token stream is a hash chain
over the device's weights and KV cache, so equal bytes mean the device memory came back whole.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.containers import ContainerSpec, Mount
from tests.containers.daemons import Daemon, Daemons, cli_json, podman_section
from tests.containers.harness import (
    TIMEOUT,
    ULIMITS,
    Node,
    image_id,
    lines,
    unique,
    wait_done,
    wait_lines,
)
from tests.containers.image import IMAGE_REF, WORKLOAD_DIR
from tests.fakes import libcuda
from tests.fakes.libcuda import A0, B0

STEPS = 300  # 6 s at 20 ms a step: still running when the test looks at the restored one
WEIGHTS_MIB = 8


@pytest.fixture(scope="module")
def cuda_dir() -> Iterator[Path]:
    """The fake libcuda.so.1 and cudaloop, built into one short host path (bind-mounted as is)."""
    if shutil.which("make") is None or shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler or make here (scripts/bootstrap.sh installs them)")
    d = Path(tempfile.mkdtemp(prefix="gpusnap-cuda-", dir="/tmp"))
    try:
        libcuda.build(d / "lib")
        cc = os.environ.get("CC", "cc")
        cmd = [
            cc,
            "-O2",
            "-o",
            str(d / "lib" / "cudaloop"),
            str(WORKLOAD_DIR / "cudaloop.c"),
            "-ldl",
        ]
        subprocess.run(
            cmd,
            check=True,
            capture_output=True,
            timeout=TIMEOUT,
        )
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _reference(cuda_dir: Path, tmp: Path) -> bytes:
    """The tokens of an uninterrupted run, on the host, on a node of its own."""
    out = tmp / "ref"
    out.mkdir()
    root = libcuda.write_node(tmp / "ref-node", [libcuda.gpu(0)])
    env = {**os.environ, "LD_LIBRARY_PATH": str(cuda_dir / "lib"), libcuda.ROOT_ENV: str(root)}
    cmd = [str(cuda_dir / "lib" / "cudaloop"), str(out), str(STEPS), "0", str(WEIGHTS_MIB)]
    subprocess.run(cmd, env=env, check=True, timeout=TIMEOUT)
    return (out / "tokens").read_bytes()


def _gpu_daemon(daemons: Daemons, name: str, node: Node, cuda_dir: Path, root: Path) -> Daemon:
    d = daemons.make(name, extra_config=podman_section(node))
    d.write_config()
    d.config_path.write_text(
        d.config_path.read_text().replace('[gpu]\ndriver = "none"\n', '[gpu]\ndriver = "cuda"\n')
    )
    d.env.update({"LD_LIBRARY_PATH": str(cuda_dir / "lib"), libcuda.ROOT_ENV: str(root)})
    return d.start()


def test_a_gpu_containers_device_memory_survives_a_checkpoint_and_a_restore_elsewhere(
    node_a: Node, node_b: Node, daemons: Daemons, cuda_dir: Path, tmp_path: Path
) -> None:
    expected = _reference(cuda_dir, tmp_path)
    nodes = cuda_dir / f"nodes-{unique('n')}"  # beside the library: one mount holds both
    root_a = libcuda.write_node(nodes / "a", [libcuda.gpu(0)])
    root_b = libcuda.write_node(nodes / "b", [libcuda.gpu(0, uuid=B0)])
    a = _gpu_daemon(daemons, "a", node_a, cuda_dir, root_a)
    b = _gpu_daemon(daemons, "b", node_b, cuda_dir, root_b)
    out = tmp_path / "out"
    out.mkdir()
    name = unique("dgpu")
    lib = cuda_dir / "lib"
    spec = ContainerSpec(
        image=IMAGE_REF,
        image_id=image_id(node_a),
        command=(str(lib / "cudaloop"), "/out", str(STEPS), "20", str(WEIGHTS_MIB)),
        env=(f"LD_LIBRARY_PATH={lib}", f"{libcuda.ROOT_ENV}={root_a}"),
        mounts=(
            Mount(str(cuda_dir), str(cuda_dir)),  # the library, and the nodes it writes to
            Mount("/out", str(out)),
        ),
        ulimits=ULIMITS,
    )
    node_a.podman.create(spec, name=name)
    try:
        wait_lines(out, STEPS // 4)
        (pid,) = node_a.podman.inspect(name).pids

        # Leave-running: frozen, checkpointed, thawed; it goes on generating on its GPU.
        first = cli_json(a, "checkpoint", "--container", name, "--leave-running", "--wait")
        gpu = cli_json(a, "show", first["checkpoint_id"])["stamp"]["gpu"]
        # (Its bytes are not counted: the fake accounts a node's memory by pids in the pid
        # namespace of each process, so the host does not see a container's; the stream below
        # is what proves the memory came back.)
        assert gpu["cuda_pids"] == [pid]
        assert [d["uuid"] for d in gpu["devices"]] == [A0]
        at = lines(out)
        wait_lines(out, at + 10)  # unlocked: its CUDA calls return again

        # Kill mode, then the other node: its own storage root and a GPU with another UUID.
        done = cli_json(a, "checkpoint", "--container", name, "--wait")
        assert lines(out) < STEPS and not node_a.podman.inspect(name).running
        assert cli_json(b, "compat", done["checkpoint_id"])["compatible"] is True
        restored = cli_json(b, "restore", done["checkpoint_id"], "--wait")
        assert restored["mode"] == "restored", restored
        assert restored["pids"] == list(node_b.podman.inspect(name).pids)
        assert wait_done(out) == expected
        assert (out / "device").read_text().strip() == B0  # remapped onto node B's GPU
    finally:
        node_a.podman.remove(name)
        node_b.podman.remove(name)
