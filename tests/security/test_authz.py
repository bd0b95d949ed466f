"""Per-caller authorization, end to end: a real gpusnapd (real CRIU) and real users.

One daemon for the module, serving its socket (group ``gpusnap``) and a mutual-TLS listener.
``MEMBER`` is in the socket group and nothing else; ``ADMIN`` is also in the configured
``admin_group``. The CLI runs as them through ``tests/api/_as_user.py``; processes of their
own run with their uid. Every refusal is exit 6, ``permission_denied``, one line; and what is
refused is still running afterwards.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.x509.oid import ExtendedKeyUsageOID

from gpusnap.daemon.config.file import WorkloadConfig
from gpusnap.daemon.host import proctree
from gpusnap.daemon.host.target import workload_reasons
from gpusnap.errors import EXIT_OK, EXIT_PERMISSION_DENIED
from tests.support import workloads
from tests.support.criu import criu_or_skip
from tests.support.daemons import BIN, Node, Nodes
from tests.support.tls import Ca, free_port
from tests.support.users import ensure_user

REPO = Path(__file__).resolve().parents[2]
GROUP = "gpusnap"
ADMIN_GROUP = "gpusnap-test-admins"
MEMBER = "gpusnap-test-member"
ADMIN = "gpusnap-test-admin"
SECRET = "s3cr3t-token-value-7f1c"
MARKER = "gpusnap-authz-marker-60011"  # in the command line of the processes `match` sees

pytestmark = [
    pytest.mark.criu,
    # Users are made here (tests/support/users.py): the etc-passwd group's worker.
    pytest.mark.xdist_group("etc-passwd"),
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("useradd") is None,
        reason="needs root with useradd/groupadd to create test users",
    ),
]


@dataclass
class Out:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    def __str__(self) -> str:
        return f"rc {self.rc}\nstdout: {self.out}\nstderr: {self.err}"


def _env() -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONDONTWRITEBYTECODE": "1",
        # The worktree's package first: the client must know this tree's error kinds.
        "PYTHONPATH": f"{REPO / 'src'}:{REPO}",
    }


def as_user(user: str, node: Node, *args: str) -> Out:
    """``gpusnap --socket S ARGS`` run as ``user``."""
    helper = REPO / "tests" / "api" / "_as_user.py"
    proc = subprocess.run(
        [sys.executable, str(helper), user, "--socket", str(node.socket), *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        cwd=REPO,
        env=_env(),
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return Out(proc.returncode, proc.stdout, proc.stderr)


def denied(result: Out, *words: str) -> None:
    """Exit 6 with one ``gpusnap: error:`` line that says why."""
    assert result.rc == EXIT_PERMISSION_DENIED, str(result)
    assert result.err.count("\n") == 1 and result.err.startswith("gpusnap: error: "), str(result)
    for word in words:
        assert word in result.err, str(result)


class OwnProcess:
    """``sleep`` running as a given user (or root), with ``MARKER`` in its command line."""

    def __init__(self, user: pwd.struct_passwd | None, workdir: Path) -> None:
        # One process whose command line carries the marker (bash's exec -a sets argv[0]).
        argv = ["/bin/bash", "-c", f"exec -a {MARKER} sleep 100000"]
        kw: dict[str, Any] = {}
        if user is not None:
            kw = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=workdir,
            start_new_session=True,
            **kw,
        )
        self.pid = self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None and proctree.exists(self.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@dataclass
class Pki:
    server_ca: Path
    member_cert: Path  # CN "member-laptop": mapped to MEMBER
    member_key: Path
    admin_cert: Path  # CN "operator": mapped to admin
    admin_key: Path
    stranger_cert: Path  # CN "unlisted": signed by the client CA, in no mapping
    stranger_key: Path


@dataclass
class Daemon:
    node: Node
    base: Path
    address: str
    pki: Pki
    pid_files: dict[str, Path]
    member: pwd.struct_passwd


def _pki(d: Path) -> Pki:
    server_ca, client_ca = Ca("server CA"), Ca("client CA")
    files: dict[str, bytes] = {"server_ca": server_ca.pem, "client_ca": client_ca.pem}
    files["server_cert"], files["server_key"] = server_ca.leaf(
        "gpusnapd", ExtendedKeyUsageOID.SERVER_AUTH
    )
    for who, cn in (("member", "member-laptop"), ("admin", "operator"), ("stranger", "unlisted")):
        files[f"{who}_cert"], files[f"{who}_key"] = client_ca.leaf(
            cn, ExtendedKeyUsageOID.CLIENT_AUTH
        )
    for name, data in files.items():
        (d / f"{name}.pem").write_bytes(data)
    return Pki(
        **{k: d / f"{k}.pem" for k in Pki.__dataclass_fields__},
    )


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    criu_or_skip()
    member = ensure_user(MEMBER, [GROUP])
    ensure_user(ADMIN, [GROUP, ADMIN_GROUP])
    base = Path(tempfile.mkdtemp(prefix="gpusnap-authz-"))
    base.chmod(0o755)  # the users must reach the socket and their process's cwd
    pki_dir = base / "pki"
    pki_dir.mkdir()
    pki = _pki(pki_dir)
    address = f"127.0.0.1:{free_port()}"
    pid_files = {n: base / f"{n}.pid" for n in ("rootsvc", "shared", "loose", "foreign", "mine")}
    workload_toml = "".join(
        f'[[workload]]\nname = "{n}"\npid_file = "{p}"\n{extra}\n'
        for n, p, extra in (
            ("rootsvc", pid_files["rootsvc"], ""),
            ("shared", pid_files["shared"], f'allow_users = ["{MEMBER}"]\n'),
            ("loose", pid_files["loose"], ""),
            ("foreign", pid_files["foreign"], ""),
            ("mine", pid_files["mine"], f'user = "{MEMBER}"\n'),
        )
    )
    workload_toml += (
        f'[[workload]]\nname = "bymatch"\nmatch = "{MARKER}"\nuser = "{MEMBER}"\n\n'
        f'[[workload]]\nname = "anymatch"\nmatch = "{MARKER}"\n\n'
    )
    nodes = Nodes(base)
    node = nodes.make(
        "a",
        daemon_config=f'admin_group = "{ADMIN_GROUP}"',
        extra_config=(
            workload_toml + f'[daemon.tcp]\nlisten = "{address}"\n'
            f'cert_file = "{pki_dir / "server_cert.pem"}"\n'
            f'key_file = "{pki_dir / "server_key.pem"}"\n'
            f'client_ca_file = "{pki_dir / "client_ca.pem"}"\n\n'
            f'[daemon.tcp.clients]\n"member-laptop" = "{MEMBER}"\noperator = "admin"\n'
        ),
    )
    sock = node.root / "sock"
    sock.mkdir(parents=True, mode=0o750)
    os.chown(sock, 0, grp.getgrnam(GROUP).gr_gid)  # the group may enter; the socket is 0660
    try:
        node.start()
        yield Daemon(node, base, address, pki, pid_files, member)
    finally:
        nodes.close()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def procs(daemon: Daemon) -> Iterator[list[OwnProcess]]:
    started: list[OwnProcess] = []
    yield started
    for p in started:
        p.stop()


def _root_process(daemon: Daemon, procs: list[OwnProcess]) -> OwnProcess:
    p = OwnProcess(None, daemon.base)
    procs.append(p)
    return p


def _member_process(daemon: Daemon, procs: list[OwnProcess]) -> OwnProcess:
    p = OwnProcess(daemon.member, daemon.base)
    procs.append(p)
    return p


def _criu_dumps_other_uids() -> bool:
    """CRIU (as root) reads every task's rlimits, which needs CAP_SYS_RESOURCE for a task of
    another uid; a sandbox that drops it can dump root's processes only."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << 24))
    return False


