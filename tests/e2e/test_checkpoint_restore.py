"""gpusnapd end to end: real daemons, real CRIU, real processes, the real CLI over the socket."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gpusnap.daemon.host import proctree
from tests.support import workloads
from tests.support.daemon_config import workload_section
from tests.support.daemons import Nodes, assert_cold_started
from tests.support.workloads import Started

pytestmark = [pytest.mark.criu, pytest.mark.slow, pytest.mark.timeout(600)]

STEPS = 60


def test_checkpoint_and_restore_of_a_process_tree_continues_bit_exactly(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    node = nodes.make("a").start()
    reference = workloads.reference_output("tree", tmp_path / "ref", steps=STEPS)
    w = started(workloads.start_tree(tmp_path / "run", steps=STEPS), steps=10)
    tree = proctree.tree_pids(w.pid)
    assert len(tree) == 2

    ck = node.cli("checkpoint", "--pid", str(w.pid), "--wait", "--json")
    assert ck.rc == 0, ck.stderr
    result = ck.json
    assert result["state"] == "succeeded"
    for key in ("checkpoint_id", "pause_seconds", "seconds", "bytes_total", "bytes_uploaded"):
        assert key in result, key
    assert result["bytes_total"] > 0
    w.reap()  # kill mode: the tree is gone; its pids must be free for the restore
    assert not proctree.exists(w.pid)

    shown = node.cli("show", result["checkpoint_id"], "--json")
    assert shown.rc == 0, shown.stderr
    stamp = shown.json["stamp"]
    assert stamp["process"]["pids"] == tree
    assert stamp["launch"]["command"][0] == sys.executable
    assert stamp["host"]["criu_version"].startswith("4.")
    assert any(f["path"] == str(w.out_path) for f in stamp["files"])
    # A first checkpoint uploads its page images while CRIU writes them (dumpstream.py).
    streams = shown.json["extra"]["streams"]
    pages = [p for p, info in streams.items() if info["kind"] == "criu-pages"]
    assert pages and all(p.startswith("pages-") for p in pages), streams

    rs = node.cli("restore", result["checkpoint_id"], "--wait", "--json")
    assert rs.rc == 0, rs.stderr
    restored = rs.json
    assert restored["mode"] == "restored"
    assert restored["reasons"] == []
    assert restored["pids"][0] == w.pid
    assert w.wait_done() == reference


def test_leave_running_checkpoint_keeps_the_workload_running_and_restores(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    node = nodes.make("a").start()
    w = started(workloads.start_counter(tmp_path / "run", steps=STEPS), steps=10)

    ck = node.cli("checkpoint", "--pid", str(w.pid), "--leave-running", "--wait", "--json")
    assert ck.rc == 0, ck.stderr
    assert ck.json["leave_running"] is True
    assert proctree.exists(w.pid)
    at_checkpoint = w.steps_done()
    w.wait_steps(at_checkpoint + 5)  # it keeps generating after the checkpoint
    w.kill()

    rs = node.cli("restore", ck.json["checkpoint_id"], "--wait", "--json")
    assert rs.rc == 0, rs.stderr
    assert rs.json["mode"] == "restored", rs.json["reasons"]
    # The restored counter rewrites what the original wrote after the dump, identically.
    assert w.wait_done() == workloads.expected_lines("counter", STEPS)


def test_restore_on_another_node_over_the_same_store(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    a = nodes.make("a").start()
    b = nodes.make("b").start()
    reference = workloads.reference_output("tree", tmp_path / "ref", steps=STEPS)
    w = started(workloads.start_tree(tmp_path / "run", steps=STEPS), steps=10)
    ck = a.cli("checkpoint", "--pid", str(w.pid), "--wait", "--json")
    assert ck.rc == 0, ck.stderr
    w.reap()

    listed = b.cli("ls", "--json")
    assert listed.rc == 0, listed.stderr
    assert ck.json["checkpoint_id"] in listed.stdout
    rs = b.cli("restore", "--workload", ck.json["workload"], "--latest", "--wait", "--json")
    assert rs.rc == 0, rs.stderr
    assert rs.json["mode"] == "restored"
    assert rs.json["checkpoint_id"] == ck.json["checkpoint_id"]
    assert w.wait_done() == reference
    # Node b's journal has the restore; node a's does not.
    assert rs.json["job_id"] in b.cli("jobs", "--json").stdout
    assert rs.json["job_id"] not in a.cli("jobs", "--json").stdout


def test_cold_start_with_every_reason_when_the_model_revision_differs(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    pid_file = tmp_path / "counter.pid"
    marker = tmp_path / "cold-started"
    a = nodes.make("a", extra_config=workload_section("ctr", pid_file, marker=marker)).start()
    b = nodes.make(
        "b", extra_config=workload_section("ctr", pid_file, revision="r2", marker=marker)
    ).start()
    w = started(workloads.start_counter(tmp_path / "run", steps=STEPS))
    pid_file.write_text(f"{w.pid}\n")
    w.wait_steps(5)

    ck = a.cli("checkpoint", "--workload", "ctr", "--wait", "--json")
    assert ck.rc == 0, ck.stderr
    cid = ck.json["checkpoint_id"]
    w.reap()

    same = a.cli("compat", cid, "--json")
    assert same.rc == 0, same.stderr
    assert same.json["compatible"] is True
    other = b.cli("compat", cid, "--json")
    assert other.rc != 0
    assert other.json["compatible"] is False
    assert any("r1" in str(r) and "r2" in str(r) for r in other.json["reasons"])

    rs = b.cli("restore", "--workload", "ctr", "--latest", "--wait", "--json")
    reason = "model revision differs: checkpoint r1, this node declares r2"
    assert_cold_started(rs, [reason], marker, w)


def test_restore_is_refused_for_an_altered_manifest(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    node = nodes.make("a").start()
    w = started(workloads.start_counter(tmp_path / "run", steps=0), steps=3)
    ck = node.cli("checkpoint", "--pid", str(w.pid), "--leave-running", "--wait", "--json")
    assert ck.rc == 0, ck.stderr
    cid = ck.json["checkpoint_id"]
    manifests = [p for p in (nodes.store_dir / "manifests").rglob("*") if cid in p.name]
    assert len(manifests) == 1
    blob = bytearray(manifests[0].read_bytes())
    blob[len(blob) // 2] ^= 0x01
    manifests[0].write_bytes(bytes(blob))

    rs = node.cli("restore", cid, "--wait", "--json")
    assert rs.rc == 4, rs.stderr
    assert rs.json["kind"] == "corrupt"
    assert len(rs.stderr.strip().splitlines()) == 1
    assert proctree.exists(w.pid)  # nothing was touched


def test_an_unreachable_store_fails_the_job_and_leaves_the_workload_alone(
    nodes: Nodes, tmp_path: Path, started: Started
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    node = nodes.make("a")
    node.env.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    node.write_config(
        store_section=(
            'url = "s3://bucket/prefix"\n'
            f'endpoint_url = "http://127.0.0.1:{port}"\n'
            'region = "us-east-1"\n'
            f'key_file = "{nodes.key_file}"\n'
            "retry_attempts = 1\n"
            "connect_timeout = 1.0\n"
        )
    )
    node.start()
    w = started(workloads.start_counter(tmp_path / "run", steps=0), steps=3)

    ck = node.cli("checkpoint", "--pid", str(w.pid), "--wait", "--json")
    assert ck.rc == 1, ck.stderr
    assert ck.json["state"] == "failed"
    assert ck.json["kind"] == "unavailable"
    assert len(ck.stderr.strip().splitlines()) == 1
    assert "Traceback" not in ck.stderr
    assert proctree.exists(w.pid)  # the store was asked before the dump
    before = w.steps_done()
    w.wait_steps(before + 2)


def test_a_pid_that_does_not_exist_exits_3(nodes: Nodes) -> None:
    node = nodes.make("a").start()
    pid = 4_194_000
    while Path(f"/proc/{pid}").exists():
        pid += 1
    ck = node.cli("checkpoint", "--pid", str(pid), "--wait")
    assert ck.rc == 3, ck.stderr
    assert f"no such process: {pid}" in ck.stderr
    assert len(ck.stderr.strip().splitlines()) == 1


# A perf_event fd: CRIU cannot dump one ("Can't dump file N of that type [600] (anon
# anon_inode:[perf_event])", criu/files-ext.c) and no preflight check names it, so the refusal
# is CRIU's own, in the dump.
_PERF_HOLDER = r"""
import ctypes, struct, sys, time
libc = ctypes.CDLL(None, use_errno=True)
attr = bytearray(128)
struct.pack_into("IIQ", attr, 0, 1, 128, 0)  # PERF_TYPE_SOFTWARE, size, PERF_COUNT_SW_CPU_CLOCK
fd = libc.syscall(298, (ctypes.c_char * 128).from_buffer(attr), 0, -1, -1, 0)  # perf_event_open
assert fd >= 0, ctypes.get_errno()
open(sys.argv[1], "w").write("ready")
while True:
    time.sleep(1)
"""


def test_a_process_that_cannot_be_dumped_gets_a_one_line_error_and_runs_on(
    nodes: Nodes, tmp_path: Path
) -> None:
    node = nodes.make("a").start()
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", _PERF_HOLDER, str(ready)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        workloads._poll(ready.exists, 60, "the perf_event holder")
        ck = node.cli("checkpoint", "--pid", str(proc.pid), "--wait", "--json")
        assert ck.rc == 1, ck.stderr
        assert ck.json["state"] == "failed"
        lines = ck.stderr.strip().splitlines()
        assert len(lines) == 1
        assert f"criu dump of pid {proc.pid}" in lines[0]
        assert "dump.log" in lines[0]
        assert proc.poll() is None  # a refused checkpoint leaves the process running
        assert not list((node.state_dir / "staging").iterdir())
    finally:
        proc.kill()
        proc.wait()
