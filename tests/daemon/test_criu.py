"""Real CRIU on real processes: dump and restore process trees, continuing bit-exactly."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpusnap.daemon.host import criu as criu_module
from gpusnap.daemon.host import proctree
from gpusnap.daemon.host.criu import Criu, most_relevant_error, parse_stats
from gpusnap.errors import FailedPrecondition, GpusnapError, NotFound, Unsupported
from tests.support import workloads
from tests.support.criu import criu_or_skip
from tests.support.workloads import Started

log = logging.getLogger(__name__)

pytestmark = [pytest.mark.criu, pytest.mark.timeout(300)]

STEPS = 40


@pytest.fixture(scope="module")
def criu() -> Iterator[Criu]:
    found = criu_or_skip()
    # Adopt the orphans a kill-mode dump leaves, so their pids can be reaped and reused.
    workloads.set_child_subreaper(True)
    yield found
    workloads.set_child_subreaper(False)


def _restore(criu: Criu, images: Path, tmp: Path) -> int:
    # sibling=True: the restored root becomes our child, so we can reap it (PID 1 may not).
    res = criu.restore(
        images, log_path=tmp / "restore.log", pidfile=tmp / "restored.pid", sibling=True
    )
    log.info("restore: %.3fs, stats %s", res.wall_seconds, res.stats)
    return res.pid


def _reap_restored(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_kill_mode_dump_and_restore_of_a_tree_continues_bit_exactly(
    criu: Criu, tmp_path: Path, started: Started
) -> None:
    reference = workloads.reference_output("tree", tmp_path / "ref", steps=STEPS)
    w = started(workloads.start_tree(tmp_path / "run", steps=STEPS), steps=10)
    tree = proctree.tree_pids(w.pid)
    assert len(tree) == 2  # parent and child
    assert proctree.process_info(w.pid).threads == 2  # main and the hasher thread

    res = criu.dump(w.pid, tmp_path / "images", leave_running=False, log_path=tmp_path / "dump.log")
    assert w.reap() == -9  # kill mode: CRIU killed the tree once it was dumped
    dumped_steps = w.steps_done()
    assert 10 <= dumped_steps < STEPS
    assert res.images_bytes > 0 and res.pause_seconds > 0
    assert "Frozen time" in res.stats
    log.info(
        "dump: wall %.3fs pause %.3fs bytes %d",
        res.wall_seconds,
        res.pause_seconds,
        res.images_bytes,
    )

    pid = _restore(criu, tmp_path / "images", tmp_path)
    assert pid == w.pid  # CRIU restores the old pids
    assert proctree.tree_pids(pid)[1:] == tree[1:]
    out = w.wait_done()
    assert _reap_restored(pid) == 0
    assert w.steps_done() == STEPS
    assert out == reference


def test_leave_running_dump_keeps_the_process_going_and_its_images_restore(
    criu: Criu, tmp_path: Path, started: Started
) -> None:
    reference = workloads.reference_output("tree", tmp_path / "ref", steps=STEPS)
    w = started(workloads.start_tree(tmp_path / "run", steps=STEPS), steps=5)
    res = criu.dump(w.pid, tmp_path / "images", leave_running=True, log_path=tmp_path / "dump.log")
    assert res.leave_running
    at_dump = w.steps_done()
    # The original keeps running and finishes on its own, with the uninterrupted output.
    assert proctree.exists(w.pid)
    w.wait_steps(at_dump + 3)
    assert w.wait_done() == reference
    assert w.proc.returncode == 0

    # The images still hold the tree as it was at the dump; the original is gone (reaped).
    pid = _restore(criu, tmp_path / "images", tmp_path)
    assert pid == w.pid
    w._reaped = True  # the restored process is reaped below, not through the old Popen
    assert w.wait_done() == reference
    assert _reap_restored(pid) == 0


def test_counter_restored_reports_its_state_and_continues(
    criu: Criu, tmp_path: Path, started: Started
) -> None:
    w = started(workloads.start_counter(tmp_path / "run", steps=30), steps=5)
    step_before, _, _ = w.state()
    criu.dump(w.pid, tmp_path / "images", leave_running=False, log_path=tmp_path / "dump.log")
    w.reap()
    pid = _restore(criu, tmp_path / "images", tmp_path)
    step_after, digest, reported_pid = w.state()
    assert reported_pid == pid == w.pid
    assert step_after >= step_before
    lines = w.output().splitlines()
    assert f"{step_after:08d} {digest}".encode() in lines
    assert w.wait_done() == workloads.expected_lines("counter", 30)
    assert _reap_restored(pid) == 0


def test_dump_of_a_nonexistent_pid_is_not_found(criu: Criu, tmp_path: Path) -> None:
    w = workloads.start_counter(tmp_path / "gone", steps=1, interval=0)
    w.wait_done()  # reaped: the pid is free now
    with pytest.raises(NotFound, match=f"^no such process: {w.pid}$"):
        criu.dump(w.pid, tmp_path / "images", leave_running=True, log_path=tmp_path / "dump.log")


def test_restore_onto_a_taken_pid_fails_in_one_line_naming_the_pid(
    criu: Criu, tmp_path: Path, started: Started
) -> None:
    # A restore whose pid is taken by a running process must fail, clearly.
    w = started(workloads.start_counter(tmp_path / "run", steps=0), steps=2)
    criu.dump(w.pid, tmp_path / "images", leave_running=True, log_path=tmp_path / "dump.log")
    with pytest.raises(FailedPrecondition) as info:
        criu.restore(tmp_path / "images", log_path=tmp_path / "restore.log", pidfile=tmp_path / "p")
    msg = str(info.value)
    assert "\n" not in msg
    assert f"pid {w.pid} of the checkpoint is in use on this node" in msg
    assert str(tmp_path / "restore.log") in msg
    assert proctree.exists(w.pid)  # the running original is untouched

    # A dump into a non-empty directory is refused before criu runs.
    with pytest.raises(GpusnapError, match="not empty"):
        criu.dump(w.pid, tmp_path / "images", leave_running=True, log_path=tmp_path / "d2.log")


def test_dump_failure_from_criu_is_one_line_with_the_cause_and_log_path(
    criu: Criu, tmp_path: Path
) -> None:
    # A kernel thread cannot be dumped: criu itself fails, and says why.
    with pytest.raises(FailedPrecondition) as info:
        criu.dump(2, tmp_path / "images", leave_running=True, log_path=tmp_path / "dump.log")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(
        "criu dump of pid 2: not permitted to trace it (Unable to interrupt task: 2"
    )
    assert str(tmp_path / "dump.log") in msg


def test_version_and_check(criu: Criu) -> None:
    assert criu.version() >= (4, 0, 0)
    criu.check()


def test_missing_binary_is_unsupported_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(Unsupported, match=r"criu not found .*run scripts/install-criu\.sh"):
        Criu(tmp_path / "no-criu").version()


def test_too_old_binary_is_unsupported(tmp_path: Path) -> None:
    fake = tmp_path / "criu"
    fake.write_text("#!/bin/sh\necho 'Version: 3.17.1'\n")
    fake.chmod(0o755)
    with pytest.raises(Unsupported, match=r"^criu 3\.17\.1 .* is too old \(need >= 4\.0\.0\)"):
        Criu(fake).check()


def test_log_parsing_picks_the_cause_not_the_noise() -> None:
    text = (
        "(00.07) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: x\n"
        "(00.075) Warn  (criu/seize.c:63): Failed to open /proc/9/comm: No such file\n"
        "(00.08) Error (criu/files-reg.c:2100): File /x has bad size 3 (expect 9)\n"
        "(00.09) Error (criu/cr-restore.c:2397): Restoring FAILED.\n"
    )
    assert most_relevant_error(text) == "File /x has bad size 3 (expect 9) [criu/files-reg.c:2100]"
    assert parse_stats(
        "Displaying dump stats:\nFrozen time: 43864 us\nZero memory pages: 3 (0x3)\n"
    ) == {
        "Frozen time": 43864,
        "Zero memory pages": 3,
    }


def test_restore_with_scope_unit_runs_criu_under_systemd_run_when_systemd_is_there(
    criu: Criu, tmp_path: Path, started: Started, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No systemd on the test host: a stand-in systemd-run records its arguments and runs the rest.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "systemd-run.args"
    fake = bindir / "systemd-run"
    fake.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > {record}\n'
        'while [ "${1#--}" != "$1" ]; do shift; done\n'
        'exec "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setattr(criu_module, "systemd_running", lambda: True)

    w = started(workloads.start_counter(tmp_path / "run", steps=20), steps=3)
    criu.dump(w.pid, tmp_path / "images", leave_running=False, log_path=tmp_path / "dump.log")
    w.reap()
    res = criu.restore(
        tmp_path / "images",
        log_path=tmp_path / "restore.log",
        pidfile=tmp_path / "restored.pid",
        scope_unit="gpusnap-restore-test",
        sibling=True,
    )
    args = record.read_text().splitlines()
    assert args[:4] == ["--scope", "--quiet", "--collect", "--unit=gpusnap-restore-test.scope"]
    assert args[4] == str(criu.path) and args[5] == "restore"
    assert w.wait_done() == workloads.expected_lines("counter", 20)
    assert _reap_restored(res.pid) == 0


def test_tcp_support_says_what_a_real_dump_of_a_tcp_listener_does(
    criu: Criu, tmp_path: Path
) -> None:
    code = (
        "import socket, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
        "print(s.getsockname()[1], flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip().isdigit()  # listening
        try:
            criu.dump(
                proc.pid, tmp_path / "images", leave_running=True, log_path=tmp_path / "dump.log"
            )
            dumped = True
        except GpusnapError as err:
            assert "1:16" in str(err) or "opt" in str(err), err  # criu#2705's failure
            dumped = False
    finally:
        proc.kill()
        proc.communicate()
    support = criu.tcp_support()
    assert support.ok is dumped, support.why


def test_the_tcp_rule_follows_criu_2705() -> None:
    fixed = criu_module.tcp_support((4, 2, 0), kernel_answers=False)
    assert fixed.ok and "4.2" in fixed.why
    old_here = criu_module.tcp_support((4, 1, 1), kernel_answers=False)
    assert not old_here.ok and "criu#2705" in old_here.why
    assert criu_module.tcp_support((4, 1, 1), kernel_answers=True).ok
