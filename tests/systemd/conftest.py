"""Fixtures for the install and systemd tests: the wheel and its wheelhouse, built here once per
session, and a container booted with systemd-nspawn with gpusnap installed into it by
``scripts/install.sh`` from them (no network inside).

The container tests are marked ``nspawn``. They are skipped, with the reason, only where a
container cannot be had: not root, systemd-nspawn or cgroup v2 missing, no cached root
filesystem and none can be built (``scripts/nspawn-rootfs.sh`` needs debootstrap and the Debian
archive), or nspawn exiting before the container boots. ``GPUSNAP_REQUIRE_NSPAWN=1`` (CI)
turns each of those skips into a failure.
"""

from __future__ import annotations

import email.parser
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.systemd.nspawn import FREEZABLE_DIR, REPO, BootFailed, Container, cgroup2_mount
from tests.systemd.payload import KEY_FILE, Payload, install_command

CACHE = REPO / ".cache" / "nspawn"


def unavailable(reason: str) -> None:
    """Skip: no container can be had here. A failure where CI says it must be had."""
    if os.environ.get("GPUSNAP_REQUIRE_NSPAWN") == "1":
        pytest.fail(f"GPUSNAP_REQUIRE_NSPAWN=1 but {reason}")
    pytest.skip(reason)


def _requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(name).decode())
    return sorted(meta.get_all("Requires-Dist") or [])


def _run_or_unavailable(argv: list[str], what: str) -> str:
    """``argv``'s stdout; when it fails, ``unavailable`` with ``what`` and its last words."""
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        unavailable(f"{what}: {' | '.join(proc.stderr.strip().splitlines()[-3:])}")
    return proc.stdout


def _pip(*args: str) -> None:
    _run_or_unavailable(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        f"pip {args[0]} failed (the package index unreachable?)",
    )


@pytest.fixture(scope="session")
def payload() -> Iterator[Payload]:
    """The wheel is built afresh every session (it is the code under test); the wheelhouse
    is kept under .cache/nspawn, keyed by the wheel's requirements (pip wheel, runtime
    dependencies only: no dev tools)."""
    session = CACHE / f"session-{os.getpid()}"
    shutil.rmtree(session, ignore_errors=True)
    session.mkdir(parents=True)
    try:
        _pip("wheel", "--no-deps", "-w", str(session), str(REPO))
        (wheel,) = session.glob("gpusnap-*.whl")
        reqs = _requirements(wheel)
        key = hashlib.sha256("\n".join([sys.version.split()[0], *reqs]).encode()).hexdigest()
        wheelhouse = CACHE / f"wheelhouse-{key[:16]}"
        if not wheelhouse.is_dir():
            building = CACHE / f"wheelhouse-{key[:16]}.{os.getpid()}"
            shutil.rmtree(building, ignore_errors=True)
            _pip("wheel", "--prefer-binary", "-w", str(building), *reqs)
            try:
                building.rename(wheelhouse)
            except OSError:  # another session (an xdist worker) built it meanwhile
                if not wheelhouse.is_dir():
                    raise
                shutil.rmtree(building, ignore_errors=True)
        yield Payload(wheel, wheelhouse)
    finally:
        shutil.rmtree(session, ignore_errors=True)


@pytest.fixture(scope="session")
def rootfs() -> Path:
    if os.geteuid() != 0:
        unavailable("systemd-nspawn needs root; run the suite as root")
    for tool in ("systemd-nspawn", "unshare", "nsenter", "zstd"):
        if shutil.which(tool) is None:
            unavailable(f"{tool} is not installed (scripts/bootstrap.sh installs it)")
    if cgroup2_mount() is None:
        unavailable("no cgroup v2 hierarchy is mounted here; systemd-nspawn needs one")
    out = _run_or_unavailable(
        ["bash", str(REPO / "scripts/nspawn-rootfs.sh")], "no root filesystem for the container"
    )
    return Path(out.strip().splitlines()[-1])


# The session's config: the installed example with the store on the freezable file system
# (when there is one) and the workloads the tests run as units of the container's systemd.
WORKLOADS = """
[[workload]]
name = "counter"
systemd_unit = "gpusnap-test-counter.service"

[[workload]]
name = "holder"
systemd_unit = "gpusnap-test-holder.service"
"""


@pytest.fixture(scope="session")
def machine(
    rootfs: Path, payload: Payload, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Container]:
    """A booted container with gpusnap installed, a signing key, and gpusnapd running."""
    log = tmp_path_factory.mktemp("nspawn") / "console.log"
    container = Container(rootfs, log, freezable=True)
    try:
        try:
            container.boot()
        except BootFailed as exc:
            unavailable(f"systemd-nspawn cannot boot a container here: {exc}")
        container.run(*install_command(payload))
        container.run("gpusnap", "store", "keygen", "--out", KEY_FILE)
        store = f"{FREEZABLE_DIR}/store"
        container.sh(
            f"""
            if [ -e {FREEZABLE_DIR}/.freezable ]; then
              sed -i 's|^url = "file:///var/lib/gpusnap/store"|url = "file://{store}"|' \\
                /etc/gpusnap/gpusnapd.toml
            fi
            cat >>/etc/gpusnap/gpusnapd.toml <<'EOF'
{WORKLOADS}
EOF
            gpusnapd --config /etc/gpusnap/gpusnapd.toml --check-config
            systemctl enable --now gpusnapd.service
            """
        )
        yield container
    finally:
        container.stop()


@pytest.fixture
def service(machine: Container) -> Iterator[Container]:
    """gpusnapd running with the installed unit as it is; after the test, the test's drop-ins
    are gone and the daemon runs again (a test may stop, kill or restart it)."""
    yield machine
    machine.sh(
        """
        rm -f /etc/systemd/system/gpusnapd.service.d/test-*.conf
        systemctl daemon-reload
        systemctl reset-failed gpusnapd.service || true  # also its start rate limit
        systemctl start gpusnapd.service
        """
    )