CRIU_DUMPS_OTHER_UIDS = _criu_dumps_other_uids()


def ran_on(result: Out, pid: int) -> dict[str, Any]:
    """A ``checkpoint --wait --json`` that was authorized and whose job dumped ``pid``: it
    succeeded, or (where CRIU cannot dump another uid's task) failed in CRIU's dump of it."""
    assert result.rc != EXIT_PERMISSION_DENIED, str(result)
    job: dict[str, Any] = result.json()
    if CRIU_DUMPS_OTHER_UIDS:
        assert result.rc == EXIT_OK and job["state"] == "succeeded", str(result)
        assert job["pids"][0] == pid, job
    else:
        assert job["state"] == "failed", str(result)
        assert f"criu dump of pid {pid} failed" in job["error"] and "rlimit" in job["error"], job
    return job


def _root_checkpoint(daemon: Daemon, pid: int, **env: str) -> str:
    got = daemon.node.cli("checkpoint", "--pid", str(pid), "--leave-running", "--wait", "--json")
    assert got.rc == 0, got.stderr + daemon.node.log()
    assert got.json["state"] == "succeeded", got.json
    checkpoint_id: str = got.json["checkpoint_id"]
    return checkpoint_id


def _write_pid_file(path: Path, pid: int, *, owner: int = 0, mode: int = 0o644) -> None:
    path.unlink(missing_ok=True)
    path.write_text(f"{pid}\n")
    os.chown(path, owner, -1)
    path.chmod(mode)


