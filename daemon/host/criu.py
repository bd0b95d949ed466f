"""CRIU, at arm's length: find it, check it, dump a process tree, restore it detached.

One ``Criu`` object wraps one criu binary (>= 4.0). ``dump`` and ``restore`` run it as a
subprocess with a log (``-v4`` unless configured lower) in the logs directory; a failure
becomes one of our error kinds whose one-line message carries the most telling
``Error (...)`` line of that log.

The options gpusnap passes, and why (docs/operations-criu.md has the long form):

- ``--file-locks``, ``--ext-unix-sk``, ``--link-remap``: a serving process holds flocks, talks to
  journald over a unix socket and may keep deleted files open; without these CRIU refuses it.
- ``--shell-job`` only when the process has a controlling terminal (a daemon has none).
- ``--tcp-established`` only on request: it restores live TCP connections, which only makes
  sense on the same node, with the same addresses. Otherwise ``--tcp-close``: a server's
  established connections are not saved and come back closed (its clients see the connection
  end), rather than CRIU refusing to dump a tree that has any.
- ``--manage-cgroups=ignore`` (default): the restored tree goes into the cgroup the restore runs
  in — a transient systemd scope where systemd is PID 1 — instead of CRIU recreating the old
  cgroup paths behind the service manager's back.
- ``--restore-detached``: CRIU exits once the tree runs; the tree does not depend on the caller.
- ``--external unix[INO]`` for each journal stream of the tree (stdout/stderr of a systemd unit,
  ``host/journalstream.py``), and at restore ``--inherit-fd fd[N]:socket:[INO]`` with a new
  stream to journald in its place: CRIU cannot dump one half of a stream connection.
- ``--libdir`` an empty directory: no CRIU plugin runs, CUDA's least of all (``criu_plugins``).
- ``--auto-dedup`` on the restore from a pull's staging only (``daemon/pipelines/restore.py``):
  each page is punched out of the images once restored, so the restored memory reuses those
  warm pages; never on a rescue from local images, which may have to be kept.

The dump records the options it used in ``gpusnap-criu.json`` next to the images, so a restore
(on any node, from the store) passes the matching ones.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gpusnap.daemon.host import criu_run, journalstream, proctree, tmpfsfiles
from gpusnap.daemon.host.criu_plugins import no_plugins_args
from gpusnap.daemon.host.openfiles import fit_tree, recorded_sizes
from gpusnap.errors import (
    Corrupt,
    DeadlineExceeded,
    FailedPrecondition,
    GpusnapError,
    Internal,
    InvalidArgument,
    NotFound,
    Unsupported,
)

log = logging.getLogger(__name__)

MIN_VERSION = (4, 0, 0)
# CRIU before 4.2 asks every socket for SO_PASSCRED/SO_PASSSEC; Linux 6.16 answers EOPNOTSUPP
# for a TCP socket, and the dump fails on any TCP socket (criu#2705, fixed in 4.2).
TCP_FIXED_VERSION = (4, 2, 0)
WRAPPER_PATH = Path("/usr/local/sbin/criu")  # where scripts/install-criu.sh puts it on Debian 12
OPTIONS_FILE = "gpusnap-criu.json"
MANAGE_CGROUPS_MODES = ("ignore", "none", "props", "soft", "full", "strict")

_VERSION_RE = re.compile(r"^Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", re.MULTILINE)
_STAT_RE = re.compile(r"^([A-Za-z][A-Za-z ]+?):\s*(\d+)", re.MULTILINE)
_PID_TAKEN_RE = re.compile(r"Can't fork for (\d+): File exists")
_ERROR_RE = re.compile(r"\b(Error|Warn) *\(([^)]*)\):\s*(.*)")
# Warnings that are the real cause when they come before the errors they lead to.
_SEIZE_FAILURES = ("Unable to interrupt task", "Unable to seize", "Can't seize")
# Error lines CRIU prints on healthy runs too (e.g. inside containers); never the cause.
_NOISE = ("rlimit: Can't setup RLIMIT_NOFILE", "Dumping FAILED", "Restoring FAILED")


@dataclass(frozen=True)
class TcpSupport:
    """Whether this CRIU can dump TCP sockets on this kernel, and the one line saying why."""

    ok: bool
    why: str


def kernel_answers_passcred_on_tcp() -> bool:
    """Whether this kernel answers ``getsockopt(SO_PASSCRED)`` on a TCP socket (before Linux
    6.16 it does; from 6.16 on, EOPNOTSUPP: what CRIU before 4.2 trips over)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sk:
        try:
            sk.getsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED)
        except OSError:
            return False
    return True


