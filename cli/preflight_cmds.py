"""``gpusnap preflight``: every reason a workload cannot be checkpointed now, before anything is
frozen (the daemon's ``Checkpoints.Preflight``; ``daemon/host/preflight.py`` decides).

Exit 0 when it can be checkpointed, 1 when not; bad input and an unreachable daemon keep their
usual codes (2, 3, 5)."""

from __future__ import annotations

import argparse
from typing import Any

from gpusnap.cli._client import connect
from gpusnap.cli._common import Subparsers, add_command
from gpusnap.cli._output import emit
from gpusnap.cli.daemon_cmds import add_target_arguments
from gpusnap.errors import EXIT_FAILURE, EXIT_OK


def register(subparsers: Subparsers) -> None:
    what = "why a process tree, workload or container cannot be checkpointed now"
    p = add_command(subparsers, "preflight", cmd_preflight, what)
    add_target_arguments(p)


def cmd_preflight(args: argparse.Namespace) -> int:
    with connect(args) as client:
        report = client.preflight(
            pid=args.pid, workload=args.workload, container=args.container, runtime=args.runtime
        )
    code = EXIT_OK if report["checkpointable"] else EXIT_FAILURE
    return emit(args.json, report, lambda: _text(report), code)


def _text(report: dict[str, Any]) -> str:
    blockers, notes = report["blockers"], report["notes"]
    if report["checkpointable"]:
        lines = ["checkpointable: yes"]
    else:
        lines = [f"checkpointable: no ({len(blockers)} blocker(s))"]
    for b in blockers:
        lines += [f"BLOCKER {b['kind']} pid {b['pid']}: {b['detail']}", f"  fix: {b['fix']}"]
    lines += [f"note {n['kind']} pid {n['pid']}: {n['detail']}" for n in notes]
    return "\n".join(lines)
