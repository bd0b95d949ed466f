"""A Debian 12 container booted by systemd-nspawn, with systemd as its PID 1, for the tests.

The root filesystem comes from ``scripts/nspawn-rootfs.sh`` (a cached tar.zst). Each boot:

- runs in a mount namespace of its own (``unshare --mount --propagation private``) with private
  tmpfs mounts on ``/tmp`` and ``/run/systemd``, so nothing nspawn or the container writes
  lands in the host's ``/tmp`` or ``/run``; the rootfs is unpacked into that private ``/tmp``
  and vanishes with the namespace;
- runs in a cgroup of its own, a child of the caller's cgroup v2 one, so the container's
  cgroups never land in the host's cgroup root, and ``cgroup.kill`` ends whatever is left;
- uses exactly the flags measured in issue 11: ``--register=no --keep-unit`` (no host
  systemd), ``SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1``, ``SYSTEMD_SECCOMP=0`` (CRIU cannot suspend
  seccomp under nspawn's filter), ``--capability=CAP_SYS_TIME`` (CRIU sets time-namespace
  offsets at restore), ``--private-network`` (no network inside), ``--volatile=overlay`` (the
  unpacked root stays untouched), plus ``--bind-ro`` of the checkout at ``/src/gpusnap``,
  ``--console=read-only`` (boot messages to the log, no getty) and, with ``freezable``, a
  ``--bind`` of a small ext4 file system at ``/srv/freezable`` (see ``FREEZABLE_DIR``);
- is entered with ``nsenter -t <init pid> -a systemd-run --wait --pipe ...``, so every command
  runs as a unit of the container's systemd, and is stopped by its pid (SIGTERM: nspawn shuts
  the container down), then by ``cgroup.kill`` if that did not end it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SRC_IN_CONTAINER = "/src/gpusnap"
# An ext4 file system (a loop device on a file in the private /tmp) bound here when asked:
# `fsfreeze -f` on it makes every write there wait until `fsfreeze -u`, which holds a store
# on it in the middle of an upload for as long as a test needs.
FREEZABLE_DIR = "/srv/freezable"
BOOT_TIMEOUT = 120.0  # hang guards only, never a performance expectation
STOP_TIMEOUT = 60.0


class BootFailed(RuntimeError):
    """nspawn exited before the container came up (the reason is in the message)."""


def cgroup2_mount() -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (unified or hybrid layout), or None."""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def _own_cgroup() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return "/"


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out += [int(p) for p in task.read_text().split()]
    return out


def _is_pid_ns_init(pid: int) -> bool:
    """True when ``pid`` is PID 1 of a pid namespace below ours ("NSpid: <pid> 1")."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            ids = line.split()[1:]
            return len(ids) == 2 and ids[1] == "1"
    return False


class Container:
    """One booted container. ``boot()``, then ``run()`` commands in it, then ``stop()``."""

    def __init__(
        self,
        rootfs_tar: Path,
        log_path: Path,
        name: str = "gpusnap-test",
        *,
        freezable: bool = False,
        src: Path = REPO,
    ) -> None:
        self.rootfs_tar = rootfs_tar
        self.freezable = freezable
        self.src = src  # the checkout bound read-only at SRC_IN_CONTAINER
        self.log_path = log_path
        self.name = name
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.init_pid = 0
        mount = cgroup2_mount()
        if mount is None:
            raise BootFailed("no cgroup v2 hierarchy mounted on this host")
        self.cgroup = mount / _own_cgroup().lstrip("/") / f"gpusnap-nspawn-{os.getpid()}-{name}"

    # -- lifecycle --------------------------------------------------------------------------

    def boot(self) -> None:
        self.cgroup.mkdir()
        flags = [
            "--quiet",
            "--boot",
            "--directory=/tmp/root",
            f"--machine={self.name}",
            "--register=no",
            "--keep-unit",
            "--capability=CAP_SYS_TIME",
            "--private-network",
            "--volatile=overlay",
            "--console=read-only",
            f"--bind-ro=/tmp/src:{SRC_IN_CONTAINER}",
        ]
        if self.freezable:
            flags.append("$freezable_bind")  # empty when no loop device could be had
        # The checkout and the rootfs archive are opened before /tmp is covered, so both can
        # be reached even from under /tmp (a checkout in /tmp). Everything from
        # `mount -t tmpfs` on happens in the private mount namespace.
        script = f"""