def tcp_support(version: tuple[int, int, int], kernel_answers: bool) -> TcpSupport:
    """The rule: CRIU >= 4.2 dumps TCP sockets on any kernel; an older one only where the
    kernel still answers SO_PASSCRED on a TCP socket (criu#2705)."""
    if version >= TCP_FIXED_VERSION:
        return TcpSupport(True, f"criu {_fmt(version)} >= 4.2 dumps TCP sockets on any kernel")
    if kernel_answers:
        return TcpSupport(
            True, f"criu {_fmt(version)}: this kernel still answers SO_PASSCRED on TCP sockets"
        )
    return TcpSupport(
        False,
        f"criu {_fmt(version)} cannot dump TCP sockets on this kernel (it refuses SO_PASSCRED"
        " on TCP sockets, Linux >= 6.16; criu#2705, fixed in 4.2)",
    )


@dataclass(frozen=True)
class DumpResult:
    pid: int
    images_dir: Path
    log_path: Path
    leave_running: bool
    pause_seconds: float  # what the workload saw: freezing + frozen time, else the call's wall time
    wall_seconds: float  # the whole criu call, start to exit
    images_bytes: int
    stats: dict[str, int] = field(default_factory=dict)  # criu --display-stats, e.g. "Frozen time"


@dataclass(frozen=True)
class RestoreResult:
    pid: int  # the root of the restored tree (its pid at dump time)
    images_dir: Path
    log_path: Path
    wall_seconds: float
    stats: dict[str, int] = field(default_factory=dict)


