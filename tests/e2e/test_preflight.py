"""``gpusnap preflight`` and the checkpoint job's own preflight, through the real daemon, on real
processes: an io_uring, a TCP connection, a /dev/shm file, a flock, a ptraced child and a unix
peer outside the tree, each reported as its kind; a clean process checkpointable."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusnap.daemon.host import proctree
from gpusnap.errors import EXIT_FAILURE, EXIT_NOT_FOUND, EXIT_OK, EXIT_USAGE
from tests.support.daemons import HANG_GUARD, Node, Nodes

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]

# A process that sets up what argv names, says "ready", then answers each line on stdin with
# the same line (so the test sees it still runs and is not stopped).
_PROGRAM = r"""
import ctypes, fcntl, mmap, os, signal, socket, sys, time
what = sys.argv[1].split(",")
keep = []
libc = ctypes.CDLL(None, use_errno=True)
if "io_uring" in what:
    params = (ctypes.c_char * 120)()
    fd = libc.syscall(425, 8, params)  # io_uring_setup(8 entries)
    assert fd >= 0, ctypes.get_errno()
    keep.append(fd)
if "tcp" in what:
    listener = socket.socket(); listener.bind(("127.0.0.1", 0)); listener.listen()
    conn = socket.create_connection(("127.0.0.1", int(os.environ["PF_PORT"])))
    keep += [listener, conn]
if "shm" in what:
    f = open(os.environ["PF_SHM"], "w+b"); f.truncate(1 << 20)
    m = mmap.mmap(f.fileno(), 1 << 20); m[:5] = b"hello"
    keep += [f, m]
if "flock" in what:
    f = open(os.environ["PF_LOCK"], "w"); fcntl.flock(f, fcntl.LOCK_EX)
    keep.append(f)
if "ptrace" in what:
    child = os.fork()
    if child == 0:
        libc.ptrace(0, 0, 0, 0)  # PTRACE_TRACEME: the parent traces us
        os.kill(os.getpid(), signal.SIGSTOP)
        while True:
            time.sleep(1)
    os.waitpid(child, os.WUNTRACED)
    libc.ptrace(7, child, 0, 0)  # PTRACE_CONT: it runs on, traced
print("ready", flush=True)
for line in sys.stdin:
    print(line.strip(), flush=True)
"""


class Proc:
    def __init__(self, what: str, env: dict[str, str], pass_fds: tuple[int, ...] = ()) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, "-c", _PROGRAM, what],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            pass_fds=pass_fds,
            env={**os.environ, **env},
        )
        assert self.readline() == "ready"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def readline(self) -> str:
        assert self.popen.stdout is not None
        return self.popen.stdout.readline().strip()

    def echo(self, text: str) -> str:
        """The process answers: it runs, and is not stopped."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(text + "\n")
        self.popen.stdin.flush()
        return self.readline()

    def close(self) -> None:
        for pid in reversed(proctree.tree_pids(self.pid) if proctree.exists(self.pid) else []):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.popen.kill()
        self.popen.communicate(timeout=HANG_GUARD)


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.close()


@pytest.fixture
def node(nodes: Nodes) -> Node:
    return nodes.make("a").start()


def _preflight(node: Node, *args: str) -> tuple[int, dict[str, Any]]:
    got = node.cli("preflight", *args, "--json")
    assert got.rc in (EXIT_OK, EXIT_FAILURE), got.stderr
    doc = got.json
    # Exactly this shape, nothing else.
    assert set(doc) == {"checkpointable", "blockers", "notes"}
    assert all(set(b) == {"kind", "pid", "detail", "fix"} for b in doc["blockers"]), doc
    assert all(set(n) == {"kind", "pid", "detail"} for n in doc["notes"]), doc
    assert doc["checkpointable"] is (not doc["blockers"])
    assert got.rc == (EXIT_OK if doc["checkpointable"] else EXIT_FAILURE)
    return got.rc, doc


