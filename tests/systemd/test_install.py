"""``scripts/install.sh --root DIR``: the install staged into a tree, as a package build would,
from the session's wheel and wheelhouse (tests/systemd/conftest.py). The live install, with
systemd applying it, is tested in a container (test_nspawn.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from tests.systemd.nspawn import REPO
from tests.systemd.payload import Payload, changed_wheel

# The session's wheel and wheelhouse (``payload``) are built once, on the nspawn tests' worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("nspawn")]

INSTALL = REPO / "scripts/install.sh"
SYSTEM_PYTHON = Path("/usr/bin/python3")

needs_venv = pytest.mark.skipif(
    subprocess.run(
        [str(SYSTEM_PYTHON), "-c", "import ensurepip, venv"], capture_output=True, check=False
    ).returncode
    != 0
    if SYSTEM_PYTHON.exists()
    else True,
    reason="/usr/bin/python3 cannot make a virtualenv (apt-get install python3-venv)",
)


def install(
    root: Path, payload: Payload, *args: str, wheel: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "bash",
            str(INSTALL),
            "--root",
            str(root),
            "--wheel",
            str(wheel or payload.wheel),
            "--wheelhouse",
            str(payload.wheelhouse),
            *args,
        ],
        capture_output=True,
        text=True,
        check=False,
    )


def uninstall(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(INSTALL), "--root", str(root), "--uninstall", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file outside the venv: (size, mtime_ns), to see what an install touched."""
    out = {}
    for path in root.rglob("*"):
        rel = str(path.relative_to(root))
        if rel.startswith("opt/gpusnap/venv/") or path.is_dir():
            continue
        st = path.lstat()
        out[rel] = (st.st_size, st.st_mtime_ns)
    return out