class Criu:
    """One criu binary. ``path``: explicit (config) > $GPUSNAP_CRIU > the wrapper > $PATH.

    ``log_level`` is criu's ``-v`` for the per-call log (0..4; 4, the default, is what a failure
    report needs and costs little: ~80 KB of log for a 2 GiB restore).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, log_level: int = 4) -> None:
        if not 0 <= log_level <= 4:
            raise InvalidArgument(f"criu log level must be 0 to 4, not {log_level}")
        self.log_level = log_level
        self._configured = Path(path) if path else None
        self._path: Path | None = None
        self._version: tuple[int, int, int] | None = None
        self._tcp: TcpSupport | None = None

    @property
    def path(self) -> Path:
        """The binary in use; Unsupported when there is none."""
        if self._path is None:
            self._path = self._locate()
        return self._path

    def _locate(self) -> Path:
        candidates: list[Path] = []
        if self._configured is not None:
            candidates.append(self._configured)  # configured: no fallback to anything else
        elif env := os.environ.get("GPUSNAP_CRIU"):
            candidates.append(Path(env))
        else:
            candidates.append(WRAPPER_PATH)
            if found := shutil.which("criu"):
                candidates.append(Path(found))
            candidates.append(Path("/usr/sbin/criu"))
        for cand in candidates:
            if cand.is_file() and os.access(cand, os.X_OK):
                log.debug("using criu at %s", cand)
                return cand
        where = ", ".join(str(c) for c in candidates)
        raise Unsupported(f"criu not found ({where}): run scripts/install-criu.sh")

    def version(self) -> tuple[int, int, int]:
        if self._version is None:
            try:
                proc = subprocess.run(
                    [str(self.path), "--version"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise Unsupported(
                    f"cannot run {self.path}: {exc}: run scripts/install-criu.sh"
                ) from exc
            m = _VERSION_RE.search(proc.stdout)
            if m is None:
                first = (proc.stdout + proc.stderr).strip().splitlines()[:1]
                raise Unsupported(
                    f"cannot read the version of {self.path} ({first[0] if first else 'no output'})"
                    ": run scripts/install-criu.sh"
                )
            self._version = (int(m[1]), int(m[2]), int(m[3] or 0))
        return self._version

    def tcp_support(self) -> TcpSupport:
        """Whether this CRIU dumps TCP sockets on this kernel (``tcp_support``'s rule, from its
        version and one getsockopt on a TCP socket; cached: neither changes while we run)."""
        if self._tcp is None:
            self._tcp = tcp_support(self.version(), kernel_answers_passcred_on_tcp())
        return self._tcp

    def check(self) -> None:
        """Raise Unsupported unless criu >= 4.0 is installed and ``criu check`` passes here."""
        ver = self.version()
        if ver < MIN_VERSION:
            raise Unsupported(
                f"criu {_fmt(ver)} at {self.path} is too old (need >= {_fmt(MIN_VERSION)}):"
                " run scripts/install-criu.sh"
            )
        proc = subprocess.run(
            [str(self.path), "check"], capture_output=True, text=True, timeout=60, check=False
        )
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
            errors = [ln for ln in lines if "Error" in ln and not any(n in ln for n in _NOISE)]
            why = (errors or lines or ["no output"])[-1].strip()
            raise Unsupported(f"criu check failed on this node: {why}")

    # -- dump ---------------------------------------------------------------------------------

    def dump(
        self,
        pid: int,
        images_dir: str | os.PathLike[str],
        *,
        leave_running: bool,
        log_path: str | os.PathLike[str],
        tcp_established: bool = False,
        shell_job: bool | None = None,
        manage_cgroups: str = "ignore",
        timeout: float | None = None,
        extra_args: Sequence[str] = (),
    ) -> DumpResult:
        """Dump the tree rooted at ``pid`` into ``images_dir`` (created; must be empty).

        ``leave_running=False`` kills the tree once dumped (reclaim); True thaws it.
        ``shell_job=None`` decides from the process: ``--shell-job`` iff it has a terminal.
        """
        images = Path(images_dir).absolute()
        logp = Path(log_path).absolute()
        if manage_cgroups not in MANAGE_CGROUPS_MODES:
            raise InvalidArgument(
                f"manage_cgroups must be one of {', '.join(MANAGE_CGROUPS_MODES)}"
            )
        if not proctree.exists(pid):
            raise NotFound(f"no such process: {pid}")
        if shell_job is None:
            shell_job = proctree.has_tty(pid)
        images.mkdir(parents=True, exist_ok=True)
        if any(images.iterdir()):
            raise FailedPrecondition(f"images directory {images} is not empty: use a fresh one")
        streams = journalstream.of_tree(proctree.tree_pids(pid))
        options = {
            "shell_job": shell_job,
            "tcp_established": tcp_established,
            # Connections not kept are not saved: the restored tree finds them closed (its
            # clients see the connection end and retry) instead of CRIU refusing the dump.
            "tcp_close": not tcp_established,
            "manage_cgroups": manage_cgroups,
            "criu_version": _fmt(self.version()),
            "journal_streams": [s.as_json() for s in streams],
        }
        argv = [str(self.path), "dump", "--tree", str(pid), "--images-dir", str(images)]
        argv += ["--log-file", str(logp), f"-v{self.log_level}", "--display-stats"]
        argv += _common_options(options)
        argv += ["--link-remap", *journalstream.dump_args(streams)]
        if leave_running:
            argv.append("--leave-running")
        # The tree's tmpfs files, saved while it is frozen (host/tmpfsfiles.py).
        script, script_err = _post_dump_script(logp, images)
        argv += ["--action-script", str(script)]
        argv += list(extra_args)

        log.info("criu dump of pid %d into %s (leave_running=%s)", pid, images, leave_running)
        start = time.monotonic()
        try:
            stdout = self._run(
                argv, images.parent, logp, timeout, kind="dump", what=f"dump of pid {pid}", pid=pid
            )
        except GpusnapError as err:
            why = _read_log(script_err).strip().splitlines()
            if why:
                raise Internal(f"criu dump of pid {pid} failed: {why[-1]} (log: {logp})") from err
            raise
        finally:
            script.unlink(missing_ok=True)
            script_err.unlink(missing_ok=True)
        wall = time.monotonic() - start
        if not leave_running:
            tmpfsfiles.remove_link_remaps(images)
        (images / OPTIONS_FILE).write_text(json.dumps(options, indent=1) + "\n")

        stats = parse_stats(stdout)
        pause = wall
        if "Frozen time" in stats:
            pause = (stats.get("Freezing time", 0) + stats["Frozen time"]) / 1e6
        size = sum(p.stat().st_size for p in images.rglob("*") if p.is_file())
        log.info("criu dump of pid %d: %.3fs, pause %.3fs, %d bytes", pid, wall, pause, size)
        return DumpResult(pid, images, logp, leave_running, pause, wall, size, stats)

    # -- restore ------------------------------------------------------------------------------

    def restore(
        self,
        images_dir: str | os.PathLike[str],
        *,
        log_path: str | os.PathLike[str],
        pidfile: str | os.PathLike[str],
        scope_unit: str | None = None,
        scope_description: str | None = None,
        sibling: bool = False,
        tcp_established: bool | None = None,
        timeout: float | None = None,
        extra_args: Sequence[str] = (),
    ) -> RestoreResult:
        """Restore the tree in ``images_dir`` detached; returns once it runs.

        Where systemd is PID 1 and ``scope_unit`` is given, criu runs inside a transient scope
        of that name (``systemd-run --scope``), so the tree lives outside the caller's cgroup;
        ``scope_description`` is what ``systemctl status`` shows of it (systemd's default is
        the whole command line). Otherwise criu runs in a new session. ``sibling=True`` makes
        the restored root a child of the caller (``--restore-sibling``), which then must reap
        it — for hosts whose PID 1 reaps no orphans.
        """
        images = Path(images_dir).absolute()
        logp = Path(log_path).absolute()
        pidp = Path(pidfile).absolute()
        if not (images / "inventory.img").is_file():
            raise NotFound(f"no CRIU images in {images} (inventory.img missing)")
        options = _read_options(images)
        if tcp_established is not None:
            options["tcp_established"] = tcp_established
            options["tcp_close"] = options["tcp_close"] and not tcp_established
        pidp.unlink(missing_ok=True)
        argv = [str(self.path), "restore", "--images-dir", str(images), "--restore-detached"]
        argv += ["--pidfile", str(pidp), "--log-file", str(logp), f"-v{self.log_level}"]
        argv.append("--display-stats")
        argv += _common_options(options)
        if sibling:
            argv.append("--restore-sibling")
        argv += list(extra_args)
        if scope_unit is not None and systemd_running():
            unit = scope_unit if scope_unit.endswith(".scope") else f"{scope_unit}.scope"
            wrap = ["systemd-run", "--scope", "--quiet", "--collect", f"--unit={unit}"]
            if scope_description:
                wrap.append(f"--description={scope_description}")
            argv = [*wrap, *argv]

        start = time.monotonic()
        _put_back_files(images)
        log.info("criu restore from %s", images)
        # New journal streams for the ones the tree had; CRIU puts each where the old one was.
        with journalstream.Replacements(_streams_of(options)) as streams:
            stdout = self._run(
                [*argv, *streams.args],
                images.parent,
                logp,
                timeout,
                kind="restore",
                what=f"restore from {images}",
                pass_fds=streams.fds,
            )
        wall = time.monotonic() - start
        try:
            pid = int(pidp.read_text().strip())
        except (OSError, ValueError) as exc:
            raise Internal(f"criu restore left no pid in {pidp}: see {logp}") from exc
        log.info("criu restore: pid %d running after %.3fs", pid, wall)
        return RestoreResult(pid, images, logp, wall, parse_stats(stdout))

    # -- running criu ---------------------------------------------------------------------------

    def _run(
        self,
        argv: list[str],
        workdir: Path,
        logp: Path,
        timeout: float | None,
        *,
        kind: str,
        what: str,
        pid: int | None = None,
        pass_fds: tuple[int, ...] = (),
    ) -> str:
        """Run criu (``criu_run``: a dump dies with the daemon, a restore finishes). Returns
        its stdout; raises our error kinds on failure."""
        logp.parent.mkdir(parents=True, exist_ok=True)
        rc, stdout = criu_run.run(
            argv,
            workdir,
            _stdout_path(logp),
            timeout,
            what=kind,
            die_with_daemon=kind == "dump",
            pass_fds=pass_fds,
        )
        if rc is None:
            raise DeadlineExceeded(
                f"criu {what} did not finish within {timeout:g}s and was stopped: see {logp}"
            )
        if rc != 0:
            raise classify_failure(what, _read_log(logp), logp, pid=pid)
        return stdout


def _post_dump_script(logp: Path, images: Path) -> tuple[Path, Path]:
    """CRIU's action script for a dump (written beside its log) and the file its errors go
    to: on ``post-dump``, ``host/tmpfsfiles.py`` saves the tree's tmpfs files into
    ``images``. Run by the daemon's interpreter with ``-I``: only the standard library."""
    script = logp.with_name(logp.name + ".post-dump.sh")
    err = logp.with_name(logp.name + ".post-dump.err")
    err.unlink(missing_ok=True)
    cmd = [sys.executable, "-I", tmpfsfiles.__file__, str(images)]
    script.write_text(
        "#!/bin/sh\n"
        '[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
        f"exec {shlex.join(cmd)} 2>>{shlex.quote(str(err))}\n"
    )
    script.chmod(0o700)
    return script, err


