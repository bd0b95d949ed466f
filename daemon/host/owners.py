"""Whose a process and a pid file are: what gpusnapd, running as root, checks before it trusts
either on a caller's or a config's word.

A pid file names the process a root daemon will dump (and in kill mode end): whoever can write
it chooses that process, so it must be owned by root or the workload's configured ``user`` and
writable by nobody else, and it must not be a link. A process tree a caller who is not an
administrator may checkpoint must run entirely as that caller: every process's real,
effective, saved and filesystem uid. Reasons are returned as one-line strings so that the job
and ``gpusnap preflight`` say the same thing.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from collections.abc import Iterable
from pathlib import Path

from gpusnap.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

PROC = Path("/proc")


def user_uid(user: str) -> int:
    """The uid of ``user`` (a name, or a number), ``InvalidArgument`` if there is none."""
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        if user.isdigit():
            return int(user)
        raise InvalidArgument(f"no such user: {user!r}") from None


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def pid_file_problem(path: Path, st: os.stat_result, user: str | None) -> str | None:
    """Why the pid file ``path`` (its ``st``, not following a link) cannot be trusted, or None."""
    if stat.S_ISLNK(st.st_mode):
        return f"pid file {path} is a symbolic link; name the file itself"
    if not stat.S_ISREG(st.st_mode):
        return f"pid file {path} is not a regular file"
    owners = {0}
    if user is not None:
        owners.add(user_uid(user))
    if st.st_uid not in owners:
        allowed = "root" if user is None else f"root or {user}"
        return (
            f"pid file {path} is owned by {user_name(st.st_uid)}, not {allowed}: whoever "
            "writes it chooses the process gpusnapd checkpoints (set the workload's `user`, "
            "or chown it)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"pid file {path} is writable by group or others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}): chmod go-w it"
        )
    return None


def pid_file_reasons(path: Path, user: str | None) -> list[str]:
    """Why a workload's pid file is refused (empty when it is fine or not there yet)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [f"cannot stat pid file {path}: {exc.strerror}"]
    try:
        problem = pid_file_problem(path, st, user)
    except InvalidArgument as err:
        return [str(err)]
    return [problem] if problem else []


def read_pid_file(path: Path, user: str | None) -> str:
    """The text of a pid file that passes ``pid_file_problem`` (checked on the open file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NotFound(f"pid file {path} does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the last component is a link
            raise PermissionDenied(
                f"pid file {path} is a symbolic link; name the file itself"
            ) from None
        raise FailedPrecondition(f"cannot read pid file {path}: {exc.strerror}") from exc
    try:
        problem = pid_file_problem(path, os.fstat(fd), user)
        if problem:
            raise PermissionDenied(problem)
        return os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)


def uids(pid: int) -> tuple[int, int, int, int]:
    """Real, effective, saved and filesystem uid of ``pid``."""
    try:
        text = (PROC / str(pid) / "status").read_text(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        raise NotFound(f"no such process: {pid}") from None
    for line in text.splitlines():
        if line.startswith("Uid:"):
            r, e, s, f = (int(v) for v in line.split()[1:5])
            return r, e, s, f
    raise NotFound(f"no such process: {pid}")


def runs_as(pid: int, uid: int) -> bool:
    """True when every uid of ``pid`` is ``uid`` (False once it is gone)."""
    try:
        return all(u == uid for u in uids(pid))
    except NotFound:
        return False


def tree_reasons(pids: Iterable[int], uid: int) -> list[str]:
    """Why the processes ``pids`` are not all ``uid``'s own (empty when they are)."""
    reasons = []
    for pid in pids:
        try:
            found = uids(pid)
        except NotFound:
            continue  # gone: nothing of it left to take
        others = sorted({u for u in found if u != uid})
        if others:
            who = ", ".join(f"{user_name(u)} (uid {u})" for u in others)
            reasons.append(f"pid {pid} runs as {who}, not as {user_name(uid)} (uid {uid})")
    return reasons


def tree_uids(pids: Iterable[int]) -> list[int]:
    """Every uid the processes ``pids`` have (gone ones skipped): what a checkpoint records,
    so that a restore can tell whose processes it would bring back."""
    found: set[int] = set()
    for pid in pids:
        try:
            found.update(uids(pid))
        except NotFound:
            continue
    return sorted(found)
