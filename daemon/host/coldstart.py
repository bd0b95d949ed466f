"""Cold start: run a workload's launch spec fresh, detached from the daemon.

Used when a checkpoint does not fit this node. The spec comes from this node's config for the
workload (``start = {...}``) when it has one, else from the launch spec recorded in the
checkpoint's (authenticated) stamp. The process gets a new session, stdin from /dev/null and
stdout/stderr appended to a log file in the state directory, and runs as the recorded user.
The daemon keeps the ``Popen`` only to reap the process when it exits. Unless the spec says
``checkpoint_ready = false``, the process starts with io_uring off (``gpusnap/seccomp.py``, the
filter of ``gpusnap exec``), inherited by every process it starts, so that it can be
checkpointed; a launch spec recorded in a checkpoint was checkpointed, so it gets the same.
"""

from __future__ import annotations

import logging
import os
import pwd
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpusnap import seccomp
from gpusnap.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StartSpec:
    """``[[workload]] start = { command, cwd, env, user, checkpoint_ready }``: how a cold start
    runs the workload fresh where its checkpoint does not fit this node (``launch`` below); the
    config's ``[[workload]] start`` parses into one."""

    command: tuple[str, ...]
    cwd: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None
    # io_uring off for the started tree (gpusnap/seccomp.py), as `gpusnap exec` does.
    checkpoint_ready: bool = True


@dataclass(frozen=True)
class LaunchSpec(StartSpec):
    """A start spec (command, cwd, env, user) and where it came from: this node's config for
    the workload, or the checkpoint's stamp."""

    source: str = "config"  # config | checkpoint


def from_config(start: StartSpec) -> LaunchSpec:
    return LaunchSpec(
        start.command,
        start.cwd,
        dict(start.env),
        start.user,
        checkpoint_ready=start.checkpoint_ready,
        source="config",
    )


def from_stamp(launch: Any) -> LaunchSpec:
    """The launch spec a checkpoint recorded; ``InvalidArgument`` when it has none usable."""
    if not isinstance(launch, Mapping):
        raise InvalidArgument("the checkpoint records no launch spec; cannot cold-start")
    command = launch.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
        raise InvalidArgument("the checkpoint's launch spec has no command; cannot cold-start")
    env = launch.get("env") or {}
    if not isinstance(env, Mapping):
        env = {}
    cwd = launch.get("cwd")
    user = launch.get("user")
    return LaunchSpec(
        tuple(command),
        cwd if isinstance(cwd, str) else None,
        {str(k): str(v) for k, v in env.items()},
        user if isinstance(user, str) else None,
        source="checkpoint",
    )


def launch(spec: LaunchSpec, log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``spec`` detached; ``FailedPrecondition`` (one line) when it cannot start."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    user: str | int | None = None
    if spec.user is not None:
        try:
            pw = (
                pwd.getpwnam(spec.user) if not spec.user.isdigit() else pwd.getpwuid(int(spec.user))
            )
        except KeyError:
            raise FailedPrecondition(
                f"cold start: user {spec.user!r} does not exist on this node"
            ) from None
        if pw.pw_uid != os.geteuid():
            user = pw.pw_uid
    cwd = spec.cwd if spec.cwd and os.path.isdir(spec.cwd) else None
    if spec.cwd and cwd is None:
        log.warning("cold start: working directory %s is missing here; using /", spec.cwd)
        cwd = "/"
    env = _environment(spec)
    command = list(spec.command)
    if spec.checkpoint_ready:
        # io_uring off: seccomp.py runs as a script in front of the command and execs it. The
        # command is looked up here first, so that a missing one fails the cold start now.
        try:
            seccomp.resolve(command[0], env.get("PATH", os.defpath))
        except OSError as exc:
            raise FailedPrecondition(
                f"cold start: cannot run {command[0]!r}: {exc.strerror}"
            ) from exc
        command = seccomp.wrap(command)
    try:
        with open(os.devnull, "rb") as stdin, open(log_path, "ab") as out:
            proc = subprocess.Popen(
                command,
                stdin=stdin,
                stdout=out,
                stderr=out,
                cwd=cwd,
                env=env,
                user=user,
                start_new_session=True,
                close_fds=True,
            )
    except OSError as exc:
        raise FailedPrecondition(
            f"cold start: cannot run {spec.command[0]!r}: {exc.strerror or exc}"
        ) from exc
    log.info("cold start: started %s as pid %d (log %s)", spec.command[0], proc.pid, log_path)
    return proc


def _environment(spec: LaunchSpec) -> dict[str, str]:
    """A recorded environment is the process's whole environment; a configured one adds to
    the daemon's own (so PATH and the like need not be repeated in the config)."""
    if spec.source == "checkpoint":
        return dict(spec.env)
    return {**os.environ, **spec.env}
