"""containerd containers checkpointed into parts and restored, through ``ctr`` and a containerd
the test starts itself (its own root, state dir and socket, the CRI plugin disabled)."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.containers import CheckpointParts, ContainerdRuntime, load_parts
from gpusnap.daemon.host.openfiles import recorded_sizes
from tests.containers.daemons import Daemons, cli_json, start_daemon
from tests.containers.harness import STEPS_DEFAULT as STEPS
from tests.containers.harness import (
    genloop_spec_for,
    lines,
    new_loop,
    removing,
    started,
    wait_done,
    wait_lines,
)
from tests.containers.image import IMAGE_REF


@pytest.fixture(scope="module")
def containerd(image: Path) -> Iterator[ContainerdRuntime]:
    if shutil.which("containerd") is None or shutil.which("ctr") is None:
        pytest.skip("containerd missing: run scripts/install-containers.sh")
    d = Path(tempfile.mkdtemp(prefix="gpusnap-ctrd-", dir="/tmp"))
    sock = d / "sock"
    (d / "config.toml").write_text(
        f'version = 2\nroot = "{d}/root"\nstate = "{d}/state"\n'
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
        f'[grpc]\n  address = "{sock}"\n'
    )
    with open(d / "containerd.log", "wb") as log:
        proc = subprocess.Popen(
            ["containerd", "--config", str(d / "config.toml")],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
    rt = ContainerdRuntime(address=sock, namespace="gpusnap-test")
    try:
        deadline = time.monotonic() + 60
        while rt.tool.run(["version"], what="version", check=False).returncode != 0:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.skip(f"containerd did not start: see {d}/containerd.log")
            time.sleep(0.2)
        rt.tool.run(
            ["images", "import", "--base-name", IMAGE_REF.split(":")[0], str(image)],
            what="import",
            timeout=300,
        )
        yield rt
    finally:
        for line in rt.tool.run(["containers", "ls", "-q"], what="ls", check=False).stdout.split():
            rt.remove(line)
        proc.terminate()
        proc.wait(timeout=60)
        subprocess.run(["umount", "-R", str(d / "state")], capture_output=True, check=False)
        shutil.rmtree(d, ignore_errors=True)


def _image_id(rt: ContainerdRuntime) -> str:
    return rt._images()[IMAGE_REF]


def test_containerd_restore_in_place_continues_bit_exactly(
    containerd: ContainerdRuntime, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "ctrd", STEPS)
    spec = genloop_spec_for(_image_id(containerd), out, steps=STEPS)
    with started(containerd, spec, name):
        wait_lines(out, STEPS // 3)
        parts = containerd.checkpoint(name, tmp_path / "ckpt", leave_running=False)
        assert lines(out) < STEPS
        assert {"criu", "rootfs-diff", "config"} <= set(parts.parts.values())
        print(f"FIGURE containerd_checkpoint seconds={parts.seconds:.3f} sizes={parts.sizes()}")
        restored = containerd.restore(load_parts(parts.directory))
        assert restored.running
        assert wait_done(out) == expected


def test_containerd_leave_running_checkpoint_restores_under_a_new_name(
    containerd: ContainerdRuntime, tmp_path: Path
) -> None:
    out, name, expected = new_loop(tmp_path, "ctrd", STEPS)
    with (
        started(
            containerd, genloop_spec_for(_image_id(containerd), out, steps=STEPS), name
        ) as before,
        removing(containerd, f"{name}-copy"),
    ):
        wait_lines(out, STEPS // 3)
        parts = containerd.checkpoint(name, tmp_path / "ckpt", leave_running=True)
        assert containerd.inspect(name).pids == before.pids
        assert wait_done(out) == expected
        containerd.restore(load_parts(parts.directory), name=f"{name}-copy")
        assert wait_done(out) == expected


def test_containerd_container_checkpointed_by_gpusnapd_restores_in_place_bit_exactly(
    containerd: ContainerdRuntime, daemons: Daemons, tmp_path: Path
) -> None:
    steps = 300  # still running when the test looks at the restored container
    out, name, expected = new_loop(tmp_path, "dctrd", steps)
    _, address, _, namespace = containerd.tool.base_args
    a = start_daemon(
        daemons,
        "a",
        '[containers]\ndetect = ["containerd"]\n[containers.containerd]\n'
        f'address = "{address}"\nnamespace = "{namespace}"\n',
    )
    with started(containerd, genloop_spec_for(_image_id(containerd), out, steps=steps), name):
        wait_lines(out, 30)
        done = cli_json(a, "checkpoint", "--container", name, "--runtime", "containerd", "--wait")
        assert done["container"]["runtime"] == "containerd"
        assert done["container"]["image_digest"] == _image_id(containerd)
        restored = cli_json(a, "restore", done["checkpoint_id"], "--wait")
        assert restored["mode"] == "restored", restored
        assert restored["pids"] == list(containerd.inspect(name).pids)
        assert wait_done(out) == expected


def _rw_log(rt: ContainerdRuntime, name: str) -> bytes:
    """The container's /var/log/genloop.log through its task's rootfs (the shim keeps it
    mounted until the task is removed, so it reads after the container exited)."""
    _, address, _, namespace = rt.tool.base_args
    rootfs = Path(address).parent / "state/io.containerd.runtime.v2.task" / namespace / name
    return (rootfs / "rootfs/var/log/genloop.log").read_bytes()


def _one_part(parts: CheckpointParts, kind: str) -> Path:
    (rel,) = (rel for rel, k in parts.parts.items() if k == kind)
    return parts.directory / rel


def test_containerd_a_file_held_open_in_the_rw_layer_restores_unfitted_after_leave_running(
    containerd: ContainerdRuntime, tmp_path: Path
) -> None:
    """containerd has no grown-file problem to fit: ``ctr containers checkpoint`` pauses the
    task (the cgroup freezer) before it diffs the rw layer and runs CRIU, and resumes it only
    after both (cmd/ctr/commands/containers/checkpoint.go), so a file the container holds open
    and goes on writing there is in the checkpoint's rw blob at the size CRIU recorded, however
    long it is by the restore. The loop holds its rw-layer log open, is checkpointed
    leave-running and runs to its end; nothing is fitted, and the copy restored from the
    checkpoint rewrites log and tokens from there byte for byte."""
    out, name, expected = new_loop(tmp_path, "ctrd", STEPS)
    spec = genloop_spec_for(_image_id(containerd), out, steps=STEPS)
    env = (*(spec.env or ("PATH=/usr/sbin:/usr/bin:/sbin:/bin",)), "GENLOOP_HOLD_LOG=1")
    copy = f"{name}-copy"
    with started(containerd, dataclasses.replace(spec, env=env), name), removing(containerd, copy):
        wait_lines(out, STEPS // 3)
        parts = load_parts(
            containerd.checkpoint(name, tmp_path / "ckpt", leave_running=True).directory
        )
        assert wait_done(out) == expected
        full_log = expected.removesuffix(b"done\n")
        assert _rw_log(containerd, name) == full_log

        with tarfile.open(_one_part(parts, "criu")) as t:
            t.extractall(tmp_path / "criu", filter="data")
        recorded = recorded_sizes(tmp_path / "criu")["var/log/genloop.log"]  # held open
        with tarfile.open(_one_part(parts, "rootfs-diff")) as t:  # gzipped
            stored = t.getmember("var/log/genloop.log").size
        assert 0 < stored == recorded < len(full_log)

        before = {rel: (parts.directory / rel).read_bytes() for rel in parts.parts}
        assert containerd.fit_open_files(parts, name=copy) == []
        assert {rel: (parts.directory / rel).read_bytes() for rel in parts.parts} == before
        assert containerd.restore(parts, name=copy).running
        assert wait_done(out) == expected
        assert _rw_log(containerd, copy) == full_log