def test_an_io_uring_is_named_with_the_exec_fix_and_the_checkpoint_job_refused_untouched(
    node: Node, procs: list[Proc]
) -> None:
    p = Proc("io_uring", {})
    procs.append(p)
    rc, doc = _preflight(node, "--pid", str(p.pid))
    assert rc == 1
    (blocker,) = doc["blockers"]
    assert blocker["kind"] == "io_uring" and blocker["pid"] == p.pid
    assert "io_uring" in blocker["detail"] and "gpusnap exec" in blocker["fix"]
    text = node.cli("preflight", "--pid", str(p.pid))
    assert text.rc == 1 and "BLOCKER io_uring" in text.stdout and "gpusnap exec" in text.stdout

    ck = node.cli("checkpoint", "--pid", str(p.pid), "--wait")
    assert ck.rc == EXIT_FAILURE, ck.stderr
    (line,) = ck.stderr.strip().splitlines()
    assert "cannot checkpoint now" in line and "io_uring" in line and "gpusnap exec" in line
    assert p.echo("still here") == "still here"  # running, never frozen or killed
    assert "criu dump" not in node.log()  # refused before CRIU


def test_a_clean_process_is_checkpointable(node: Node, procs: list[Proc]) -> None:
    p = Proc("", {})
    procs.append(p)
    rc, doc = _preflight(node, "--pid", str(p.pid))
    assert rc == 0
    assert doc == {"checkpointable": True, "blockers": [], "notes": []}
    assert node.cli("preflight", "--pid", str(p.pid)).stdout.strip() == "checkpointable: yes"


def test_each_thing_in_a_tree_is_reported_as_its_kind(
    node: Node, procs: list[Proc], tmp_path: Path
) -> None:
    outside = socket.socket()
    outside.bind(("127.0.0.1", 0))
    outside.listen()
    ours, theirs = socket.socketpair()  # a unix stream: one end in the tree, one here
    shm = Path(f"/dev/shm/gpusnap-preflight-{os.getpid()}")
    env = {
        "PF_PORT": str(outside.getsockname()[1]),
        "PF_SHM": str(shm),
        "PF_LOCK": str(tmp_path / "lockfile"),
    }
    try:
        p = Proc("tcp,shm,flock,ptrace", env, pass_fds=(theirs.fileno(),))
        procs.append(p)
        theirs.close()
        accepted, _ = outside.accept()
        (child,) = proctree.tree_pids(p.pid)[1:]
        rc, doc = _preflight(node, "--pid", str(p.pid))
        assert rc == 1
        blockers = {(b["kind"], b["pid"]): b for b in doc["blockers"]}
        assert set(blockers) == {("unix", p.pid), ("ptrace", child)}, doc
        assert f"traced by pid {p.pid}" in str(blockers["ptrace", child]["detail"])
        assert "outside the tree" in str(blockers["unix", p.pid]["detail"])
        tcp = [str(n["detail"]) for n in doc["notes"] if n["kind"] == "tcp"]
        notes = {n["kind"]: n for n in doc["notes"]}
        assert set(notes) == {"tcp", "tmpfs", "lock"}, doc
        # A live connection is dumped with --tcp-close and comes back closed: a note.
        established = f"-> 127.0.0.1:{outside.getsockname()[1]} (ESTABLISHED)"
        assert any(established in d and "--tcp-close" in d for d in tcp), tcp
        assert any("listening on 127.0.0.1:" in d for d in tcp), tcp
        assert f"{shm} (tmpfs): 1.0 MiB" in str(notes["tmpfs"]["detail"])
        assert "open and mapped" in str(notes["tmpfs"]["detail"])
        assert "FLOCK WRITE lock on " + env["PF_LOCK"] in str(notes["lock"]["detail"])
        assert all(n["pid"] == p.pid for n in notes.values())
        accepted.close()
    finally:
        outside.close()
        ours.close()
        shm.unlink(missing_ok=True)


def test_a_missing_pid_is_not_found_and_a_bad_one_a_usage_error(node: Node) -> None:
    missing = 4_000_000  # above any pid this machine hands out (pid_max is 4194304 at most)
    assert not proctree.exists(missing)
    got = node.cli("preflight", "--pid", str(missing))
    assert got.rc == EXIT_NOT_FOUND
    assert got.stderr.strip() == f"gpusnap: error: no such process: {missing}"
    assert node.cli("preflight", "--pid", "0").rc == EXIT_USAGE
    assert node.cli("preflight", "--workload", "nope").rc == EXIT_NOT_FOUND