def _put_back_files(images: Path) -> None:
    """Before CRIU reads ``images``: the tmpfs files the tree held put back where they were
    (``host/tmpfsfiles.py``), and the files it had open for writing that grew since the dump
    (a log) cut back to the size CRIU recorded (``host/openfiles.py``, as for a
    container's rw layer), which CRIU would otherwise refuse ("bad size")."""
    try:
        names = tmpfsfiles.put_back(images)
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(f"cannot put the tree's tmpfs files back: {exc}") from exc
    if names:
        log.info("put back %d tmpfs files: %s", len(names), ", ".join(names[:8]))
    try:
        sizes = recorded_sizes(images, host_tree=True)
    except Corrupt:
        return  # CRIU reads the same images and says what is wrong with them
    for f in fit_tree(Path("/"), sizes):
        log.warning(
            "restore: %s is %d bytes, %d at the dump (written on after it): cut back to %d",
            f.path,
            f.bytes_stored,
            f.bytes_recorded,
            f.bytes_recorded,
        )


def remove_logs(log_path: Path) -> None:
    """Remove a run's log and its captured stdout; a job keeps them only when it fails."""
    log_path.unlink(missing_ok=True)
    _stdout_path(log_path).unlink(missing_ok=True)


def _stdout_path(log_path: Path) -> Path:
    return log_path.with_name(log_path.name + ".stdout")


