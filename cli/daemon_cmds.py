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
from typing import Any

from gpusnap.cli._client import DaemonClient, connect, query
from gpusnap.cli._common import Subparsers, add_allow_rollback, add_command, stderr_is_tty
from gpusnap.cli._output import (
    PROG,
    emit,
    human_bytes,
    print_json,
    render_table,
    when,
)
from gpusnap.cli.manifest_view import add_show_env, redact_env, render_manifest
from gpusnap.cli.progress import ProgressBar
from gpusnap.errors import ERROR_TABLE, EXIT_OK, Unavailable, error_from_kind, exit_code_for

# The API carries a pid as an int32; whether it names a process is the daemon's to say.
_INT32_MAX = 2**31 - 1

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
# What the progress line calls a job's phase ("pending" is a job waiting for a slot).
_PHASE_SHOWN = {"pending": "queued"}
# A terminal state without an error kind still exits non-zero with a fitting kind.
_STATE_KINDS = {"failed": "internal", "cancelled": "cancelled", "interrupted": "unavailable"}


def register(subparsers: Subparsers) -> None:
    what = "checkpoint a process tree, a configured workload or a container"
    p = add_command(subparsers, "checkpoint", cmd_checkpoint, what)
    add_target_arguments(p)
    p.add_argument(
        "--leave-running", action="store_true", help="keep the workload running after the dump"
    )
    p.add_argument("--wait", action="store_true", help="follow the job to its end")

    p = add_command(
        subparsers, "restore", cmd_restore, "restore a checkpoint (or cold-start when incompatible)"
    )
    p.add_argument("checkpoint_id", nargs="?", metavar="ID", help="the checkpoint to restore")
    p.add_argument("--workload", metavar="NAME", help="with --latest: this workload's newest")
    p.add_argument("--latest", action="store_true", help="the workload's newest checkpoint")
    add_allow_rollback(p)
    p.add_argument(
        "--name", metavar="NEW", help="a container checkpoint: restore as this container"
    )
    p.add_argument("--wait", action="store_true", help="follow the job to its end")

    what = "would this checkpoint restore on this node? (and why not)"
    p = add_command(subparsers, "compat", cmd_compat, what)
    p.add_argument("checkpoint_id", metavar="ID")
    add_command(subparsers, "jobs", cmd_jobs, "list recent jobs, newest first")
    add_command(subparsers, "job", cmd_job, "show one job").add_argument("job_id", metavar="ID")
    p = add_command(subparsers, "cancel", cmd_cancel, "cancel a queued or running job")
    p.add_argument("job_id", metavar="ID")
    p = add_command(subparsers, "ls", cmd_ls, "list checkpoints in the daemon's store")
    p.add_argument("--workload", metavar="NAME", help="only this workload's checkpoints")
    p = add_command(subparsers, "show", cmd_show, "describe one checkpoint")
    p.add_argument("checkpoint_id", metavar="ID")
    add_show_env(p)
    add_command(subparsers, "workloads", cmd_workloads, "list configured workloads")
    add_command(subparsers, "status", cmd_status, "the daemon's status")


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    """What a checkpoint (or a preflight) takes: exactly one of ``--pid``, ``--workload`` and
    ``--container``, and a container's ``--runtime``."""
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--pid", type=pid_arg, metavar="PID", help="root of the process tree")
    target.add_argument("--workload", metavar="NAME", help="a workload from the daemon's config")
    target.add_argument("--container", metavar="NAME|ID", help="a container, with its GPU state")
    p.add_argument(
        "--runtime",
        choices=("podman", "runc", "containerd"),
        help="the container's runtime (default: the first of the daemon's that has it)",
    )


