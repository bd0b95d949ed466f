"""The daemon's state directory: its layout, and the daemon's claim on it for its whole life.

``StateDirs`` names what lives there: the journal and the lock in ``state_dir``, each job's
images under ``staging`` (``[daemon] staging_dir``, default ``<state_dir>/staging``), CRIU's
and cold starts' logs under ``logs``, images a failed rescue could not restore under ``kept``.

One gpusnapd per state dir.
A daemon's start cleans up after a crash — the journal marks unfinished jobs interrupted, what
they left in staging is settled (``pipelines/recovery.py``: a kill-mode dump's complete images
restored or kept) and the rest deleted. Done by a second daemon started on the same config while the
first still runs, that cleanup would take the first daemon's in-flight images (for a kill-mode
checkpoint, the only copy of the workload). So before anything else is touched the daemon takes
an exclusive ``flock`` on ``<state_dir>/gpusnapd.lock`` (which records its pid; and on the
staging directory itself when staging lives elsewhere, since two daemons could share it) and
holds it until it exits; the kernel drops it when the process dies, however it dies. A second
daemon finds the lock taken and exits, having changed nothing.

The descriptors are not inherited (``O_CLOEXEC``), so CRIU, restored trees and cold-started
workloads never hold the lock past the daemon.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from gpusnap.daemon.jobs.job import JOB_ID
from gpusnap.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

LOCK_NAME = "gpusnapd.lock"


@dataclass(frozen=True)
class StateDirs:
    """Where this daemon keeps its state, a job's images and its logs."""

    state: Path
    staging: Path
    logs: Path
    staging_configured: bool = False  # ``[daemon] staging_dir`` given: it may be shared

    @classmethod
    def of(cls, state_dir: Path, staging_dir: Path | None) -> StateDirs:
        return cls(
            state=state_dir,
            staging=staging_dir or state_dir / "staging",
            logs=state_dir / "logs",
            staging_configured=staging_dir is not None,
        )

    def prepare(self) -> None:
        """Create them; images hold the workload's memory, so only root may read them."""
        prepare_dir(self.state, "state_dir")
        prepare_dir(self.staging, "staging_dir" if self.staging_configured else "state_dir")
        prepare_dir(self.logs, "state_dir", mode=0o755)

    def job_staging(self, job_id: str) -> Path:
        """A job's own directory under staging, removed when the job ends."""
        return self.staging / job_id

    def kept(self, job_id: str) -> Path:
        """Where a rescue that could not restore keeps the job's images."""
        return self.state / "kept" / job_id

    def kept_beside(self, job_id: str) -> Path:
        """Where they go when ``kept`` cannot take them: a rename within staging (one file
        system), named so that neither the job's end nor the next start removes it."""
        return self.staging / f"kept-{job_id}"

    def clean_staging(self) -> None:
        """At start no job runs, so every job's directory under staging is a leftover (once
        ``recovery.recover`` has settled them). Only entries named like a job id are touched:
        a configured ``staging_dir`` may be shared."""
        for entry in self.staging.iterdir():
            if not JOB_ID.fullmatch(entry.name):
                continue
            log.info("removing leftover staging %s", entry)
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def prepare_dir(path: Path, key: str, *, mode: int = 0o700) -> None:
    """Create ``path`` (and its parents) and restrict it to ``mode``; a problem is an
    ``InvalidArgument`` naming the config key (``[daemon] state_dir``) in words."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InvalidArgument(
            f"config: [daemon] {key}: {path} exists and is not a directory"
        ) from None
    except OSError as exc:
        raise InvalidArgument(f"config: [daemon] {key}: cannot create {path}: {_why(exc)}") from exc
    if not path.is_dir():
        raise InvalidArgument(f"config: [daemon] {key}: {path} is not a directory")
    try:
        os.chmod(path, mode)
    except OSError as exc:
        raise InvalidArgument(
            f"config: [daemon] {key}: cannot set the mode of {path}: {_why(exc)}"
        ) from exc


def _why(exc: OSError) -> str:
    if exc.errno == errno.EROFS:
        return "it is on a read-only file system"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission denied (gpusnapd runs as root; is it on a root-squashed mount?)"
    if exc.errno == errno.ENOTDIR:
        return "a part of the path is a file, not a directory"
    if exc.errno == errno.ENOSPC:
        return "no space left on the device"
    return exc.strerror or str(exc)


class StateDirLock:
    """Exclusive locks on the state dir (and a separate staging dir), held until ``release``."""

    def __init__(self, fds: list[int], paths: list[Path]) -> None:
        self._fds = fds
        self.paths = paths

    @classmethod
    def acquire(cls, state_dir: Path, staging_dir: Path | None = None) -> StateDirLock:
        """Create the directories and lock them; ``FailedPrecondition`` naming the holder's pid
        when another gpusnapd holds one, ``InvalidArgument`` naming the key when a directory
        cannot be used at all."""
        fds: list[int] = []
        paths: list[Path] = []
        try:
            prepare_dir(state_dir, "state_dir")
            fds.append(_lock(state_dir / LOCK_NAME, state_dir, "state_dir"))
            paths.append(state_dir / LOCK_NAME)
            if staging_dir is not None and staging_dir.resolve() != state_dir.resolve() / "staging":
                # The directory itself is locked: nothing is added to a directory the
                # operator may share with other programs.
                prepare_dir(staging_dir, "staging_dir")
                fds.append(_lock(staging_dir, staging_dir, "staging_dir"))
                paths.append(staging_dir)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return cls(fds, paths)

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _lock(lock_path: Path, directory: Path, key: str) -> int:
    """Lock ``lock_path`` (a file, created, that gets our pid; or ``directory`` itself)."""
    is_dir = lock_path == directory
    flags = os.O_CLOEXEC | os.O_NOFOLLOW
    flags |= os.O_RDONLY | os.O_DIRECTORY if is_dir else os.O_RDWR | os.O_CREAT
    try:
        fd = os.open(lock_path, flags, 0o600)
    except OSError as exc:
        raise InvalidArgument(
            f"config: [daemon] {key}: cannot open {lock_path} to lock it: {_why(exc)}"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = None if is_dir else _holder(fd)
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            who = f" (pid {holder})" if holder else ""
            raise FailedPrecondition(
                f"another gpusnapd{who} holds {directory}; one daemon per {key} (stop it "
                f"first, or give this one its own [daemon] {key} and socket)"
            ) from None
        raise InvalidArgument(
            f"config: [daemon] {key}: cannot lock {lock_path}: {_why(exc)}"
        ) from exc
    if is_dir:
        return fd
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:
        log.warning("cannot record our pid in %s: %s", lock_path, exc)
    return fd


def _holder(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