def classify_failure(what: str, log_text: str, logp: Path, *, pid: int | None) -> GpusnapError:
    """The error kind and one-line message for a failed criu run, from its log."""
    line = most_relevant_error(log_text)
    if pid is not None and (not proctree.exists(pid) or f"{pid} (No such process)" in log_text):
        return NotFound(f"no such process: {pid}")
    if "Operation not permitted" in line and ("interrupt" in line or "seize" in line.lower()):
        return FailedPrecondition(
            f"criu {what}: not permitted to trace it ({line}): run as root with CAP_SYS_PTRACE,"
            f" and it cannot be a kernel thread (log: {logp})"
        )
    taken = _PID_TAKEN_RE.search(line)
    if taken:
        return FailedPrecondition(
            f"criu {what}: pid {taken[1]} of the checkpoint is in use on this node by "
            f"{proctree.holder(int(taken[1]))}: free it and retry (log: {logp})"
        )
    return Internal(f"criu {what} failed: {line} (log: {logp})")


def most_relevant_error(log_text: str) -> str:
    """The line that says why: a failure to seize a task, else the first ``Error (...)`` line
    that is not known noise, else the last log line."""
    errors: list[str] = []
    for raw in log_text.splitlines():
        m = _ERROR_RE.search(raw)
        if m and not any(n in raw for n in _NOISE):
            text = f"{m[3].strip()} [{m[2]}]"
            if any(s in raw for s in _SEIZE_FAILURES):
                return text
            if m[1] == "Error":
                errors.append(text)
    if errors:
        return errors[0]
    tail = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    return tail[-1] if tail else "no log output"