def pid_arg(text: str) -> int:
    """A process id, for argparse: an integer the API can carry (the daemon says whether it
    is a process it may checkpoint)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a process id: {text!r}") from None
    if abs(value) > _INT32_MAX:
        raise argparse.ArgumentTypeError(
            f"not a process id: {text!r} (the API carries pids up to {_INT32_MAX})"
        )
    return value


# --- formatting ------------------------------------------------------------------------------


def _progress(job: dict[str, Any]) -> str:
    total = int(job.get("bytes_total") or 0)
    done = int(job.get("bytes_done") or 0)
    if total <= 0:
        return "-"
    return f"{min(100.0, 100.0 * done / total):.0f}% of {human_bytes(total)}"


def _job_text(job: dict[str, Any]) -> str:
    lines = [
        f"job       {job['id']}",
        f"kind      {job['kind']}",
        f"workload  {job['workload'] or '-'}",
        f"state     {job['state']}  (phase {job['phase']})",
        f"progress  {_progress(job)}",
        f"trigger   {job['trigger'] or '-'}",
        f"created   {when(job['created_at'])}",
        f"started   {when(job['started_at'])}",
        f"finished  {when(job['finished_at'])}",
    ]
    if job.get("deadline") is not None:
        lines.append(f"deadline  {when(job['deadline'])}")
    if job.get("error"):
        lines.append(f"error     {job['error']} ({job.get('error_kind') or 'internal'})")
    result = job.get("result") or {}
    if result:
        lines.append("result")
        lines.extend(f"  {k}: {result[k]}" for k in sorted(result))
    return "\n".join(lines)


def _warm(warm: Any) -> str:
    """How much of the checkpoint this node's chunk cache holds: ``93% of 1.2 GiB``."""
    if not isinstance(warm, dict) or not isinstance(warm.get("bytes_total"), int):
        return "-"
    return f"{100 * float(warm.get('fraction') or 0):.0f}% of {human_bytes(warm['bytes_total'])}"


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


# --- following a job -------------------------------------------------------------------------


def _follow(client: DaemonClient, job: dict[str, Any]) -> dict[str, Any]:
    """Watch ``job`` to its terminal state; returns the final snapshot. On a terminal, one
    progress line per phase (``cli/progress.py``)."""
    bar = ProgressBar(f"{job['kind']} {job['id']}", sys.stderr) if stderr_is_tty() else None
    if bar is not None:
        bar.start_ticking()
    last = job
    try:
        for snapshot in client.watch_job(job["id"]):
            last = snapshot
            if snapshot["state"] in TERMINAL_STATES:
                break
            if bar is not None:
                bar.phase(_PHASE_SHOWN.get(snapshot["phase"], snapshot["phase"]))
                bar(snapshot["bytes_done"], snapshot["bytes_total"])
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
        return emit(args.json, summary, lambda: _succeeded_line(job, summary))
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
    container = s.get("container")
    as_container = f" as container {container.get('name')}" if isinstance(container, dict) else ""
    if s.get("mode") == "cold-start":
        lines = [
            f"cold-started {job['workload'] or '-'}{as_container}{took} (pids {pids}); reasons:"
        ]
        lines.extend(f"  - {_reason_text(r)}" for r in s.get("reasons") or [])
        return "\n".join(lines)
    fetched, cached = s.get("bytes_fetched"), s.get("bytes_cached")
    source = ""
    if isinstance(fetched, int) and isinstance(cached, int):
        source = (
            f"; {human_bytes(fetched)} from the store, {human_bytes(cached)} from this node's cache"
        )
    return f"restored {s.get('checkpoint_id')}{as_container}{took} (pids {pids}){source}"


def _reason_text(reason: Any) -> str:
    if isinstance(reason, dict):
        return str(reason.get("message") or reason)
    return str(reason)


def _queued_or_followed(
    args: argparse.Namespace, client: DaemonClient, job: dict[str, Any], keys: tuple[str, ...]
) -> int:
    """Without ``--wait``: the queued job (its id on stdout, for scripts, and on stderr how to
    follow it; or the job as JSON); with it, its outcome."""
    if not args.wait:
        if not args.json:
            sys.stderr.write(
                f"{job['kind']} job {job['id']} queued: `{PROG} job {job['id']}` shows how it "
                "goes (--wait follows it to its end)\n"
            )
        return emit(args.json, job, lambda: str(job["id"]))
    return _finish(args, _follow(client, job), keys)