@pytest.fixture(scope="module")
def staged(payload: Payload, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("staged") / "root"
    proc = install(root, payload)
    assert proc.returncode == 0, proc.stderr
    return root


@pytest.fixture
def scratch(staged: Path, tmp_path: Path) -> Path:
    """A copy of the staged tree a test may change."""
    root = tmp_path / "root"
    # Hard links: the install only ever replaces files (install(1), a new venv swapped in),
    # never writes into one; /etc, which a test edits, is copied for real.
    shutil.copytree(staged, root, symlinks=True, copy_function=os.link)
    shutil.rmtree(root / "etc")
    shutil.copytree(staged / "etc", root / "etc", symlinks=True)
    return root


@needs_venv
def test_staged_tree_has_the_venv_links_units_docs_and_example_config(staged: Path) -> None:
    for name in ("gpusnap", "gpusnapd"):
        link = staged / "usr/bin" / name
        assert os.readlink(link) == f"/opt/gpusnap/venv/bin/{name}"
        script = staged / "opt/gpusnap/venv/bin" / name
        # The entry points name the venv where it will live, not where it was staged.
        assert script.read_text().splitlines()[0] == "#!/opt/gpusnap/venv/bin/python"
    unit = staged / "usr/lib/systemd/system/gpusnapd.service"
    assert "ExecStart=/usr/bin/gpusnapd --config /etc/gpusnap/gpusnapd.toml" in unit.read_text()
    for path in (
        "usr/lib/sysusers.d/gpusnap.conf",
        "usr/lib/tmpfiles.d/gpusnap.conf",
        "usr/lib/systemd/logind.conf.d/60-gpusnapd.conf",
        "usr/share/doc/gpusnap/operations.md",
        "usr/share/doc/gpusnap/gpusnapd.example.toml",
    ):
        assert (staged / path).is_file(), path
    config = staged / "etc/gpusnap/gpusnapd.toml"
    assert config.read_text() == (REPO / "systemd/gpusnapd.example.toml").read_text()
    assert oct(config.stat().st_mode & 0o777) == "0o640"
    venv = staged / "opt/gpusnap/venv"
    leaked = subprocess.run(
        ["grep", "-rlIF", str(staged), str(venv / "bin"), str(venv / "pyvenv.cfg")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert leaked.stdout == ""  # nothing names the staging tree


@needs_venv
def test_staged_venv_runs_the_daemon_and_cli_without_dev_tools(staged: Path) -> None:
    python = staged / "opt/gpusnap/venv/bin/python"
    # -I: this session's PYTHONPATH names the checkout; the venv must stand on its own.
    where = subprocess.run(
        [
            str(python),
            "-I",
            "-c",
            "import gpusnap.daemon.main, gpusnap.cli.main, gpusnap;print(gpusnap.__file__)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert where.stdout.startswith(str(staged / "opt/gpusnap/venv/lib/"))
    # Tracebacks name the files where they will be, not where they were staged.
    pyc = next(staged.glob("opt/gpusnap/venv/lib/python3*/site-packages/gpusnap/__pycache__/*.pyc"))
    code = subprocess.run(
        [
            str(python),
            "-c",
            "import marshal, sys;"
            "print(marshal.loads(open(sys.argv[1], 'rb').read()[16:]).co_filename)",
            str(pyc),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert code.stdout.startswith("/opt/gpusnap/venv/lib/python3")
    for dev in ("pytest", "moto", "mypy", "numpy", "grpc_tools"):
        proc = subprocess.run(
            [str(python), "-I", "-c", f"import {dev}"], capture_output=True, check=False
        )
        assert proc.returncode != 0, f"{dev} is in the production venv"


@needs_venv
@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze missing")
def test_staged_unit_passes_systemd_analyze_verify_with_its_real_exec_start(
    scratch: Path,
) -> None:
    system = next(
        d for d in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if d.is_dir()
    )
    for unit in system.iterdir():  # systemd's own units, which ours names
        target = scratch / "usr/lib/systemd/system" / unit.name
        if not target.exists() and not target.is_symlink():
            if unit.is_symlink():
                target.symlink_to(os.readlink(unit))
            elif unit.is_file():
                shutil.copyfile(unit, target)
    # ExecStartPre= names systemd-tmpfiles, part of systemd on a real target; verify only
    # checks that it is executable. Our own ExecStart= is the real, installed one.
    tmpfiles = scratch / "usr/bin/systemd-tmpfiles"
    tmpfiles.write_text("#!/bin/sh\n")
    tmpfiles.chmod(0o755)
    proc = subprocess.run(
        [
            "systemd-analyze",
            "verify",
            "--man=no",
            f"--root={scratch}",
            "/usr/lib/systemd/system/gpusnapd.service",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpusnapd.service" not in proc.stdout + proc.stderr


@needs_venv
def test_a_second_install_changes_nothing(scratch: Path, payload: Payload) -> None:
    before = tree(scratch)
    proc = install(scratch, payload)
    assert proc.returncode == 0, proc.stderr
    assert "venv /opt/gpusnap/venv is up to date" in proc.stderr
    assert tree(scratch) == before


@needs_venv
def test_an_upgrade_replaces_the_venv_and_keeps_config_keys_and_state(
    scratch: Path, payload: Payload, tmp_path: Path
) -> None:
    config = scratch / "etc/gpusnap/gpusnapd.toml"
    config.write_text(config.read_text() + "\n# edited by the operator\n")
    key = scratch / "etc/gpusnap/signing.key"
    key.write_text("not really a key, but the operator's")
    state = scratch / "var/lib/gpusnap/jobs.sqlite"
    state.parent.mkdir(parents=True)
    state.write_bytes(b"the journal")
    kept = {p: p.read_bytes() for p in (config, key, state)}
    newer = changed_wheel(payload.wheel, tmp_path)
    proc = install(scratch, payload, wheel=newer)
    assert proc.returncode == 0, proc.stderr
    assert "building the venv" in proc.stderr
    assert "kept /etc/gpusnap/gpusnapd.toml" in proc.stderr
    init = next(scratch.glob("opt/gpusnap/venv/lib/python3*/site-packages/gpusnap/__init__.py"))
    assert init.read_text().endswith("# upgraded\n")
    assert {p: p.read_bytes() for p in kept} == kept
    assert not (scratch / "opt/gpusnap/venv.old").exists()
    assert not (scratch / "opt/gpusnap/venv.new").exists()


@needs_venv
def test_uninstall_keeps_config_and_state_and_purge_deletes_them(scratch: Path) -> None:
    (scratch / "var/lib/gpusnap").mkdir(parents=True)
    (scratch / "var/lib/gpusnap/jobs.sqlite").write_bytes(b"the journal")
    proc = uninstall(scratch)
    assert proc.returncode == 0, proc.stderr
    for gone in (
        "opt/gpusnap/venv",
        "usr/bin/gpusnapd",
        "usr/bin/gpusnap",
        "usr/lib/systemd/system/gpusnapd.service",
        "usr/lib/sysusers.d/gpusnap.conf",
        "usr/share/doc/gpusnap",
        "opt/gpusnap",
    ):
        assert not (scratch / gone).exists() and not (scratch / gone).is_symlink(), gone
    assert (scratch / "etc/gpusnap/gpusnapd.toml").is_file()
    assert (scratch / "var/lib/gpusnap/jobs.sqlite").is_file()
    proc = uninstall(scratch, "--purge")
    assert proc.returncode == 0, proc.stderr
    assert not (scratch / "etc/gpusnap").exists()
    assert not (scratch / "var/lib/gpusnap").exists()


@needs_venv
def test_install_refuses_to_replace_a_gpusnapd_that_is_not_its_link(
    tmp_path: Path, payload: Payload
) -> None:
    root = tmp_path / "root"
    foreign = root / "usr/bin/gpusnapd"
    foreign.parent.mkdir(parents=True)
    foreign.write_text("#!/bin/sh\necho someone else's\n")
    proc = install(root, payload)
    assert proc.returncode == 1
    assert "/usr/bin/gpusnapd exists and is not gpusnap's link" in proc.stderr
    assert foreign.read_text() == "#!/bin/sh\necho someone else's\n"


def test_a_wrong_option_is_a_usage_error() -> None:
    proc = subprocess.run(
        ["bash", str(INSTALL), "--frobnicate"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert "unknown option --frobnicate" in proc.stderr
    assert "scripts/install.sh [--wheel FILE]" in proc.stderr


def test_the_wheel_carries_the_code_the_entry_points_and_no_tests(payload: Payload) -> None:
    with zipfile.ZipFile(payload.wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n) for n in names if n.endswith("entry_points.txt")).decode()
    for module in (
        "gpusnap/errors.py",
        "gpusnap/daemon/main.py",
        "gpusnap/cli/main.py",
        "gpusnap/storage/store.py",
        "gpusnap/proto/gpusnap/v1/gpusnap_pb2.py",
        "gpusnap/proto/gpusnap/v1/gpusnap_pb2_grpc.py",
        "gpusnap/py.typed",
    ):
        assert module in names, module
    assert "gpusnapd = gpusnap.daemon.main:main" in entry_points
    assert "gpusnap = gpusnap.cli.main:main" in entry_points
    assert not [n for n in names if n.startswith(("tests/", "bench/", "demo/"))]