# --- a member of the socket group and a root process ---------------------------------------


def test_member_cannot_checkpoint_kill_or_restore_a_root_process(
    daemon: Daemon, procs: list[OwnProcess]
) -> None:
    victim = _root_process(daemon, procs)
    # The default checkpoint is kill mode: refused, and the process is still running.
    got = as_user(MEMBER, daemon.node, "checkpoint", "--pid", str(victim.pid), "--wait")
    denied(got, "may not checkpoint", f"pid {victim.pid}", "root (uid 0)")
    as_json = as_user(MEMBER, daemon.node, "checkpoint", "--pid", str(victim.pid), "--json")
    assert as_json.rc == EXIT_PERMISSION_DENIED, str(as_json)
    assert as_json.json()["kind"] == "permission_denied" and as_json.json()["exit_code"] == 6
    denied(as_user(MEMBER, daemon.node, "checkpoint", "--workload", "rootsvc"), "rootsvc")
    assert victim.running()

    checkpoint_id = _root_checkpoint(daemon, victim.pid)
    denied(as_user(MEMBER, daemon.node, "restore", checkpoint_id, "--wait"), checkpoint_id)
    assert victim.running()
    jobs = daemon.node.cli("jobs", "--json").json["jobs"]
    assert not [j for j in jobs if j["kind"] == "restore"], jobs


