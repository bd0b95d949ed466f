"""The container tests' machinery: podman storage roots standing for nodes ("node A" and "node
B" on this machine), the generation-loop container they run, and waits on both.

Everything is real: podman with runc, CRIU from /usr/local/sbin, containers started by the
tests; each test names its containers uniquely (``unique``) and removes them.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from gpusnap.daemon.containers import (
    ContainerInfo,
    ContainerRuntime,
    ContainerSpec,
    Mount,
    PodmanRuntime,
    Ulimit,
)
from gpusnap.errors import Internal
from tests.containers.image import IMAGE_REF, WORKLOAD_DIR

TIMEOUT = 120.0  # a hang guard, never a performance expectation
STEPS_DEFAULT = 150  # the generation loop's length in most tests (~3 s at 20 ms a step)
# What podman needs here (docs/containers.md): the defaults ask for more than the host allows.
ULIMITS = (Ulimit("nofile", 20000, 20000), Ulimit("nproc", 32768, 32768))


@dataclass
class Node:
    """One podman storage root, standing for one node."""

    name: str
    dir: Path  # runroot, tmpdir, runc state (short paths)
    podman_root: Path
    podman: PodmanRuntime
    options: dict[str, Path | str]  # PodmanRuntime's keyword arguments for this root


def make_node(base: Path, name: str, archive: Path | None) -> Node:
    """A podman storage root under ``base`` (``archive``: the image to load into it)."""
    # podman refuses a runroot path longer than 50 characters; pytest's tmp paths can be.
    d = Path(tempfile.mkdtemp(prefix=f"gpusnap-{name}-", dir="/tmp"))
    rt = PodmanRuntime(
        root=base / name / "root",
        runroot=d / "run",
        tmpdir=d / "tmp",
        runtime_root=d / "runc",
        cgroup_manager="cgroupfs",
        events_backend="file",
    )
    options: dict[str, Path | str] = {
        "root": base / name / "root",
        "runroot": d / "run",
        "tmpdir": d / "tmp",
        "runtime_root": d / "runc",
        "cgroup_manager": "cgroupfs",
        "events_backend": "file",
    }
    if archive is not None:
        rt.tool.run(["load", "--input", str(archive)], what="load", timeout=300)
    return Node(name, d, base / name / "root", rt, options)


def teardown(node: Node) -> None:
    node.podman.tool.run(["rm", "--all", "--force", "--time", "0"], what="rm", check=False)
    node.podman.tool.run(["system", "reset", "--force"], what="reset", check=False)
    shutil.rmtree(node.dir, ignore_errors=True)
    shutil.rmtree(node.podman_root, ignore_errors=True)


def image_id(node: Node) -> str:
    proc = node.podman.tool.run(
        ["image", "inspect", "--format", "{{.Id}}", IMAGE_REF], what="image inspect"
    )
    return "sha256:" + proc.stdout.strip()


def genloop_spec(
    node: Node, out: Path, *, steps: int, interval: float = 0.02, weights_mib: int = 16
) -> ContainerSpec:
    """The spec of a container running the generation loop, writing tokens into ``out``."""
    return genloop_spec_for(
        image_id(node), out, steps=steps, interval=interval, weights_mib=weights_mib
    )


def genloop_spec_for(
    image: str, out: Path, *, steps: int, interval: float = 0.02, weights_mib: int = 16
) -> ContainerSpec:
    """``genloop_spec`` for the image id ``image``, on any runtime."""
    return ContainerSpec(
        image=IMAGE_REF,
        image_id=image,
        command=(
            "python3",
            "/gen/genloop.py",
            "/out",
            str(steps),
            str(interval),
            str(weights_mib),
            "/var/log/genloop.log",
        ),
        mounts=(Mount("/gen", str(WORKLOAD_DIR), options=("ro",)), Mount("/out", str(out))),
        ulimits=ULIMITS,
        network="none",
    )


def rw_log(node: Node, name: str, dest: Path) -> bytes:
    """The container's /var/log/genloop.log, from its rw layer (running or not)."""
    node.podman.tool.run(["cp", f"{name}:/var/log/genloop.log", str(dest)], what="cp")
    return dest.read_bytes()


