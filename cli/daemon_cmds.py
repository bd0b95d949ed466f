"""The commands that talk to gpusnapd: checkpoint, restore, compat, jobs, job, cancel, ls, show,
workloads, status.

Names, flags and ``--json`` keys are a contract (docs/api.md). Errors come back from the
daemon as the kind it decided and exit with that kind's code (``ERROR_TABLE``); a daemon that
cannot be reached is one line naming the socket or address, exit 5. ``--wait`` follows a job
over the Watch stream to its end, with a progress bar on stderr when stderr is a terminal; a
job that ends failed exits with the code of its error kind.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from gpusnap.cli._client import DaemonClient, connect
from gpusnap.cli._common import Subparsers, common_parser, stderr_is_tty
from gpusnap.cli._output import PROG, ProgressBar, human_bytes, print_json, render_table
from gpusnap.cli.store_cmds import render_manifest
from gpusnap.errors import (
    ERROR_TABLE,
    EXIT_OK,
    InvalidArgument,
    Unavailable,
    error_from_kind,
    exit_code_for,
)

Command = Callable[[argparse.Namespace], int]

PID_MAX_LIMIT = 1 << 22  # the kernel's hard ceiling for pid_max on 64-bit

# Keys ``--wait --json`` always prints (null when the daemon did not report one).
CHECKPOINT_WAIT_KEYS = (
    "checkpoint_id",
    "pause_seconds",
    "seconds",
    "bytes_total",
    "bytes_uploaded",
)
RESTORE_WAIT_KEYS = ("checkpoint_id", "mode", "pids", "reasons", "seconds")
TERMINAL_STATES = ("succeeded", "failed", "cancelled", "interrupted")
# A terminal state without an error kind still exits non-zero with a fitting kind.
_STATE_KINDS = {"failed": "internal", "cancelled": "cancelled", "interrupted": "unavailable"}


def _out(text: str) -> None:
    sys.stdout.write(text + "\n")


def register(subparsers: Subparsers) -> None:
    common = [common_parser()]

    p = subparsers.add_parser(
        "checkpoint", parents=common, help="checkpoint a process tree or a configured workload"
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=pid_arg, metavar="PID", help="root of the process tree")
    target.add_argument("--workload", metavar="NAME", help="a workload from the daemon's config")
    p.add_argument(
        "--leave-running", action="store_true", help="keep the workload running after the dump"
    )
    p.add_argument("--wait", action="store_true", help="follow the job to its end")
    p.set_defaults(func=cmd_checkpoint)

    p = subparsers.add_parser(
        "restore", parents=common, help="restore a checkpoint (or cold-start when incompatible)"
    )
    p.add_argument("checkpoint_id", nargs="?", metavar="ID", help="the checkpoint to restore")
    p.add_argument("--workload", metavar="NAME", help="with --latest: this workload's newest")
    p.add_argument("--latest", action="store_true", help="the workload's newest checkpoint")
    p.add_argument("--wait", action="store_true", help="follow the job to its end")
    p.set_defaults(func=cmd_restore)

    p = subparsers.add_parser(
        "compat", parents=common, help="would this checkpoint restore on this node? (and why not)"
    )
    p.add_argument("checkpoint_id", metavar="ID")
    p.set_defaults(func=cmd_compat)

    p = subparsers.add_parser("jobs", parents=common, help="list recent jobs, newest first")
    p.set_defaults(func=cmd_jobs)

    p = subparsers.add_parser("job", parents=common, help="show one job")
    p.add_argument("job_id", metavar="ID")
    p.set_defaults(func=cmd_job)

    p = subparsers.add_parser("cancel", parents=common, help="cancel a queued or running job")
    p.add_argument("job_id", metavar="ID")
    p.set_defaults(func=cmd_cancel)

    p = subparsers.add_parser("ls", parents=common, help="list checkpoints in the daemon's store")
    p.add_argument("--workload", metavar="NAME", help="only this workload's checkpoints")
    p.set_defaults(func=cmd_ls)

    p = subparsers.add_parser("show", parents=common, help="describe one checkpoint")
    p.add_argument("checkpoint_id", metavar="ID")
    p.set_defaults(func=cmd_show)

    p = subparsers.add_parser("workloads", parents=common, help="list configured workloads")
    p.set_defaults(func=cmd_workloads)

    p = subparsers.add_parser("status", parents=common, help="the daemon's status")
    p.set_defaults(func=cmd_status)


def pid_arg(text: str) -> int:
    """A process id, for argparse: 1 to PID_MAX_LIMIT (2^22, the kernel's ceiling)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r}") from None
    if not 0 < value <= PID_MAX_LIMIT:
        raise argparse.ArgumentTypeError(
            f"not a process id: {text!r} (pids are 1 to {PID_MAX_LIMIT})"
        )
    return value


# --- formatting ------------------------------------------------------------------------------


def _when(epoch: Any) -> str:
    if epoch is None or epoch == "":
        return "-"
    if isinstance(epoch, int | float):
        return datetime.fromtimestamp(float(epoch), UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    return str(epoch)


def _first(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if d.get(key) is not None:
            return d[key]
    return default


def _progress(job: dict[str, Any]) -> str:
    total = int(job.get("bytes_total") or 0)
    done = int(job.get("bytes_done") or 0)
    if total <= 0:
        return "-"
    return f"{min(100.0, 100.0 * done / total):.0f}% of {human_bytes(total)}"


def _job_lines(job: dict[str, Any]) -> list[str]:
    lines = [
        f"job       {job['id']}",
        f"kind      {job['kind']}",
        f"workload  {job['workload'] or '-'}",
        f"state     {job['state']}  (phase {job['phase']})",
        f"progress  {_progress(job)}",
        f"trigger   {job['trigger'] or '-'}",
        f"created   {_when(job['created_at'])}",
        f"started   {_when(job['started_at'])}",
        f"finished  {_when(job['finished_at'])}",
    ]
    if job.get("deadline") is not None:
        lines.append(f"deadline  {_when(job['deadline'])}")
    if job.get("error"):
        lines.append(f"error     {job['error']} ({job.get('error_kind') or 'internal'})")
    result = job.get("result") or {}
    if result:
        lines.append("result")
        lines.extend(f"  {k}: {result[k]}" for k in sorted(result))
    return lines


# --- following a job -------------------------------------------------------------------------


def _follow(client: DaemonClient, job: dict[str, Any]) -> dict[str, Any]:
    """Watch ``job`` to its terminal state; returns the final snapshot."""
    bar = ProgressBar(f"{job['kind']} {job['id']}", sys.stderr) if stderr_is_tty() else None
    last = job
    try:
        for snapshot in client.watch_job(job["id"]):
            last = snapshot
            if bar is not None and snapshot["bytes_total"]:
                bar(min(snapshot["bytes_done"], snapshot["bytes_total"]), snapshot["bytes_total"])
            if snapshot["state"] in TERMINAL_STATES:
                break
    finally:
        if bar is not None:
            bar.close()
    if last["state"] not in TERMINAL_STATES:
        # The stream ended early (daemon restarting?); ask once more before giving up.
        last = client.get_job(job["id"])
        if last["state"] not in TERMINAL_STATES:
            raise Unavailable(
                f"lost track of job {job['id']} while it was {last['state']}; "
                f"see `{PROG} job {job['id']}`"
            )
    return last


def _finish(args: argparse.Namespace, job: dict[str, Any], keys: tuple[str, ...]) -> int:
    """Print a finished job's outcome; returns the exit code its end state maps to."""
    result = dict(job.get("result") or {})
    summary: dict[str, Any] = {k: result.get(k) for k in keys}
    summary.update({k: v for k, v in result.items() if k not in summary})
    if "reasons" in keys and summary.get("reasons") is None:
        summary["reasons"] = []
    if "pids" in keys and summary.get("pids") is None:
        summary["pids"] = []
    summary.update(job_id=job["id"], state=job["state"], workload=job["workload"])
    if job["state"] == "succeeded":
        if args.json:
            print_json(summary)
        else:
            _out(_succeeded_line(job, summary))
        return EXIT_OK
    kind = job.get("error_kind") or _STATE_KINDS.get(job["state"], "internal")
    message = job.get("error") or f"job ended {job['state']}"
    code = exit_code_for(error_from_kind(kind, message))
    sys.stderr.write(f"{PROG}: error: {job['kind']} job {job['id']} {job['state']}: {message}\n")
    if args.json:
        summary.update(error=message, kind=kind, exit_code=code)
        print_json(summary)
    return code


def _succeeded_line(job: dict[str, Any], s: dict[str, Any]) -> str:
    seconds = s.get("seconds")
    took = f" in {seconds:.1f}s" if isinstance(seconds, int | float) else ""
    if job["kind"] == "checkpoint":
        pause = s.get("pause_seconds")
        paused = f", paused {pause:.2f}s" if isinstance(pause, int | float) else ""
        uploaded = s.get("bytes_uploaded")
        total = s.get("bytes_total")
        size = ""
        if isinstance(total, int | float) and isinstance(uploaded, int | float):
            size = f", {human_bytes(uploaded)} uploaded of {human_bytes(total)}"
        return f"checkpoint {s.get('checkpoint_id')} committed{took}{paused}{size}"
    pids = ", ".join(str(p) for p in s.get("pids") or []) or "-"
    if s.get("mode") == "cold-start":
        lines = [f"cold-started {job['workload'] or '-'}{took} (pids {pids}); reasons:"]
        lines.extend(f"  - {_reason_text(r)}" for r in s.get("reasons") or [])
        return "\n".join(lines)
    return f"restored {s.get('checkpoint_id')}{took} (pids {pids})"


def _reason_text(reason: Any) -> str:
    if isinstance(reason, dict):
        return str(reason.get("message") or reason)
    return str(reason)


def _queued(args: argparse.Namespace, job: dict[str, Any]) -> int:
    if args.json:
        print_json(job)
    else:
        _out(job["id"])
    return EXIT_OK


# --- commands --------------------------------------------------------------------------------


def cmd_checkpoint(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job = client.checkpoint(
            pid=args.pid, workload=args.workload, leave_running=args.leave_running
        )
        if not args.wait:
            return _queued(args, job)
        return _finish(args, _follow(client, job), CHECKPOINT_WAIT_KEYS)


def cmd_restore(args: argparse.Namespace) -> int:
    if args.checkpoint_id is not None and (args.workload or args.latest):
        raise InvalidArgument("give a checkpoint ID, or --workload NAME --latest, not both")
    if args.checkpoint_id is None and not (args.workload and args.latest):
        raise InvalidArgument("give a checkpoint ID, or --workload NAME --latest")
    with connect(args) as client:
        job = client.restore(
            checkpoint_id=args.checkpoint_id, workload=args.workload, latest=args.latest
        )
        if not args.wait:
            return _queued(args, job)
        return _finish(args, _follow(client, job), RESTORE_WAIT_KEYS)


def cmd_compat(args: argparse.Namespace) -> int:
    with connect(args) as client:
        verdict = client.compat(args.checkpoint_id)
    code = EXIT_OK if verdict["compatible"] else ERROR_TABLE["incompatible"].exit_code
    if args.json:
        print_json(verdict)
        return code
    if verdict["compatible"]:
        _out(f"{verdict['checkpoint_id']}: compatible with this node")
        return code
    _out(f"{verdict['checkpoint_id']}: NOT compatible with this node (a restore would cold-start)")
    for r in verdict["reasons"]:
        _out(
            f"  - {r['message']}  [{r['field']}: expected {r['expected']!r}, here {r['actual']!r}]"
        )
    return code


def cmd_jobs(args: argparse.Namespace) -> int:
    with connect(args) as client:
        jobs = client.list_jobs()
    if args.json:
        print_json({"jobs": jobs})
        return EXIT_OK
    rows = [
        [
            j["id"],
            j["kind"],
            j["workload"] or "-",
            j["state"],
            j["phase"],
            _progress(j),
            j["trigger"] or "-",
            _when(j["created_at"]),
        ]
        for j in jobs
    ]
    _out(
        render_table(
            ["ID", "KIND", "WORKLOAD", "STATE", "PHASE", "PROGRESS", "TRIGGER", "CREATED"], rows
        )
    )
    return EXIT_OK


def cmd_job(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job = client.get_job(args.job_id)
    if args.json:
        print_json(job)
    else:
        _out("\n".join(_job_lines(job)))
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job = client.cancel_job(args.job_id)
    if args.json:
        print_json(job)
    else:
        _out(f"{job['id']}: {job['state']}")
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    with connect(args) as client:
        checkpoints = client.list_checkpoints(args.workload)
    if args.json:
        print_json({"checkpoints": checkpoints})
        return EXIT_OK
    rows = [
        [
            str(_first(c, "checkpoint_id", "id", default="?")),
            str(_first(c, "workload", default="-")),
            _when(_first(c, "created", "created_at")),
            human_bytes(_first(c, "bytes_total", "size", "total_bytes", default=0)),
            str(_first(c, "parent", "parent_id", default="-")),
        ]
        for c in checkpoints
    ]
    _out(render_table(["ID", "WORKLOAD", "CREATED", "SIZE", "PARENT"], rows))
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    with connect(args) as client:
        manifest = client.show_checkpoint(args.checkpoint_id)
    if args.json:
        print_json(manifest)
    else:
        _out(render_manifest(manifest))
    return EXIT_OK


def cmd_workloads(args: argparse.Namespace) -> int:
    with connect(args) as client:
        workloads = client.list_workloads()
    if args.json:
        print_json({"workloads": workloads})
        return EXIT_OK
    rows = [
        [
            str(w.get("name", "?")),
            str(w.get("pid") or "-"),
            str(_first(w, "finder", "pid_file", "systemd_unit", "match", default="-")),
            _named(w.get("engine")),
            _named(w.get("model")),
            str(w.get("last_checkpoint_id") or "-"),
            _age(w.get("last_checkpoint_age_seconds")),
        ]
        for w in workloads
    ]
    headers = ["NAME", "PID", "FOUND BY", "ENGINE", "MODEL", "LAST CHECKPOINT", "AGE"]
    _out(render_table(headers, rows))
    errors = {str(w["store_error"]) for w in workloads if w.get("store_error")}
    for err in sorted(errors):
        _out(f"store unreachable, last checkpoints unknown: {err}")
    return EXIT_OK


def _age(seconds: Any) -> str:
    """``3725.2`` -> ``1h02m``; None -> ``-``."""
    if not isinstance(seconds, int | float):
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _named(value: Any) -> str:
    """``{"name": "vllm", "version": "0.11.0"}`` -> ``vllm 0.11.0``."""
    if isinstance(value, dict):
        parts = [str(value[k]) for k in ("name", "version", "revision") if value.get(k)]
        return " ".join(parts) or "-"
    return "-" if value in (None, "") else str(value)


def cmd_status(args: argparse.Namespace) -> int:
    with connect(args) as client:
        status = client.status()
    if args.json:
        print_json(status)
        return EXIT_OK
    # Scalars as "key: value"; then the store, the capabilities and the workloads' last
    # good checkpoints, each in its own shape (any of them may be missing from an older daemon).
    lines = [
        f"{key}: {value}"
        for key, value in sorted(status.items())
        if not isinstance(value, dict | list) and value is not None
    ]
    store = status.get("store")
    if isinstance(store, dict):
        lines.append(f"store_url: {store.get('url')}")
    caps = status.get("capabilities")
    if isinstance(caps, dict):
        lines += [f"{name}: {line}" for name, line in caps.items()]
    interrupted = status.get("interrupted_at_start")
    if interrupted:
        lines.append(f"interrupted at start: {', '.join(str(j) for j in interrupted)}")
    _out("\n".join(lines))
    rows = [
        [
            str(w.get("name", "?")),
            str(w.get("last_checkpoint_id") or "-"),
            _age(w.get("last_checkpoint_age_seconds")),
        ]
        for w in status.get("workloads") or []
        if isinstance(w, dict)
    ]
    if rows:
        _out(render_table(["WORKLOAD", "LAST CHECKPOINT", "AGE"], rows))
    return EXIT_OK
    store = status.get("store") or {}
    lines = [
        f"gpusnapd {status.get('version')} on {status.get('node_id')} (pid {status.get('pid')}), "
        f"up {_age(status.get('uptime_seconds'))}, {status.get('jobs_running', 0)} job(s) running",
        f"socket: {status.get('socket')}",
        f"state: {status.get('state_dir')}, staging: {status.get('staging_dir', '-')}",
        f"store: {store.get('url')}",
    ]
    for name, line in (status.get("capabilities") or {}).items():
        lines.append(f"{name}: {line}")
    if status.get("interrupted_at_start"):
        lines.append(f"interrupted at start: {', '.join(status['interrupted_at_start'])}")
    _out("\n".join(lines))
    workloads = status.get("workloads") or []
    if workloads:
        rows = [
            [
                str(w.get("name", "?")),
                str(w.get("last_checkpoint_id") or "-"),
                _age(w.get("last_checkpoint_age_seconds")),
            ]
            for w in workloads
            if isinstance(w, dict)
        ]
        _out(render_table(["WORKLOAD", "LAST CHECKPOINT", "AGE"], rows))
    return EXIT_OK