def test_the_refusal_is_permission_denied_on_the_wire(
    daemon: Daemon, procs: list[OwnProcess]
) -> None:
    victim = _root_process(daemon, procs)
    helper = Path(__file__).with_name("_raw_call.py")
    proc = subprocess.run(
        [sys.executable, str(helper), MEMBER, str(daemon.node.socket), str(victim.pid)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=REPO,
        env=_env(),
    )
    assert proc.returncode == 0, proc.stderr
    code, kind, _ = proc.stdout.split(" ", 2)
    assert (code, kind) == ("PERMISSION_DENIED", "permission_denied"), proc.stdout
    assert victim.running()


def test_member_cannot_cancel_a_job_it_did_not_start(
    daemon: Daemon, procs: list[OwnProcess]
) -> None:
    victim = _root_process(daemon, procs)
    got = daemon.node.cli("checkpoint", "--pid", str(victim.pid), "--leave-running", "--json")
    assert got.rc == 0, got.stderr
    job_id = got.json["id"]
    denied(as_user(MEMBER, daemon.node, "cancel", job_id), job_id, "did not start it")
    assert daemon.node.job(job_id)["state"] != "cancelled"


def test_member_sees_no_environment_values_of_a_root_checkpoint(
    daemon: Daemon, procs: list[OwnProcess]
) -> None:
    os.environ["GPUSNAP_AUTHZ_SECRET"] = SECRET
    try:
        victim = _root_process(daemon, procs)
    finally:
        del os.environ["GPUSNAP_AUTHZ_SECRET"]
    checkpoint_id = _root_checkpoint(daemon, victim.pid)

    shown = as_user(MEMBER, daemon.node, "show", checkpoint_id, "--show-env", "--json")
    assert shown.rc == EXIT_OK, str(shown)
    assert SECRET not in shown.out
    launch = shown.json()["stamp"]["launch"]
    assert launch["env"]["GPUSNAP_AUTHZ_SECRET"] is None and launch["env_hidden"] is True
    assert SECRET not in as_user(MEMBER, daemon.node, "show", checkpoint_id, "--show-env").out
    # Root (an administrator) still sees it when asking for it.
    mine = daemon.node.cli("show", checkpoint_id, "--show-env", "--json")
    assert mine.json["stamp"]["launch"]["env"]["GPUSNAP_AUTHZ_SECRET"] == SECRET


def test_admin_group_member_may_checkpoint_a_root_process(
    daemon: Daemon, procs: list[OwnProcess]
) -> None:
    victim = _root_process(daemon, procs)
    got = as_user(
        ADMIN, daemon.node, "checkpoint", "--pid", str(victim.pid), "--leave-running", "--wait"
    )
    assert got.rc == EXIT_OK, str(got) + daemon.node.log()
    assert victim.running()


# --- what a member may do -------------------------------------------------------------------


def test_member_may_checkpoint_a_tree_of_its_own(daemon: Daemon, procs: list[OwnProcess]) -> None:
    own = _member_process(daemon, procs)
    got = as_user(
        MEMBER,
        daemon.node,
        "checkpoint",
        "--pid",
        str(own.pid),
        "--leave-running",
        "--wait",
        "--json",
    )
    ran_on(Out(got.rc, got.out, got.err), own.pid)


@pytest.mark.skipif(
    not CRIU_DUMPS_OTHER_UIDS, reason="CRIU needs CAP_SYS_RESOURCE to dump another uid's task"
)
def test_member_checkpoints_and_restores_a_tree_of_its_own(
    daemon: Daemon, procs: list[OwnProcess]
) -> None:
    own = _member_process(daemon, procs)
    got = as_user(MEMBER, daemon.node, "checkpoint", "--pid", str(own.pid), "--wait", "--json")
    assert got.rc == EXIT_OK, str(got) + daemon.node.log()
    own.proc.wait(60)  # kill mode: gone, and its pid free for the restore
    checkpoint_id = got.json()["checkpoint_id"]
    shown = daemon.node.cli("show", checkpoint_id, "--json").json
    assert shown["stamp"]["process"]["uids"] == [daemon.member.pw_uid]

    back = as_user(MEMBER, daemon.node, "restore", checkpoint_id, "--wait", "--json")
    assert back.rc == EXIT_OK, str(back) + daemon.node.log()
    (pid, *_) = back.json()["pids"]
    try:
        assert pid == own.pid
        uid_line = next(
            line
            for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            if line.startswith("Uid:")
        )
        assert set(uid_line.split()[1:]) == {str(daemon.member.pw_uid)}
    finally:
        workloads.kill_tree(pid)


def test_member_acts_on_a_workload_that_allows_it(daemon: Daemon, procs: list[OwnProcess]) -> None:
    served = _root_process(daemon, procs)
    _write_pid_file(daemon.pid_files["shared"], served.pid)
    got = as_user(
        MEMBER, daemon.node, "checkpoint", "--workload", "shared", "--leave-running", "--wait"
    )
    assert got.rc == EXIT_OK, str(got) + daemon.node.log()
    assert served.running()
    # The same member, a workload that does not name it: refused.
    _write_pid_file(daemon.pid_files["rootsvc"], served.pid)
    denied(as_user(MEMBER, daemon.node, "checkpoint", "--workload", "rootsvc"), "allow_users")


# --- pid files and match -------------------------------------------------------------------


def test_pid_file_writable_by_others_is_refused(daemon: Daemon, procs: list[OwnProcess]) -> None:
    served = _root_process(daemon, procs)
    _write_pid_file(daemon.pid_files["loose"], served.pid, mode=0o666)
    got = daemon.node.cli("checkpoint", "--workload", "loose", "--leave-running", "--json")
    assert got.rc == EXIT_PERMISSION_DENIED, got.stderr
    assert "writable by group or others (mode 0666)" in got.json["error"]
    assert served.running()


def test_pid_file_owned_by_another_user_is_refused_unless_it_is_the_workloads_user(
    daemon: Daemon, procs: list[OwnProcess]
) -> None:
    served = _root_process(daemon, procs)
    uid = daemon.member.pw_uid
    _write_pid_file(daemon.pid_files["foreign"], served.pid, owner=uid)
    got = daemon.node.cli("checkpoint", "--workload", "foreign", "--leave-running", "--json")
    assert got.rc == EXIT_PERMISSION_DENIED, got.stderr
    assert f"owned by {MEMBER}, not root" in got.json["error"]
    # The workload's user may own its pid file, and name with it only their own processes.
    _write_pid_file(daemon.pid_files["mine"], served.pid, owner=uid)
    got = daemon.node.cli("checkpoint", "--workload", "mine", "--leave-running", "--json")
    assert got.rc == EXIT_PERMISSION_DENIED, got.stderr
    assert f"pid {served.pid} runs as root (uid 0), not as {MEMBER}" in got.json["error"]
    theirs = _member_process(daemon, procs)
    _write_pid_file(daemon.pid_files["mine"], theirs.pid, owner=uid)
    ok = daemon.node.cli("checkpoint", "--workload", "mine", "--leave-running", "--wait", "--json")
    ran_on(Out(ok.rc, ok.stdout, ok.stderr), theirs.pid)
    assert served.running() and theirs.running()


def test_workload_reasons_name_the_pid_file_refusals(tmp_path: Path) -> None:
    pid_file = tmp_path / "w.pid"
    _write_pid_file(pid_file, 1, mode=0o622)
    (reason,) = workload_reasons(WorkloadConfig(name="w", pid_file=pid_file))
    assert reason.startswith("workload w: pid file") and "mode 0622" in reason
    member = ensure_user(MEMBER, [GROUP])
    _write_pid_file(pid_file, 1, owner=member.pw_uid)
    (reason,) = workload_reasons(WorkloadConfig(name="w", pid_file=pid_file))
    assert f"owned by {MEMBER}" in reason
    assert workload_reasons(WorkloadConfig(name="w", pid_file=pid_file, user=MEMBER)) == []
    link = tmp_path / "link.pid"
    link.symlink_to(pid_file)
    (reason,) = workload_reasons(WorkloadConfig(name="w", pid_file=link, user=MEMBER))
    assert "symbolic link" in reason


def test_match_with_user_finds_only_that_users_process(
    daemon: Daemon, procs: list[OwnProcess]
) -> None:
    theirs = _member_process(daemon, procs)
    _root_process(daemon, procs)  # matches the regex too, as root
    ambiguous = daemon.node.cli("checkpoint", "--workload", "anymatch", "--leave-running")
    assert ambiguous.rc != EXIT_OK and "processes match" in ambiguous.stderr, ambiguous.stderr
    got = daemon.node.cli(
        "checkpoint", "--workload", "bymatch", "--leave-running", "--wait", "--json"
    )
    ran_on(Out(got.rc, got.stdout, got.stderr), theirs.pid)


# --- mutual TLS ------------------------------------------------------------------------------


def _over_tls(daemon: Daemon, cert: Path, key: Path, *args: str) -> Out:
    proc = subprocess.run(
        [
            str(BIN / "gpusnap"),
            "--address",
            daemon.address,
            "--tls-ca",
            str(daemon.pki.server_ca),
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    return Out(proc.returncode, proc.stdout, proc.stderr)


def test_certificate_mapped_to_a_user_is_limited_like_that_user(
    daemon: Daemon, procs: list[OwnProcess]
) -> None:
    victim = _root_process(daemon, procs)
    pki = daemon.pki
    got = _over_tls(daemon, pki.member_cert, pki.member_key, "checkpoint", "--pid", str(victim.pid))
    denied(got, MEMBER, "root (uid 0)")
    assert victim.running()
    status = _over_tls(daemon, pki.member_cert, pki.member_key, "status", "--json")
    assert status.rc == EXIT_OK, str(status)
    own = _member_process(daemon, procs)
    mine = _over_tls(
        daemon,
        pki.member_cert,
        pki.member_key,
        "checkpoint",
        "--pid",
        str(own.pid),
        "--leave-running",
        "--wait",
        "--json",
    )
    ran_on(mine, own.pid)
    admin = _over_tls(
        daemon,
        pki.admin_cert,
        pki.admin_key,
        "checkpoint",
        "--pid",
        str(victim.pid),
        "--leave-running",
        "--wait",
    )
    assert admin.rc == EXIT_OK, str(admin) + daemon.node.log()


def test_certificate_in_no_mapping_may_do_nothing(daemon: Daemon) -> None:
    got = _over_tls(daemon, daemon.pki.stranger_cert, daemon.pki.stranger_key, "status")
    denied(got, "certificate unlisted", "[daemon.tcp.clients]")
