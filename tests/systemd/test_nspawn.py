"""gpusnapd under a real systemd: installed by scripts/install.sh into a Debian 12 container
booted with systemd-nspawn (tests/systemd/nspawn.py), from a wheel and wheelhouse built on this
machine, with no network inside. Each test drives the service as an operator would, through
systemctl and the CLI, and reads systemd's own record of what happened (``systemctl show``).

Some settings are shortened for the tests with drop-ins named ``test-*.conf`` (WatchdogSec,
TimeoutStopSec), so that a timeout is seconds, not minutes; the ``service`` fixture removes
them after each test.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from tests.systemd.nspawn import FREEZABLE_DIR, Container
from tests.systemd.payload import KEY_FILE, Payload, changed_wheel, install_command

# One booted container (``machine``) and one wheel (``payload``) for the session: on one xdist
# worker, not made once per worker.
pytestmark = [pytest.mark.nspawn, pytest.mark.slow, pytest.mark.xdist_group("nspawn")]

UNIT = "gpusnapd.service"
DROPIN_DIR = "/etc/systemd/system/gpusnapd.service.d"

# The workloads run as root with a small capability bounding set (CRIU restores a tree only
# with capabilities gpusnapd's own bounding set holds, see the unit) and, but in the journal
# test, stdout/stderr off the journal.
WORKLOAD_PROPS = (
    "CapabilityBoundingSet=CAP_NET_BIND_SERVICE",
    "StandardOutput=null",
    "StandardError=null",
)
COUNTER_FILE = "/run/gpusnap-test-counter"
COUNTER = f"""
import itertools, os, time
for i in itertools.count():
    with open("{COUNTER_FILE}.tmp", "w") as f:
        f.write(str(i))
    os.replace("{COUNTER_FILE}.tmp", "{COUNTER_FILE}")
    time.sleep(0.05)
"""


def gpusnap(machine: Container, *args: str, **kwargs: Any) -> Any:
    """``gpusnap ARGS --json`` in the container, parsed."""
    return json.loads(machine.run("gpusnap", *args, "--json", **kwargs).stdout)


def start_workload(machine: Container, unit: str, program: str, *props: str) -> int:
    """Run ``python3 -c program`` as the transient service ``unit``; its main pid."""
    machine.sh(f"systemctl reset-failed {unit} 2>/dev/null || true")
    machine.run(
        "systemd-run",
        f"--unit={unit}",
        *(f"--property={p}" for p in (*WORKLOAD_PROPS, *props)),
        "python3",
        "-c",
        program,
    )
    return int(machine.show(unit, "MainPID")["MainPID"])


def drop_in(machine: Container, name: str, body: str) -> None:
    """A ``test-NAME.conf`` drop-in for gpusnapd, then daemon-reload and a fresh start."""
    machine.sh(
        f"""
        mkdir -p {DROPIN_DIR}
        printf '[Service]\\n{body}\\n' > {DROPIN_DIR}/test-{name}.conf
        systemctl daemon-reload
        systemctl reset-failed {UNIT}
        systemctl restart {UNIT}
        """
    )


def main_pid(machine: Container) -> int:
    return int(machine.show(UNIT, "MainPID")["MainPID"])


def read_counter(machine: Container) -> int:
    return int(machine.run("cat", COUNTER_FILE).stdout)


def alive(machine: Container, pid: int) -> bool:
    return machine.run("kill", "-0", str(pid), check=False).returncode == 0


def stop_units(machine: Container, unit: str, *scopes: str) -> None:
    """The cleanup after a test's workload: stop the scopes its restores made and its unit, and
    forget the unit's failure (a checkpoint in kill mode fails it), whatever state each is in."""
    stop_scopes = f"systemctl stop {' '.join(scopes)} 2>/dev/null || true" if scopes else ""
    machine.sh(
        f"""
        {stop_scopes}
        systemctl stop {unit} 2>/dev/null || true
        systemctl reset-failed {unit} 2>/dev/null || true
        """
    )