# --- commands --------------------------------------------------------------------------------


def cmd_checkpoint(args: argparse.Namespace) -> int:
    with connect(args) as client:
        job = client.checkpoint(
            pid=args.pid,
            workload=args.workload,
            leave_running=args.leave_running,
            container=args.container,
            runtime=args.runtime,
        )
        return _queued_or_followed(args, client, job, CHECKPOINT_WAIT_KEYS)


def cmd_restore(args: argparse.Namespace) -> int:
    # Which of ID, --workload and --latest go together is the daemon's to check (exit 2).
    with connect(args) as client:
        job = client.restore(
            checkpoint_id=args.checkpoint_id,
            workload=args.workload,
            latest=args.latest,
            name=args.name,
            allow_rollback=args.allow_rollback,
        )
        return _queued_or_followed(args, client, job, RESTORE_WAIT_KEYS)


def cmd_compat(args: argparse.Namespace) -> int:
    with connect(args) as client:
        verdict = client.compat(args.checkpoint_id)
    code = EXIT_OK if verdict["compatible"] else ERROR_TABLE["incompatible"].exit_code
    return emit(args.json, verdict, lambda: _verdict_text(verdict), code)


def _verdict_text(verdict: dict[str, Any]) -> str:
    if verdict["compatible"]:
        return f"{verdict['checkpoint_id']}: compatible with this node"
    lines = [
        f"{verdict['checkpoint_id']}: NOT compatible with this node (a restore would cold-start)"
    ]
    lines.extend(
        f"  - {r['message']}  [{r['field']}: expected {r['expected']!r}, here {r['actual']!r}]"
        for r in verdict["reasons"]
    )
    return "\n".join(lines)


def cmd_jobs(args: argparse.Namespace) -> int:
    return query(args, lambda c: c.list_jobs(), _jobs_table, key="jobs")


def _jobs_table(jobs: list[dict[str, Any]]) -> str:
    rows = [
        [
            j["id"],
            j["kind"],
            j["workload"] or "-",
            j["state"],
            j["phase"],
            _progress(j),
            j["trigger"] or "-",
            when(j["created_at"]),
        ]
        for j in jobs
    ]
    headers = ["ID", "KIND", "WORKLOAD", "STATE", "PHASE", "PROGRESS", "TRIGGER", "CREATED"]
    return render_table(headers, rows)


def cmd_job(args: argparse.Namespace) -> int:
    return query(args, lambda c: c.get_job(args.job_id), _job_text)


def cmd_cancel(args: argparse.Namespace) -> int:
    return query(args, lambda c: c.cancel_job(args.job_id), lambda j: f"{j['id']}: {j['state']}")


def cmd_ls(args: argparse.Namespace) -> int:
    return query(args, lambda c: c.list_checkpoints(args.workload), _ls_table, key="checkpoints")


def _ls_table(checkpoints: list[dict[str, Any]]) -> str:
    rows = [
        [
            c["checkpoint_id"],
            c["workload"],
            when(c["created_at"]),
            human_bytes(c["bytes_total"]),
            c["parent"] or "-",
        ]
        for c in checkpoints
    ]
    return render_table(["ID", "WORKLOAD", "CREATED", "SIZE", "PARENT"], rows)


def cmd_show(args: argparse.Namespace) -> int:
    def shown(c: DaemonClient) -> dict[str, Any]:
        manifest = c.show_checkpoint(args.checkpoint_id)
        return manifest if args.show_env else redact_env(manifest)

    return query(args, shown, render_manifest)


def cmd_workloads(args: argparse.Namespace) -> int:
    return query(args, lambda c: c.list_workloads(), _workloads_text, key="workloads")


