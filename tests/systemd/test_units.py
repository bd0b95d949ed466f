"""The unit files as systemd itself reads them: ``systemd-analyze verify`` on every unit, and
the sysusers/tmpfiles snippets applied by systemd's own tools into a scratch root."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNIT_DIR = REPO / "systemd"
UNITS = sorted(
    p for p in UNIT_DIR.iterdir() if p.suffix in (".service", ".socket", ".timer", ".path")
)
SYSTEM_UNIT_DIRS = (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system"))

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (scripts/bootstrap.sh installs it)",
)


def _exec_paths(unit: Path) -> list[str]:
    paths = []
    for line in unit.read_text().splitlines():
        m = re.match(r"\s*Exec\w+=\s*[-@:+!]*(\S+)", line)
        if m and m.group(1).startswith("/"):
            paths.append(m.group(1))
    return paths


@pytest.fixture
def fake_root(tmp_path: Path) -> Path:
    """A root with systemd's own units and our units' executables, so verify checks ours."""
    root = tmp_path / "root"
    system_dir = next(d for d in SYSTEM_UNIT_DIRS if d.is_dir())
    shutil.copytree(system_dir, root / "usr/lib/systemd/system", symlinks=True)
    for unit in UNITS:
        for exe in _exec_paths(unit):
            target = root / exe.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text("#!/bin/sh\nexit 0\n")
            target.chmod(0o755)
    return root


def _verify(root: Path, unit: Path) -> subprocess.CompletedProcess[str]:
    # With --root, systemd-analyze loads the unit from inside that root.
    installed = root / "etc/systemd/system" / unit.name
    installed.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(unit, installed)
    return subprocess.run(
        [
            "systemd-analyze",
            "verify",
            "--man=no",
            f"--root={root}",
            f"/etc/systemd/system/{unit.name}",
        ],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "SYSTEMD_LOG_COLOR": "0"},
    )


def test_there_are_units_to_verify() -> None:
    assert UNIT_DIR / "gpusnapd.service" in UNITS


@needs_analyze
@pytest.mark.parametrize("unit", UNITS, ids=lambda p: p.name)
def test_systemd_analyze_verify_passes_without_warnings(fake_root: Path, unit: Path) -> None:
    proc = _verify(fake_root, unit)
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if unit.name in line]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ours == []


@needs_analyze
def test_verify_reports_a_misspelt_directive(fake_root: Path, tmp_path: Path) -> None:
    # The check above can fail: the same setup flags a typo in a copy of our unit.
    (tmp_path / "bad").mkdir()
    bad = tmp_path / "bad" / "gpusnapd.service"
    bad.write_text((UNIT_DIR / "gpusnapd.service").read_text().replace("KillMode=", "KilMode="))
    proc = _verify(fake_root, bad)
    assert "Unknown key 'KilMode'" in proc.stdout + proc.stderr


def _service_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in (UNIT_DIR / "gpusnapd.service").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_service_has_the_documented_settings() -> None:
    s = _service_settings()
    assert s["Type"] == ["notify"]
    assert s["NotifyAccess"] == ["main"]
    assert s["Restart"] == ["on-failure"]
    assert s["KillMode"] == ["mixed"]
    # /run/gpusnap comes from the tmpfiles snippet, before every start; the daemon runs as
    # root:root (a Group= would make CRIU need CAP_SYS_RESOURCE for every root workload).
    assert s["ExecStartPre"] == ["/usr/bin/systemd-tmpfiles --create gpusnap.conf"]
    assert "RuntimeDirectory" not in s
    assert "Group" not in s
    assert s["StateDirectory"] == ["gpusnap"]
    assert s["ConfigurationDirectory"] == ["gpusnap"]
    assert "network-online.target" in s["Wants"][0].split()
    assert "network-online.target" in s["After"][0].split()
    assert s["ExecStart"][0].endswith("--config /etc/gpusnap/gpusnapd.toml")
    stop = s["TimeoutStopSec"][0]
    assert stop.endswith("s") and int(stop[:-1]) >= 120  # AWS gives a 2 minute notice
    assert "WatchdogSec" in s
    caps = " ".join(s["CapabilityBoundingSet"]).split()
    for cap in (
        "CAP_CHECKPOINT_RESTORE",
        "CAP_SYS_ADMIN",
        "CAP_SYS_PTRACE",
        "CAP_NET_ADMIN",
        "CAP_SYS_TIME",  # CRIU sets the restored tree's time-namespace offsets
    ):
        assert cap in caps


@pytest.mark.parametrize(
    "option",
    [
        "ProtectSystem",
        "ProtectHome",
        "PrivateTmp",
        "PrivateDevices",
        "NoNewPrivileges",
        "SystemCallFilter",
        "RestrictNamespaces",
        "ProtectControlGroups",
        "ProtectKernelTunables",
        "MemoryDenyWriteExecute",
        "DynamicUser",
        "PrivateNetwork",
    ],
)
def test_sandboxing_that_breaks_criu_is_off_and_explained(option: str) -> None:
    assert option not in _service_settings()
    comments = "\n".join(
        line for line in (UNIT_DIR / "gpusnapd.service").read_text().splitlines() if "#" in line
    )
    assert f"{option}=" in comments, f"say why {option}= is left off"


needs_sysusers = pytest.mark.skipif(
    shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None,
    reason="systemd-sysusers/systemd-tmpfiles not installed",
)


@needs_sysusers
def test_sysusers_and_tmpfiles_create_group_and_private_dirs(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")
    for name in ("shadow", "gshadow"):
        (root / "etc" / name).write_text("")
    subprocess.run(
        ["systemd-sysusers", f"--root={root}", str(UNIT_DIR / "gpusnap.sysusers.conf")],
        check=True,
        capture_output=True,
    )
    lines = (root / "etc/group").read_text().splitlines()
    groups = {line.split(":")[0]: line.split(":")[2] for line in lines}
    assert "gpusnap" in groups
    subprocess.run(
        ["systemd-tmpfiles", f"--root={root}", "--create", str(UNIT_DIR / "gpusnap.tmpfiles.conf")],
        check=True,
        capture_output=True,
    )
    run_dir = (root / "run/gpusnap").stat()
    assert stat.S_IMODE(run_dir.st_mode) == 0o750
    assert run_dir.st_uid == 0
    assert run_dir.st_gid == int(groups["gpusnap"])
    assert stat.S_IMODE((root / "var/lib/gpusnap").stat().st_mode) == 0o700