# -- the install -----------------------------------------------------------------------------


def test_install_links_both_commands_where_the_units_exec_start_looks(machine: Container) -> None:
    exec_start = machine.show(UNIT, "ExecStart")["ExecStart"]
    assert "path=/usr/bin/gpusnapd ;" in exec_start
    assert "argv[]=/usr/bin/gpusnapd --config /etc/gpusnap/gpusnapd.toml ;" in exec_start
    for name in ("gpusnap", "gpusnapd"):
        assert machine.sh(f"command -v {name}").stdout.strip() == f"/usr/bin/{name}"
        target = machine.run("readlink", "-f", f"/usr/bin/{name}").stdout.strip()
        assert target == f"/opt/gpusnap/venv/bin/{name}"
    version = machine.run("gpusnapd", "--version").stdout.strip()
    assert version.startswith("gpusnapd ")


def test_the_venv_holds_the_runtime_dependencies_and_no_dev_tools(machine: Container) -> None:
    listed = machine.run(
        "/opt/gpusnap/venv/bin/python", "-m", "pip", "list", "--format=json"
    ).stdout
    names = {p["name"].lower() for p in json.loads(listed)}
    assert {"gpusnap", "grpcio", "boto3", "zstandard", "cryptography", "jeepney"} <= names
    dev = {"pytest", "moto", "mypy", "ruff", "numpy", "grpcio-tools", "mypy-protobuf"}
    assert names.isdisjoint(dev), names & dev