def rw_log_once_exited(node: Node, name: str, dest: Path) -> bytes:
    """``rw_log`` read once the container has exited: a podman cp during its exit once found
    nothing, and one just after it can still meet the rootfs being unmounted by podman's
    cleanup ("changing to intended-new-root directory ... no such file"): asked again until it
    answers."""
    wait_exited(node, name)
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            return rw_log(node, name, dest)
        except Internal:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def exiting_at_checkpoint(spec: ContainerSpec, tmp: Path) -> ContainerSpec:
    """``spec`` for a container that exits once a checkpoint of it has begun, every time.

    runc hands CRIU the file the ``org.criu.config`` annotation names; the action script it
    sets runs at pre-dump, after the runtime has started the checkpoint, and kills the
    container's init there."""
    script = tmp / "exit-now.sh"
    script.write_text(
        "#!/bin/sh\n"
        '[ "$CRTOOLS_SCRIPT_ACTION" = pre-dump ] && kill -9 "$CRTOOLS_INIT_PID"\n'
        "exit 0\n"
    )
    script.chmod(0o755)
    conf = tmp / "criu.conf"
    conf.write_text(f"action-script {script}\n")
    return dataclasses.replace(spec, annotations={"org.criu.config": str(conf)})


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


class Loop(NamedTuple):
    """One test's generation loop: ``out``, the (empty) directory its container writes its
    tokens into, the container's unique ``name``, and ``expected``, the tokens of an
    uninterrupted run (empty where the test compares none)."""

    out: Path
    name: str
    expected: bytes


def new_loop(tmp: Path, prefix: str, steps: int | None = None, *, weights_mib: int = 16) -> Loop:
    """A ``Loop`` under ``tmp`` named after ``prefix``; with ``steps``, its ``expected`` tokens
    of that many steps."""
    expected = b"" if steps is None else reference(tmp / "ref", steps, weights_mib)
    out = tmp / "out"
    out.mkdir()
    return Loop(out, unique(prefix), expected)


@contextmanager
def removing(rt: ContainerRuntime, *names: str) -> Iterator[None]:
    """The containers ``names`` of ``rt`` removed when the block ends, however it ends."""
    try:
        yield
    finally:
        for name in names:
            rt.remove(name)


@contextmanager
def started(rt: ContainerRuntime, spec: ContainerSpec, name: str) -> Iterator[ContainerInfo]:
    """The container ``name`` created from ``spec`` and started, removed when the block ends."""
    info = rt.create(spec, name=name)
    with removing(rt, name):
        yield info


def reference(tmp: Path, steps: int, weights_mib: int = 16) -> bytes:
    """The tokens of an uninterrupted run (on the host's python, without sleeps)."""
    tmp.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            str(WORKLOAD_DIR / "genloop.py"),
            str(tmp),
            str(steps),
            "0",
            str(weights_mib),
        ],
        check=True,
        timeout=TIMEOUT,
    )
    return (tmp / "tokens").read_bytes()


def lines(out: Path) -> int:
    try:
        return (out / "tokens").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_lines(out: Path, n: int) -> None:
    deadline = time.monotonic() + TIMEOUT
    while lines(out) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"{out}/tokens has {lines(out)} lines, waited for {n}")
        time.sleep(0.05)


def wait_exited(node: Node, name: str) -> None:
    """Wait until the container ``name`` on ``node`` is no longer running."""
    deadline = time.monotonic() + TIMEOUT
    while node.podman.inspect(name).running:
        if time.monotonic() > deadline:
            raise AssertionError(f"container {name} still running after {TIMEOUT} s")
        time.sleep(0.05)


def wait_done(out: Path) -> bytes:
    deadline = time.monotonic() + TIMEOUT
    while True:
        data = (out / "tokens").read_bytes() if (out / "tokens").exists() else b""
        if data.endswith(b"done\n"):
            return data
        if time.monotonic() > deadline:
            n = data.count(b"\n")
            raise AssertionError(f"{out}/tokens never reached done ({n} lines)")
        time.sleep(0.05)