def parse_stats(text: str) -> dict[str, int]:
    """``--display-stats`` lines ("Frozen time: 43864 us") as {"Frozen time": 43864}."""
    if "stats:" not in text:
        return {}
    body = text.split("stats:", 1)[1]
    return {m[1].strip(): int(m[2]) for m in _STAT_RE.finditer(body)}


def systemd_running() -> bool:
    """True when systemd is the service manager (the documented sd_booted() test)."""
    return Path("/run/systemd/system").is_dir()


def _common_options(options: dict[str, object]) -> list[str]:
    argv = ["--file-locks", "--ext-unix-sk", f"--manage-cgroups={options['manage_cgroups']}"]
    argv += no_plugins_args()
    if options.get("shell_job"):
        argv.append("--shell-job")
    if options.get("tcp_established"):
        argv.append("--tcp-established")
    elif options.get("tcp_close"):
        argv.append("--tcp-close")
    return argv


def _streams_of(options: dict[str, object]) -> list[journalstream.JournalStream]:
    streams = options.get("journal_streams", [])
    assert isinstance(streams, list)
    return [s for s in streams if isinstance(s, journalstream.JournalStream)]


def _read_options(images: Path) -> dict[str, object]:
    defaults: dict[str, object] = {
        "shell_job": False,
        "tcp_established": False,
        "tcp_close": False,
        "manage_cgroups": "ignore",
        "journal_streams": [],
    }
    path = images / OPTIONS_FILE
    if not path.exists():
        return defaults
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"unreadable {path}: {exc}") from exc
    if not isinstance(loaded, dict):
        raise InvalidArgument(f"{path} is not a JSON object")
    shell, tcp = loaded.get("shell_job", False), loaded.get("tcp_established", False)
    cg = loaded.get("manage_cgroups", "ignore")
    if not isinstance(shell, bool) or not isinstance(tcp, bool) or cg not in MANAGE_CGROUPS_MODES:
        raise InvalidArgument(f"bad options in {path}: {loaded}")
    streams = loaded.get("journal_streams", [])
    if not isinstance(streams, list):
        raise InvalidArgument(f"bad journal_streams in {path}: {streams!r}")
    return {
        "shell_job": shell,
        "tcp_established": tcp,
        "tcp_close": loaded.get("tcp_close") is True,
        "manage_cgroups": cg,
        "journal_streams": [journalstream.JournalStream.from_json(e, path) for e in streams],
    }


def _read_log(logp: Path) -> str:
    try:
        return logp.read_text(errors="replace")
    except OSError:
        return ""


def _fmt(ver: tuple[int, int, int]) -> str:
    return ".".join(str(v) for v in ver)


_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02


def can_punch_holes(directory: Path) -> bool:
    """Whether files in ``directory`` can have holes punched (what ``--auto-dedup`` needs).

    tmpfs, ext4, xfs and btrfs can; some network and FUSE filesystems cannot, and a restore
    with ``--auto-dedup`` there would fail. Probed on a scratch file, which is removed.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        with tempfile.TemporaryFile(dir=directory) as fh:
            fh.write(b"\1" * 8192)
            fh.flush()
            mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
            ok = libc.fallocate(fh.fileno(), mode, ctypes.c_long(0), ctypes.c_long(4096)) == 0
    except OSError:
        return False
    return bool(ok)