set -e
exec 3<{shlex.quote(str(self.src))}
exec 4<{shlex.quote(str(self.rootfs_tar))}
echo $$ > {shlex.quote(str(self.cgroup / "cgroup.procs"))}
mount -t tmpfs -o mode=1777 gpusnap-nspawn-tmp /tmp
mkdir -p /run/systemd
mount -t tmpfs -o mode=0755 gpusnap-nspawn-run /run/systemd
mkdir /tmp/root /tmp/src
mount --no-canonicalize --bind /proc/self/fd/3 /tmp/src
exec 3<&-
zstd -q -dc <&4 | tar -C /tmp/root --numeric-owner -xf -
exec 4<&-
freezable_bind=
if [ {int(self.freezable)} = 1 ] && truncate -s 256M /tmp/freezable.img \
    && mkfs.ext4 -q -F /tmp/freezable.img && mkdir /tmp/freezable \
    && mount -o loop /tmp/freezable.img /tmp/freezable; then
  touch /tmp/freezable/.freezable
  freezable_bind=--bind=/tmp/freezable:{FREEZABLE_DIR}
fi
exec env SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1 SYSTEMD_SECCOMP=0 systemd-nspawn {" ".join(flags)}
"""
        log = self.log_path.open("wb")
        try:
            self.nspawn = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        deadline = time.monotonic() + BOOT_TIMEOUT
        while not self.init_pid:
            if self.nspawn.poll() is not None:
                raise BootFailed(
                    f"systemd-nspawn exited {self.nspawn.returncode}: {self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"no container init after {BOOT_TIMEOUT:g}s: {self.log_tail()}")
            self.init_pid = next((p for p in _children(self.nspawn.pid) if _is_pid_ns_init(p)), 0)
            time.sleep(0.05)
        # Blocks until the boot transaction is done ("running" or "degraded"); says nothing
        # while the init is too young to have its private socket yet.
        while True:
            state = self._nsenter(
                ["systemctl", "is-system-running", "--wait"], timeout=BOOT_TIMEOUT
            ).stdout.strip()
            if state:
                break
            if self.nspawn.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"container systemd unreachable: {self.log_tail()}")
            time.sleep(0.05)
        if state not in ("running", "degraded"):
            raise RuntimeError(f"container boot ended {state!r}: {self.log_tail()}")

    def stop(self) -> None:
        """Shut the container down by nspawn's pid; kill what is left; remove the cgroup."""
        if self.nspawn is not None and self.nspawn.poll() is None:
            if self.init_pid and self.freezable:
                # A frozen file system would hang the container's shutdown on it.
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    self._nsenter(["fsfreeze", "-u", FREEZABLE_DIR], timeout=30)
            self.nspawn.send_signal(signal.SIGTERM)  # nspawn asks the container's init to halt
            try:
                self.nspawn.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        if self.cgroup.is_dir():
            with contextlib.suppress(OSError):
                (self.cgroup / "cgroup.kill").write_text("1")
            if self.nspawn is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.nspawn.wait(STOP_TIMEOUT)
            _remove_cgroup_tree(self.cgroup)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(line.strip() for line in text.splitlines()[-lines:] if line.strip())

    # -- commands ---------------------------------------------------------------------------

    def _nsenter(
        self, argv: Sequence[str], *, timeout: float, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["nsenter", "-t", str(self.init_pid), "-a", *argv],
            input=input_text,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def run(
        self,
        *argv: str,
        properties: Sequence[str] = (),
        timeout: float = 300.0,
        input_text: str | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the container as a transient service of its systemd, and wait.

        ``properties`` are ``systemd-run -p`` settings (``User=nobody``, ...). With
        ``check``, a non-zero exit raises with the command's output.
        """
        cmd = ["systemd-run", "--wait", "--pipe", "--quiet", "--collect"]
        cmd += [f"--property={p}" for p in properties]
        proc = self._nsenter([*cmd, "--", *argv], timeout=timeout, input_text=input_text)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{shlex.join(argv)} exited {proc.returncode} in the container:\n"
                f"{proc.stdout}{proc.stderr}"
            )
        return proc

    def sh(self, script: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        """``run("sh", "-ec", script)``."""
        return self.run("sh", "-ec", script, **kwargs)  # type: ignore[arg-type]

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """``systemctl show -p ...`` as a dict."""
        out = self.run("systemctl", "show", unit, *(f"--property={p}" for p in props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def wait_for(self, what: str, script: str, timeout: float = 120.0) -> str:
        """Run ``script`` until it exits 0; its stdout. A hang guard, not a timing claim."""
        deadline = time.monotonic() + timeout
        while True:
            proc = self.sh(script, check=False)
            if proc.returncode == 0:
                return proc.stdout
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout:g}s: {proc.stdout}{proc.stderr}")
            time.sleep(0.2)


def _remove_cgroup_tree(top: Path) -> None:
    for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            path.rmdir()
    with contextlib.suppress(OSError):
        top.rmdir()