def _workloads_text(workloads: list[dict[str, Any]]) -> str:
    rows = [
        [
            w["name"],
            str(w["pid"] or "-"),
            w["finder"],
            w["engine"] or "-",
            w["model"] or "-",
            w["last_checkpoint_id"] or "-",
            _age(w["last_checkpoint_age_seconds"]),
        ]
        for w in workloads
    ]
    headers = ["NAME", "PID", "FOUND BY", "ENGINE", "MODEL", "LAST CHECKPOINT", "AGE"]
    lines = [render_table(headers, rows)]
    errors = {str(w["store_error"]) for w in workloads if w["store_error"]}
    lines.extend(f"store unreachable, last checkpoints unknown: {e}" for e in sorted(errors))
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    return query(args, lambda c: c.status(), _status_text)


def _status_text(status: dict[str, Any]) -> str:
    # Scalars as "key: value"; then the store, the capabilities and the workloads' last
    # good checkpoints, each in its own shape.
    lines = [
        f"{key}: {value}"
        for key, value in sorted(status.items())
        if not isinstance(value, dict | list)
        and value is not None
        and key not in ("triggers", "trigger_provider")
    ]
    provider = status.get("trigger_provider") or "none"
    watching = f"watching {provider}" if status.get("triggers") else "none (no cloud watcher)"
    lines.append(f"triggers: {watching}")
    store = status.get("store")
    if isinstance(store, dict):
        lines.append(f"store_url: {store.get('url')}")
    caps = status.get("capabilities")
    if isinstance(caps, dict):
        lines += [f"{name}: {line}" for name, line in caps.items()]
    criu = status.get("criu")
    if isinstance(criu, dict) and criu.get("tcp_dump_reason"):
        can = "yes" if criu.get("tcp_dump") else "no"
        lines.append(f"criu dumps tcp: {can} ({criu['tcp_dump_reason']})")
    interrupted = status.get("interrupted_at_start")
    if interrupted:
        lines.append(f"interrupted at start: {', '.join(str(j) for j in interrupted)}")
    rows = [
        [
            str(w.get("name", "?")),
            str(w.get("last_checkpoint_id") or "-"),
            _age(w.get("last_checkpoint_age_seconds")),
            _warm(w.get("warm")),
        ]
        for w in status.get("workloads") or []
        if isinstance(w, dict)
    ]
    if rows:
        lines.append(render_table(["WORKLOAD", "LAST CHECKPOINT", "AGE", "WARM HERE"], rows))
    lines += _store_check_lines(status.get("store_check"))
    return "\n".join(lines)


def _store_check_lines(check: Any) -> list[str]:
    """The background store check: when, what it covered, each damaged checkpoint."""
    if not isinstance(check, dict):
        return []
    interval = check.get("interval_seconds") or 0
    head = f"store check: every {_age(interval)}" if interval else "store check: off"
    at = check.get("last_check_at")
    if at is None:
        lines = [f"{head}; none yet"]
    else:
        lines = [
            f"{head}; last {when(at)} ({check.get('last_check_seconds') or 0:.1f}s): "
            f"{check.get('chunks_checked', 0)} chunk(s) of {check.get('checkpoints_checked', 0)}"
            f" checkpoint(s), {check.get('chunks_missing', 0)} missing"
        ]
    if check.get("error"):
        lines.append(f"store check failed {when(check.get('error_at'))}: {check['error']}")
    lines += [f"store check: manifest not read: {m}" for m in check.get("manifests_bad") or []]
    damaged = [d for d in check.get("damaged") or [] if isinstance(d, dict)]
    if damaged:
        rows = [
            [
                str(d.get("checkpoint_id")),
                str(d.get("workload")),
                str(d.get("missing_chunks")),
                "yes" if d.get("latest") else "no",
            ]
            for d in damaged
        ]
        lines.append(
            render_table(["DAMAGED CHECKPOINT", "WORKLOAD", "MISSING CHUNKS", "LATEST"], rows)
        )
    full = check.get("full_next") or {}
    lines += [f"next checkpoint of {w} is a full one: {why}" for w, why in sorted(full.items())]
    return lines
