"""gpusnapd SIGKILLed at each point of a kill-mode checkpoint: after the restart the workload
runs, exactly once, whichever way the checkpoint had got.

The points are reached on real conditions, never by timing: CRIU runs through a wrapper that
adds an action script (``--action-script``; CRIU runs it before it seizes the tree and again
once every image is written, before it kills the tree), the staging directory is a small ext4
that the action script can freeze (``fsfreeze``: CRIU then blocks at its first image write,
the tree seized), and the store is S3 (moto) behind a fault proxy that fails the chosen PUTs,
so that the upload waits, retrying, at the point asked for.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.host import proctree
from gpusnap.daemon.host.criu import Criu
from gpusnap.daemon.jobs.journal import INTERRUPTED_MESSAGE
from tests.support import workloads
from tests.support.daemons import HANG_GUARD, Node, Nodes, restored_cleanup
from tests.support.faultproxy import FaultProxy
from tests.support.moto_server import TEST_REGION, MotoServer

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]

HOOK = """#!/bin/sh
d={dir}
touch "$d/$CRTOOLS_SCRIPT_ACTION.reached"
a=$CRTOOLS_SCRIPT_ACTION
if [ -e "$d/$a.freeze" ]; then fsfreeze -f "$(cat "$d/$a.freeze")"; fi
if [ -e "$d/$CRTOOLS_SCRIPT_ACTION.hold" ]; then
  i=0
  while [ ! -e "$d/release" ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done
fi
exit 0
"""
WRAPPER = """#!/bin/sh
if [ "$1" = dump ]; then exec {criu} "$@" --action-script {hook}; fi
exec {criu} "$@"
"""

CHUNK_PUT = "/gpusnap/chunks/"  # under the test's bucket, in a PUT
MANIFEST_PUT = "/gpusnap/manifests/"
RAN_ON = "the dump did not finish and the workload runs on"
RESTORED = "the dump had finished: the workload was restored on this node from the local dump"


@pytest.fixture
def freezable(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB ext4 on a loop device: the staging directory, which ``fsfreeze`` can stop."""
    image, mnt = tmp_path / "staging.img", tmp_path / "staging"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", "64M", str(image)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    if subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=False).returncode:
        pytest.skip("no loop device for a freezable file system here (mount -o loop failed)")
    try:
        yield mnt
    finally:
        subprocess.run(["fsfreeze", "-u", str(mnt)], capture_output=True, check=False)
        subprocess.run(["umount", str(mnt)], check=False)


class Hooks:
    """The action script's switches: hold at an action, or freeze staging there."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        directory.mkdir()
        self.hook = directory / "hook.sh"
        self.hook.write_text(HOOK.format(dir=directory))
        self.hook.chmod(0o755)
        self.wrapper = directory / "criu"
        self.wrapper.write_text(WRAPPER.format(criu=Criu().path, hook=self.hook))
        self.wrapper.chmod(0o755)

    def hold(self, action: str) -> None:
        (self.dir / f"{action}.hold").touch()

    def freeze(self, action: str, where: Path) -> None:
        (self.dir / f"{action}.freeze").write_text(str(where))

    def reached(self, action: str) -> bool:
        return (self.dir / f"{action}.reached").exists()

    def release(self) -> None:
        (self.dir / "release").touch()


def _traced(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(ln for ln in status.splitlines() if ln.startswith("TracerPid:")).split()[1] != "0"


def _copies(out: Path) -> list[int]:
    """The processes running the workload whose output is ``out``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(out).encode() in (entry / "cmdline").read_bytes():
                    if proctree.exists(int(entry.name)):
                        found.append(int(entry.name))
    return found


def _failed(proxy: FaultProxy, match: str) -> bool:
    return any(o == "failed" and m == "PUT" and match in p for m, p, o in proxy.requests)


def _s3_node(nodes: Nodes, proxy: FaultProxy, bucket: str, staging: Path, hooks: Hooks) -> Node:
    node = nodes.make("a", daemon_config=f'staging_dir = "{staging}"\nupload_during_dump = false')
    node.env["GPUSNAP_CRIU"] = str(hooks.wrapper)
    # The upload retries (quickly, for as long as the test needs) what the proxy fails.
    node.write_config(
        f'url = "s3://{bucket}/gpusnap"\n'
        f'endpoint_url = "{proxy.endpoint_url}"\n'
        f'region = "{TEST_REGION}"\n'
        f'key_file = "{nodes.key_file}"\n'
        "retry_attempts = 100000\nretry_base_delay = 0.02\nretry_max_delay = 0.1\n"
        "retry_deadline = 3600\n"
    )
    return node


def _arrange(
    point: str, hooks: Hooks, proxy: FaultProxy, bucket: str, staging: Path, pid: int
) -> Callable[[], bool]:
    """Set the checkpoint up to stop at ``point``; the condition that says it is there."""
    if point == "before-the-dump":  # CRIU started; the tree not yet touched
        hooks.hold("pre-dump")
        return lambda: hooks.reached("pre-dump")
    if point == "during-the-dump":  # the tree seized; CRIU blocked at its first image write
        hooks.freeze("pre-dump", staging)
        return lambda: hooks.reached("pre-dump") and _traced(pid)
    if point == "images-written-tree-not-yet-killed":
        hooks.hold("post-dump")
        return lambda: hooks.reached("post-dump")
    if point == "after-the-dump-before-the-upload":  # no chunk lands
        proxy.fail_next(10**6, status=500, match=f"PUT /{bucket}{CHUNK_PUT}")
        return lambda: _failed(proxy, CHUNK_PUT)
    if point == "during-the-upload":  # one chunk lands, the rest do not
        proxy.fail_next(10**6, status=500, match=f"PUT /{bucket}{CHUNK_PUT}", after=1)
        return lambda: _failed(proxy, CHUNK_PUT)
    assert point == "before-the-commit"  # every chunk in, the manifest refused
    proxy.fail_next(10**6, status=500, match=f"PUT /{bucket}{MANIFEST_PUT}")
    return lambda: _failed(proxy, MANIFEST_PUT)


POINTS = [
    # (name, what the restarted daemon says, the tree still the original process)
    ("before-the-dump", RAN_ON, True),
    ("during-the-dump", RAN_ON, True),
    ("images-written-tree-not-yet-killed", RAN_ON, True),
    ("after-the-dump-before-the-upload", RESTORED, False),
    ("during-the-upload", RESTORED, False),
    ("before-the-commit", RESTORED, False),
]


@pytest.mark.parametrize(("point", "said", "original"), POINTS, ids=[p[0] for p in POINTS])
def test_a_daemon_killed_during_a_kill_mode_checkpoint_leaves_the_workload_running_once(
    point: str,
    said: str,
    original: bool,
    nodes: Nodes,
    freezable: Path,
    tmp_path: Path,
    moto_server: MotoServer,
    s3_bucket: str,
) -> None:
    hooks = Hooks(tmp_path / "hooks")
    with FaultProxy(moto_server.endpoint_url) as proxy:
        node = _s3_node(nodes, proxy, s3_bucket, freezable, hooks).start()
        w = workloads.start_counter(tmp_path / "run")
        pid = w.pid
        try:
            w.wait_steps(3)
            ready = _arrange(point, hooks, proxy, s3_bucket, freezable, pid)
            got = node.cli("checkpoint", "--pid", str(pid), "--json")
            assert got.rc == 0, got.stderr
            job_id = got.json["id"]
            workloads._poll(ready, HANG_GUARD, f"the checkpoint to reach {point}")

            node.kill()
            hooks.release()  # a criu that outlived the daemon would go on from here
            subprocess.run(["fsfreeze", "-u", str(freezable)], capture_output=True, check=False)
            if not original:
                w.reap()  # the dump killed it: free its pid, as its parent would
            proxy.heal()

            node.start()
            job = node.job(job_id)
            assert job["state"] == "interrupted", job
            assert job["error"].startswith(f"{INTERRUPTED_MESSAGE}; {said}"), job["error"]
            at = w.steps_done()
            w.wait_steps(at + 3)  # it runs,
            assert _copies(w.out_path) == [pid]  # once, with its own pid,
            assert not _traced(pid)
            lines = w.output().splitlines()  # and its output is one unbroken run
            assert (
                b"\n".join(lines) + b"\n"
                == workloads.expected_lines("counter", len(lines))[: -len(workloads.DONE)]
            )
            if point == "during-the-upload":
                assert any(
                    o == "forwarded" and CHUNK_PUT in f"{m} {p}" for m, p, o in proxy.requests
                )
            listed = node.cli("ls", "--json")
            assert listed.rc == 0, listed.stderr
            assert listed.json == {"checkpoints": []}  # nothing was committed
            assert not list(freezable.glob("2*"))  # and the staging is cleaned up
        finally:
            hooks.release()
            nodes.close()
            restored_cleanup([pid])
            w.kill()