def test_installed_units_pass_systemd_analyze_verify(machine: Container) -> None:
    proc = machine.run(
        "systemd-analyze", "verify", "--man=no", f"/usr/lib/systemd/system/{UNIT}", check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert UNIT not in proc.stdout + proc.stderr  # no warning about our unit


def test_the_docs_are_where_the_units_documentation_points(machine: Container) -> None:
    doc = machine.show(UNIT, "Documentation")["Documentation"]
    assert doc == "file:/usr/share/doc/gpusnap/operations.md"
    machine.run("test", "-s", doc.removeprefix("file:"))


def test_the_socket_group_comes_from_sysusers(service: Container) -> None:
    group = service.run("getent", "group", "gpusnap").stdout.strip()
    gid = int(group.split(":")[2])
    declared = service.run("systemd-sysusers", "--cat-config").stdout
    assert "g gpusnap -" in declared  # the group is sysusers' (no groupadd in the install)
    socket_dir = service.run("stat", "-c", "%a %U %g", "/run/gpusnap").stdout.split()
    assert socket_dir == ["750", "root", str(gid)]
    sock = service.run("stat", "-c", "%F %a %U %g", "/run/gpusnap/gpusnapd.sock").stdout
    assert sock.split()[-3:] == ["660", "root", str(gid)]
    assert sock.startswith("socket")
    member = service.run(
        "gpusnap", "status", "--json", properties=("User=nobody", "SupplementaryGroups=gpusnap")
    )
    assert json.loads(member.stdout)["pid"] == main_pid(service)
    stranger = service.run("gpusnap", "status", properties=("User=nobody",), check=False)
    assert stranger.returncode == 5
    assert "Permission denied" in stranger.stderr


# -- the service under systemd ---------------------------------------------------------------


def test_the_unit_is_active_only_once_the_daemon_sent_ready(service: Container) -> None:
    service.run("systemctl", "restart", UNIT)  # returns when the start job is done
    status = gpusnap(service, "status")  # so the socket already accepts calls
    props = service.show(
        UNIT,
        "ActiveState",
        "StatusText",
        "ExecMainStartTimestampMonotonic",
        "ActiveEnterTimestampMonotonic",
    )
    assert props["ActiveState"] == "active"
    assert status["pid"] == main_pid(service)
    assert props["StatusText"].startswith("serving")  # sent with READY=1
    # The socket is made before READY=1 and READY=1 makes the unit active: with Type=simple
    # the unit would be active at the exec, before the daemon had even imported its code.
    clock = service.run(
        "python3",
        "-c",
        "import os, time; st = os.stat('/run/gpusnap/gpusnapd.sock');"
        "print(time.monotonic_ns() - (time.time_ns() - st.st_ctime_ns))",
    )
    socket_made_us = int(clock.stdout) // 1000
    started_us = int(props["ExecMainStartTimestampMonotonic"])
    active_us = int(props["ActiveEnterTimestampMonotonic"])
    assert started_us < socket_made_us <= active_us


def test_the_watchdog_restarts_a_daemon_that_stops_pinging(service: Container) -> None:
    # Only the timeout is shortened (WatchdogSec=30s in the unit); LimitCORE=0: the SIGABRT
    # systemd sends would otherwise write a core of the whole daemon.
    drop_in(service, "watchdog", "WatchdogSec=2s\\nLimitCORE=0")
    before = service.show(UNIT, "MainPID", "NRestarts", "WatchdogUSec")
    assert before["WatchdogUSec"] == "2s"
    pid = int(before["MainPID"])
    # A daemon that pings outlives several watchdog periods.
    time.sleep(6)
    assert service.show(UNIT, "MainPID", "NRestarts") == {
        "MainPID": str(pid),
        "NRestarts": before["NRestarts"],
    }
    since = service.run("date", "+%Y-%m-%d %H:%M:%S").stdout.strip()
    service.run("kill", "-STOP", str(pid))  # alive, but its watchdog thread cannot ping
    service.wait_for(
        "a restarted gpusnapd",
        f"""
        [ "$(systemctl show -p MainPID --value {UNIT})" != {pid} ]
        [ "$(systemctl show -p MainPID --value {UNIT})" != 0 ]
        systemctl -q is-active {UNIT}
        """,
    )
    after = service.show(UNIT, "NRestarts")
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1
    journal = service.run("journalctl", "-u", UNIT, "--since", since, "--no-pager").stdout
    assert "Watchdog timeout (limit 2s)!" in journal
    assert not alive(service, pid)


@pytest.fixture
def frozen_store(service: Container) -> Container:
    if service.run("test", "-e", f"{FREEZABLE_DIR}/.freezable", check=False).returncode != 0:
        pytest.skip("no loop device for a freezable file system here (mount -o loop failed)")
    return service


def test_systemctl_stop_during_a_checkpoint_waits_for_it_to_commit(frozen_store: Container) -> None:
    machine = frozen_store
    stop_timeout = 3  # seconds; the unit has 150 s
    drop_in(machine, "stop", f"TimeoutStopSec={stop_timeout}s")
    unit = "gpusnap-test-holder.service"
    start_workload(machine, unit, "import os, time\nb = os.urandom(8 << 20)\ntime.sleep(1e9)")
    try:
        gpusnap(machine, "checkpoint", "--workload", "holder", "--leave-running", "--wait")
        # Every write to the store now waits: the checkpoint cannot commit until the thaw.
        machine.run("fsfreeze", "-f", FREEZABLE_DIR)
        try:
            job = gpusnap(machine, "checkpoint", "--workload", "holder", "--leave-running")
            machine.wait_for(
                "the checkpoint running",
                f'gpusnap job {job["id"]} --json | grep -q \'"state": "running"\'',
            )
            pid = main_pid(machine)
            machine.run("systemctl", "stop", "--no-block", UNIT)
            machine.wait_for(
                "gpusnapd deactivating",
                f"[ $(systemctl show -p ActiveState --value {UNIT}) = deactivating ]",
            )
            stop_began_us = int(
                machine.show(UNIT, "ActiveExitTimestampMonotonic")["ActiveExitTimestampMonotonic"]
            )
            # Twice the stop timeout later the daemon is still there, finishing the job: it
            # asked for more time (EXTEND_TIMEOUT_USEC) instead of being killed at 3 s.
            while time.monotonic() * 1e6 - stop_began_us < 2 * stop_timeout * 1e6:
                time.sleep(0.2)
            still = machine.show(UNIT, "ActiveState", "MainPID")
            assert still == {"ActiveState": "deactivating", "MainPID": str(pid)}
        finally:
            machine.run("fsfreeze", "-u", FREEZABLE_DIR)
        machine.wait_for(
            "gpusnapd stopped", f"[ $(systemctl show -p ActiveState --value {UNIT}) = inactive ]"
        )
        done = machine.show(
            UNIT,
            "Result",
            "ActiveExitTimestampMonotonic",
            "InactiveEnterTimestampMonotonic",
        )
        assert done["Result"] == "success"  # not "timeout": nothing was killed
        # Its own last word (the normal way out), and systemd's.
        machine.wait_for(
            "the clean exit in the journal",
            f"""journalctl -u {UNIT} -n 30 --no-pager > /run/gpusnap-test-journal
            grep -q 'gpusnapd stopped' /run/gpusnap-test-journal
            grep -q '{UNIT}: Deactivated successfully.' /run/gpusnap-test-journal""",
        )
        took_us = int(done["InactiveEnterTimestampMonotonic"]) - int(
            done["ActiveExitTimestampMonotonic"]
        )
        assert took_us > stop_timeout * 1e6
        machine.run("systemctl", "start", UNIT)
        finished = gpusnap(machine, "job", job["id"])
        assert finished["state"] == "succeeded", finished
        listed = json.dumps(gpusnap(machine, "ls", "--workload", "holder"))
        assert finished["result"]["checkpoint_id"] in listed
    finally:
        stop_units(machine, unit)


def test_a_units_workload_is_restored_into_a_scope_that_outlives_daemon_restarts(
    service: Container,
) -> None:
    unit = "gpusnap-test-counter.service"
    pid = start_workload(service, unit, COUNTER)
    scope = ""
    try:
        service.wait_for("the counter counting", f"[ $(cat {COUNTER_FILE}) -ge 3 ]")
        ckpt = gpusnap(service, "checkpoint", "--workload", "counter", "--wait")  # kill mode
        assert not alive(service, pid)
        at_kill = read_counter(service)
        assert service.show(unit, "ActiveState")["ActiveState"] in ("failed", "inactive")

        restored = gpusnap(service, "restore", ckpt["checkpoint_id"], "--wait")
        assert restored["mode"] == "restored"
        assert restored["pids"] == [pid]  # CRIU gives the tree its own pid back
        cgroup = service.run("cat", f"/proc/{pid}/cgroup").stdout
        line = next(x for x in cgroup.splitlines() if x.startswith("0::"))
        scope = line.rsplit("/", 1)[-1]
        assert line == f"0::/system.slice/{scope}"
        assert scope.startswith("gpusnap-counter-") and scope.endswith(".scope")
        props = service.show(scope, "ActiveState", "ControlGroup")
        assert props["ActiveState"] == "active"
        procs = service.run("cat", f"/sys/fs/cgroup{props['ControlGroup']}/cgroup.procs").stdout
        assert str(pid) in procs.split()  # systemd supervises it in that scope
        service.wait_for(
            "the restored counter counting on", f"[ $(cat {COUNTER_FILE}) -gt {at_kill} ]"
        )

        daemon = main_pid(service)
        service.run("systemctl", "restart", UNIT)
        assert main_pid(service) != daemon
        before = read_counter(service)
        service.wait_for(
            "the counter counting after the restart", f"[ $(cat {COUNTER_FILE}) -gt {before} ]"
        )
        assert alive(service, pid)
        assert service.show(scope, "ActiveState")["ActiveState"] == "active"
    finally:
        stop_units(service, unit, *([scope] if scope else []))


def test_a_restored_units_workload_is_found_in_its_scope_which_says_what_it_holds(
    service: Container,
) -> None:
    unit = "gpusnap-test-counter.service"
    pid = start_workload(service, unit, COUNTER)
    scopes: list[str] = []
    try:
        service.wait_for("the counter counting", f"[ $(cat {COUNTER_FILE}) -ge 3 ]")
        for _ in range(2):  # a restore, a checkpoint of it by --workload, its restore
            ckpt = gpusnap(service, "checkpoint", "--workload", "counter", "--wait")
            gpusnap(service, "restore", ckpt["checkpoint_id"], "--wait")
            cgroup = service.run("cat", f"/proc/{pid}/cgroup").stdout
            scope = next(x for x in cgroup.splitlines() if x.startswith("0::")).rsplit("/")[-1]
            scopes.append(scope)
            description = service.show(scope, "Description")["Description"]
            assert description == f"gpusnap: counter restored from {ckpt['checkpoint_id']}"
            listed = {w["name"]: w for w in gpusnap(service, "workloads")["workloads"]}
            assert (listed["counter"]["running"], listed["counter"]["pid"]) == (True, pid)
        assert len(set(scopes)) == 2
    finally:
        stop_units(service, unit, *scopes)


def test_a_unit_that_logs_to_the_journal_is_checkpointed_and_restored(service: Container) -> None:
    unit = "gpusnap-test-counter.service"
    pid = start_workload(
        service, unit, COUNTER + "    print(f'count {i}', flush=True)\n", "StandardOutput=journal"
    )
    scope = ""
    try:
        service.wait_for("the counter counting", f"[ $(cat {COUNTER_FILE}) -ge 3 ]")
        ckpt = gpusnap(service, "checkpoint", "--workload", "counter", "--wait")
        at_kill = read_counter(service)
        restored = gpusnap(service, "restore", ckpt["checkpoint_id"], "--wait")
        assert restored["pids"] == [pid]
        cgroup = service.run("cat", f"/proc/{pid}/cgroup").stdout
        scope = next(x for x in cgroup.splitlines() if x.startswith("0::")).rsplit("/", 1)[-1]
        # What the restored tree prints goes on into the journal, on its new stream: each line
        # from the pid that wrote it, and, once journald has looked at that pid again, under
        # the scope it lives in now.
        service.wait_for(
            "the restored tree's output in the journal",
            f"journalctl _PID={pid} _TRANSPORT=stdout -o cat --no-pager"
            f" | grep -qx 'count {at_kill + 2}'",
        )
        service.wait_for(
            "its output under its scope",
            f"journalctl -u {scope} -o cat --no-pager | grep -q '^count '",
        )
    finally:
        stop_units(service, unit, *([scope] if scope else []))


# -- upgrade, uninstall, CRIU's apt source ---------------------------------------------------


JOB_IDS = (
    "import sqlite3;"
    "db = sqlite3.connect('file:/var/lib/gpusnap/jobs.sqlite?mode=ro', uri=True);"
    "print(sorted(r[0] for r in db.execute('select id from jobs')))"
)


def _fingerprint(machine: Container) -> str:
    """The config and the key (hashes), and the state: the job journal's job ids."""
    return machine.sh(
        f"""
        sha256sum /etc/gpusnap/gpusnapd.toml {KEY_FILE}
        python3 -c "{JOB_IDS}"
        """
    ).stdout


def test_a_second_install_changes_nothing_and_restarts_nothing(
    service: Container, payload: Payload
) -> None:
    pid, before = main_pid(service), _fingerprint(service)
    again = service.run(*install_command(payload))
    assert "is up to date" in again.stderr
    assert f"{UNIT} keeps running" in again.stderr
    assert main_pid(service) == pid
    assert _fingerprint(service) == before


def test_an_upgrade_restarts_the_daemon_onto_the_new_code_and_keeps_config_keys_state(
    service: Container, payload: Payload
) -> None:
    pid, before = main_pid(service), _fingerprint(service)
    newer = changed_wheel(payload.wheel, payload.wheel.parent / "newer")
    try:
        up = service.run(*install_command(payload, wheel=newer))
        assert f"restarting {UNIT} onto the new version" in up.stderr
        assert main_pid(service) != pid
        init = service.sh("cat /opt/gpusnap/venv/lib/python3*/site-packages/gpusnap/__init__.py")
        assert init.stdout.endswith("# upgraded\n")
        assert _fingerprint(service) == before
    finally:
        service.run(*install_command(payload))  # back to the session's wheel
    assert _fingerprint(service) == before


def test_uninstall_keeps_config_keys_state_and_restored_workloads(
    service: Container, payload: Payload
) -> None:
    before = _fingerprint(service)
    gone = service.run("bash", "/src/gpusnap/scripts/install.sh", "--uninstall")
    assert "kept /etc/gpusnap" in gone.stderr
    assert service.run("systemctl", "cat", UNIT, check=False).returncode != 0
    for path in ("/usr/bin/gpusnapd", "/usr/bin/gpusnap", "/opt/gpusnap/venv"):
        assert service.run("test", "-e", path, check=False).returncode != 0, path
    assert _fingerprint(service) == before
    service.run("getent", "group", "gpusnap")
    service.run(*install_command(payload))
    service.run("systemctl", "enable", "--now", UNIT)
    assert _fingerprint(service) == before


def test_install_criu_uses_a_debian_13_source_already_configured(machine: Container) -> None:
    ours = "/etc/apt/sources.list.d/gpusnap-trixie.sources"
    theirs = "/etc/apt/sources.list.d/debian13.sources"
    # The installed CRIU is kept off PATH and the wrapper moved, so the script goes on to the
    # Debian 12 path; its apt-get update then fails (no network here), after the source step.
    run = (
        "env PATH=/usr/sbin:/usr/bin:/sbin:/bin GPUSNAP_CRIU_WRAPPER=/run/t/criu "
        "GPUSNAP_CRIU_PREFIX=/run/t/prefix bash /src/gpusnap/scripts/install-criu.sh"
    )
    # How many sources apt reads trixie from (one line per architecture of each).
    count = (
        "apt-get indextargets --no-release-info --format '$(RELEASE) $(IDENTIFIER) "
        "$(SOURCESENTRY)' | grep '^trixie Packages ' | cut -d: -f1 | sort -u | wc -l"
    )
    try:
        machine.sh(
            f"""cat >{theirs} <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF"""
        )
        first = machine.sh(run, check=False)
        assert f"already configured in {theirs}" in first.stderr, first.stderr
        assert machine.run("test", "-e", ours, check=False).returncode != 0
        assert machine.sh(count).stdout.strip() == "1"
        machine.run("rm", theirs)
        second = machine.sh(run, check=False)
        assert machine.run("test", "-e", ours, check=False).returncode == 0, second.stderr
        assert machine.sh(count).stdout.strip() == "1"
    finally:
        machine.run(
            "rm",
            "-f",
            ours,
            theirs,
            "/etc/apt/preferences.d/gpusnap-trixie",
            "/etc/apt/sources.list.d/gpusnap-sid.sources",
            "/etc/apt/preferences.d/gpusnap-sid",
            check=False,
        )


def test_a_unit_with_a_mount_namespace_of_its_own_is_not_checkpointed(service: Container) -> None:
    unit = "gpusnap-test-counter.service"
    pid = start_workload(service, unit, COUNTER, "PrivateTmp=yes")
    try:
        service.wait_for("the counter counting", f"[ $(cat {COUNTER_FILE}) -ge 3 ]")
        proc = service.run(
            "gpusnap",
            "checkpoint",
            "--workload",
            "counter",
            "--leave-running",
            "--wait",
            check=False,
        )
        # CRIU refuses the unit's private mounts ("mnt: Mount ... has unreachable sharing");
        # the workload is untouched and keeps running.
        assert proc.returncode == 1
        assert f"criu dump of pid {pid} failed: mnt: " in proc.stderr
        assert alive(service, pid)
        assert service.show(unit, "ActiveState")["ActiveState"] == "active"
    finally:
        stop_units(service, unit)
