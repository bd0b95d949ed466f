"""``gpusnap exec [--] COMMAND [ARGS...]``: run COMMAND checkpoint-ready.

io_uring is turned off for COMMAND and every process it starts (``gpusnap/seccomp.py``: CRIU
cannot dump an io_uring, and libuv, so uvloop, so vLLM's API server, opens one) and nothing
else changes: COMMAND gets this process's environment, working directory, open file
descriptors and pid (``gpusnap`` execs it), so signals reach it and its exit status is the
caller's. No daemon is needed. docs/engines.md tells how to launch engines with it.
"""

from __future__ import annotations

import argparse
import os

from gpusnap.cli._common import Subparsers, UsageError, add_command
from gpusnap.errors import FailedPrecondition, NotFound
from gpusnap.seccomp import SeccompError, block_io_uring, resolve


def register(subparsers: Subparsers) -> None:
    p = add_command(
        subparsers,
        "exec",
        cmd_exec,
        "run a command checkpoint-ready (io_uring off for it and its children)",
        parents=[],
    )
    p.description = (
        "Run COMMAND with io_uring turned off for it and every process it starts (a seccomp "
        "filter answering ENOSYS), so that CRIU can checkpoint it. Nothing else changes: "
        "environment, working directory, open files and exit status are COMMAND's."
    )
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="[--] COMMAND [ARGS...]")


def cmd_exec(args: argparse.Namespace) -> int:
    argv: list[str] = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        raise UsageError("exec: a COMMAND is required (see gpusnap exec --help)")
    try:
        path = resolve(argv[0])
    except FileNotFoundError:
        raise NotFound(f"exec: no such command: {argv[0]}") from None
    except PermissionError:
        raise FailedPrecondition(f"exec: {argv[0]}: not an executable file") from None
    try:
        block_io_uring()
    except SeccompError as exc:
        raise FailedPrecondition(f"exec: cannot turn io_uring off: {exc.strerror}") from exc
    try:
        os.execv(path, argv)  # noqa: S606 - the command as given, no shell
    except OSError as exc:
        raise FailedPrecondition(f"exec: cannot run {argv[0]}: {exc.strerror or exc}") from exc
    raise AssertionError("unreachable: execv returned")
